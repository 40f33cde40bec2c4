"""Trainer checkpoints that survive a crash at any byte.

A checkpoint directory holds ``step_NNNNNN.pt`` files and a ``latest`` file
naming the complete one.  A save writes the new state to a temporary name in
the same directory, fsyncs it, renames it into place (atomic on POSIX), and
writes its SHA-256 next to it (``step_NNNNNN.pt.sha256``, the format of
``sha256sum``), and only then rewrites ``latest`` the same way; the checkpoint
this run wrote before is removed after that -- never one another run wrote,
nor the one a run resumed from.  So a writer killed at any point leaves
``latest`` naming a whole file -- the old one or the new one -- and saving into
the directory a run was loaded from is safe.  A load checks the file against
its checksum first: a damaged file (even one whose zip structure survived) is
reported as one line naming it.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import IO, Any, Callable

import torch

from megatron_zeppelin.errors import ConfigError, brief

LATEST = "latest"
"""File holding the name of the newest complete checkpoint of a directory."""
KEYS = ("step", "shards", "layout", "sampler", "strategy", "model_preset", "shape")
"""Entries every trainer checkpoint holds: ``shards`` maps each model-parallel
shard (``tp<i>-ep<j>``) to its model and optimizer state, ``layout`` the TP and
EP sizes they were cut at, ``shape`` the flags that decide the global batches
(a resume must keep them)."""
CHECKSUM_SUFFIX = ".sha256"
"""A checkpoint ``step_NNNNNN.pt``'s SHA-256 is in ``step_NNNNNN.pt.sha256``."""
_NAME = re.compile(r"step_\d{6,}\.pt")
_TEMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}.pt"


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temporary file in its directory: whoever reads
    ``path`` sees the old content or the whole new one, never a part."""
    tmp = path.with_name(f"{_TEMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    # The rename itself is durable once the directory entry is on disk.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def save_state(directory: Path, state: dict[str, Any], replaces: str | None = None) -> Path:
    """Write ``state`` as the directory's newest checkpoint; returns its path.
    ``replaces``: the name of the checkpoint the same run wrote before, removed
    once the new one is complete (no other checkpoint is ever removed)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(int(state["step"]))
    path = directory / name
    write_atomically(path, lambda f: torch.save(state, f))
    checksum = f"{file_sha256(path)}  {name}\n".encode()
    write_atomically(path.with_name(name + CHECKSUM_SUFFIX), lambda f: f.write(checksum))
    write_atomically(directory / LATEST, lambda f: f.write(f"{name}\n".encode()))
    # Only now is the new checkpoint the one to load: drop this run's previous
    # one and the leftovers of saves that were killed before their rename.
    if replaces is not None and replaces != name:
        for old in (replaces, replaces + CHECKSUM_SUFFIX):
            (directory / old).unlink(missing_ok=True)
    for old in directory.iterdir():
        if old.name.startswith(_TEMP_PREFIX):
            old.unlink(missing_ok=True)
    return path


def held_checkpoint(directory: Path) -> str | None:
    """The name of a checkpoint (or ``latest``) ``directory`` holds, if any."""
    if not directory.is_dir():
        return None
    names = sorted(p.name for p in directory.iterdir() if _NAME.fullmatch(p.name))
    return names[-1] if names else (LATEST if (directory / LATEST).exists() else None)


def latest_path(directory: Path) -> Path:
    """The complete checkpoint ``latest`` names (one clear line if there is none)."""
    pointer = directory / LATEST
    if not pointer.is_file():
        raise ConfigError(f"--load {str(directory)!r} holds no complete checkpoint (no {LATEST!r} file); "
                          "pass the --save directory of a run that finished saving")
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{pointer}: cannot be read ({exc}); the checkpoint directory is damaged") from None
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{pointer}: names {name[:60]!r}, not a checkpoint file (step_NNNNNN.pt); "
                          "the checkpoint directory is damaged")
    path = directory / name
    if not path.is_file():
        raise ConfigError(f"{pointer}: names {name}, which is missing; the checkpoint directory is damaged")
    return path


def load_state(directory: Path, map_location: torch.device) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint of ``directory``: its path and state."""
    path = latest_path(directory)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":   # torch.save writes a zip archive
        raise ConfigError(f"{path}: not a checkpoint written by torch.save ({path.stat().st_size} bytes, no zip "
                          "header); it is damaged -- load another --save directory or start without --load")
    check_checksum(path)
    try:
        # weights_only: a checkpoint is tensors and plain data; never run a pickle's code.
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- zip, pickle and EOF errors all mean a damaged file
        raise ConfigError(f"{path}: not a readable checkpoint ({brief(exc, 160)}); it is damaged -- load "
                          "another --save directory or start without --load") from None
    missing = [k for k in KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ConfigError(f"{path}: not a trainer checkpoint (no {', '.join(missing)}); pass the --save "
                          "directory of python -m megatron_zeppelin.train")
    return path, state


def check_checksum(path: Path) -> None:
    """``path``'s contents match the SHA-256 saved beside it, or one line naming it."""
    sidecar = path.with_name(path.name + CHECKSUM_SUFFIX)
    try:
        saved = sidecar.read_text(encoding="utf-8").split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        raise ConfigError(f"{path}: its checksum file {sidecar.name} is missing or unreadable, so its contents "
                          "cannot be trusted -- load another --save directory or start without --load") from None
    if file_sha256(path) != saved:
        raise ConfigError(f"{path}: contents do not match the SHA-256 in {sidecar.name}; the file is damaged -- "
                          "load another --save directory or start without --load")
