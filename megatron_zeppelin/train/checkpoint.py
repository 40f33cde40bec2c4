"""Trainer checkpoints that survive a crash at any byte.

A checkpoint directory holds ``step_NNNNNN.pt`` files and a ``latest`` file
naming the complete one.  A save writes the new state to a temporary name in
the same directory, fsyncs it, renames it into place (atomic on POSIX), and
only then rewrites ``latest`` the same way; the previous checkpoint is removed
after that.  So a writer killed at any point leaves ``latest`` naming a whole
file -- the old one or the new one -- and saving into the directory a run was
loaded from is safe.  A damaged file is reported as one line naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import IO, Any, Callable

import torch

from megatron_zeppelin.errors import ConfigError, brief

LATEST = "latest"
"""File holding the name of the newest complete checkpoint of a directory."""
KEYS = ("step", "shards", "layout", "sampler", "strategy", "model_preset")
"""Entries every trainer checkpoint holds: ``shards`` maps each model-parallel
shard (``tp<i>-ep<j>``) to its model and optimizer state, ``layout`` the TP and
EP sizes they were cut at."""
_NAME = re.compile(r"step_\d{6,}\.pt")
_TEMP_PREFIX = ".tmp-"


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


def save_state(directory: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` as the directory's newest checkpoint; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(int(state["step"]))
    path = directory / name
    write_atomically(path, lambda f: torch.save(state, f))
    write_atomically(directory / LATEST, lambda f: f.write(f"{name}\n".encode()))
    # Only now is the new checkpoint the one to load: drop older ones and the
    # leftovers of saves that were killed before their rename.
    for old in directory.iterdir():
        if (_NAME.fullmatch(old.name) and old.name != name) or old.name.startswith(_TEMP_PREFIX):
            old.unlink(missing_ok=True)
    return path


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
