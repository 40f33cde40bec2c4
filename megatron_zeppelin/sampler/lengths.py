"""Document length files: what the sampler, the simulator and the tools read.

Two formats, one document per entry, in dataset order:

* ``.npy``: a one-dimensional integer array (``np.save(path, lengths)``);
* text: one integer per line; blank lines and ``#`` comments are ignored.

Every length must be a positive integer: a zero-length document carries no
token to train on and almost always means the file was produced by mistake.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megatron_zeppelin.errors import ConfigError, brief
from megatron_zeppelin.presets import CONFIG_ROOT

#: Longest document a lengths file may declare (2**40 tokens, about a trillion):
#: anything longer is a corrupt or mis-typed file, and the sampler would try to
#: allocate piece tables for it.
MAX_DOCUMENT_TOKENS = 2**40


def resolve_lengths(name_or_path: str) -> Path:
    """A lengths file by path, or a bundled sample by name (``configs/lengths/<name>.npy``):
    the one resolution the simulator, the trainer and the benchmarks share."""
    path = Path(name_or_path)
    if path.exists():
        return path
    bundled = CONFIG_ROOT / "lengths" / f"{name_or_path}.npy"
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in (CONFIG_ROOT / "lengths").glob("*.npy"))
    raise ConfigError(f"lengths file {name_or_path!r} does not exist; pass a .npy or text file, or a "
                      f"bundled sample: {', '.join(names)}")


def load_lengths(path: str | os.PathLike) -> np.ndarray:
    """Read a lengths file; returns a 1-D ``int64`` array of positive lengths."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"lengths file {str(path)!r} is a directory; pass a .npy array or a text file "
                          "with one document length per line")
    if not path.is_file():
        raise ConfigError(f"lengths file {str(path)!r} does not exist; pass a .npy array or a text file "
                          "with one document length per line")
    lengths = _load_npy(path) if path.suffix == ".npy" else _load_text(path)
    if lengths.size == 0:
        raise ConfigError(f"lengths file {str(path)!r} holds no document length; it needs at least one")
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        raise ConfigError(f"{path}: entry {bad[0]} is {lengths[bad[0]]}; every document length must be a "
                          f"positive token count ({bad.size} bad entries)")
    return lengths


def _load_npy(path: Path) -> np.ndarray:
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 -- numpy's header parser raises EOF, token and value errors
        raise ConfigError(f"{path}: not a readable .npy array ({brief(exc, 160)}); write it with "
                          "numpy.save(path, lengths.astype('int64'))") from None
    if not isinstance(data, np.ndarray):  # an .npz archive loads as a mapping
        raise ConfigError(f"{path}: expected a single .npy array, got {type(data).__name__}")
    if data.ndim != 1:
        raise ConfigError(f"{path}: expected a one-dimensional array of lengths, got shape {data.shape}")
    if data.dtype.kind not in "iu":
        raise ConfigError(f"{path}: expected an integer array, got dtype {data.dtype}; save the lengths "
                          "with .astype('int64')")
    # Checked before the cast: uint64 values past int64 would wrap negative.
    if data.size and int(data.max()) > MAX_DOCUMENT_TOKENS:
        i = int(np.argmax(data))
        raise ConfigError(f"{path}: entry {i} is {int(data[i])} tokens, more than {MAX_DOCUMENT_TOKENS} "
                          "(2**40); the file is corrupt or not a lengths array")
    return data.astype(np.int64)


def _load_text(path: Path) -> np.ndarray:
    values: list[int] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                values.append(int(text))
            except ValueError:
                raise ConfigError(f"{path}:{lineno}: {text[:40]!r} is not an integer; write one document "
                                  "length per line ('#' starts a comment)") from None
            if values[-1] <= 0:
                raise ConfigError(f"{path}:{lineno}: length {values[-1]} must be a positive token count")
            if values[-1] > MAX_DOCUMENT_TOKENS:
                raise ConfigError(f"{path}:{lineno}: length {text[:40]} is more than {MAX_DOCUMENT_TOKENS} "
                                  "(2**40) tokens; the file is corrupt or not a lengths file")
    return np.asarray(values, dtype=np.int64)
