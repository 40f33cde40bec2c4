"""One validation layer for presets, YAML files and command-line flags.

Every value a user gives -- a key of a cluster/model/launch YAML, a flag of a
CLI -- passes through these checks before anything is built from it: its type
(``2.5`` is no layer count, ``"off"`` in quotes is no boolean), its finiteness
(``nan`` is no bandwidth), its range, and, for output paths, that they can be
written *now*, before any process starts.  Each failure is a
:class:`~megatron_zeppelin.errors.ConfigError` naming the value and the fix;
CLIs print it as one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

from megatron_zeppelin.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (ConfigError), not usage + error;
    the CLI's ``exit_on_user_error`` prints it and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see --help)")


def check_int(value: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (bools and fractions are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    value = int(value)
    _check_range(value, name, minimum, maximum)
    return value


def check_float(value: Any, name: str, minimum: float | None = None, maximum: float | None = None,
                *, positive: bool = False) -> float:
    """``value`` as a finite float in ``[minimum, maximum]`` (``positive``: > 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    if positive and value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value:g}")
    _check_range(value, name, minimum, maximum)
    return value


def _check_range(value: float, name: str, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {value}")


def check_choice(value: Any, name: str, choices: typing.Iterable[str]) -> str:
    """``value`` as one of the known names ``choices``."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


#: Most tokens a global batch may hold (2**40, the longest document a lengths
#: file may declare): past it, token counts overflow the sampler's int64 sums.
MAX_BATCH_TOKENS = 2**40


def check_batch_tokens(tokens: int, said: str) -> None:
    """A global batch of ``tokens`` (``said`` names the flags behind it) is countable."""
    if tokens > MAX_BATCH_TOKENS:
        raise ConfigError(f"a global batch of {said} = {tokens} tokens is more than {MAX_BATCH_TOKENS} (2**40); "
                          "lower them")


def check_sequence_limits(max_seq_len: Any, tokens_per_gpu: Any, ranks: int, ranks_said: str) -> None:
    """The trainer's and the simulator's one check of ``--max-seq-len`` and
    ``--tokens-per-gpu``: a piece holds a label (>= 2 tokens) and the ``ranks``
    (``ranks_said`` names them) hold one full-length piece."""
    check_int(tokens_per_gpu, "--tokens-per-gpu", minimum=1)
    check_int(max_seq_len, "--max-seq-len", minimum=2)   # one token has no label
    capacity = tokens_per_gpu * ranks
    if max_seq_len > capacity:
        raise ConfigError(f"--max-seq-len {max_seq_len} is longer than the cluster can hold ({ranks_said} x "
                          f"{tokens_per_gpu} tokens per GPU = {capacity}); raise --tokens-per-gpu or the rank "
                          "count, or lower --max-seq-len")


# ------------------------------------------------------------- dataclasses
def check_fields(cls: type, data: Mapping[str, Any], source: str) -> None:
    """Check each value of ``data`` against the type of ``cls``'s field of that
    name: int, float (finite), bool, str, and optional or tuple forms of them.
    Fields of other types (nested dataclasses) are checked by their own loader."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in data:
            _check_value(data[f.name], hints[f.name], f"{source}: {f.name}")


def _check_value(value: Any, hint: Any, name: str) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            _check_value(value, inner[0], name)
        return
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        item = args[0] if args else Any
        for i, v in enumerate(value):
            _check_value(v, item, f"{name}[{i}]")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false (unquoted), got {value!r}")
    elif hint is int:
        check_int(value, name)
    elif hint is float:
        check_float(value, name)
    elif hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")


# ------------------------------------------------------------ output paths
def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """Create directory ``path`` if needed and prove it takes a file (one line if not)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {str(target)!r} is a file, not a directory; pass a directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {str(target)!r} cannot be written ({exc.strerror or exc}); pass a "
                          "writable directory") from None
    return target


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """Prove that file ``path`` can be created or appended to (its folder is created)."""
    target = Path(path)
    if str(path).endswith(os.sep) or target.is_dir():
        raise ConfigError(f"{flag} {str(target)!r} is a directory; pass a file name")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {str(target)!r} cannot be written ({exc.strerror or exc}); pass a "
                          "writable file path") from None
    return target


def check_not_an_input(path: str | os.PathLike, flag: str, inputs: Mapping[str, Any]) -> None:
    """Output ``path`` is none of ``inputs`` (flag -> path, None skipped): writing
    it would destroy what the run reads."""
    target = Path(path)
    for source_flag, source in inputs.items():
        if source is not None and _same_file(target, Path(source)):
            raise ConfigError(f"{flag} {str(target)!r} is an input of this run ({source_flag}); writing there "
                              "would destroy it: pass another path")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b) if a.exists() and b.exists() else a.resolve() == b.resolve()
    except OSError:
        return False


def check_fresh_log(path: str | os.PathLike, flag: str, append: bool, append_flag: str) -> None:
    """A log goes into an empty or new file unless ``append`` (the user's ``append_flag``)."""
    target = Path(path)
    if not append and target.is_file() and target.stat().st_size > 0:
        raise ConfigError(f"{flag} {str(target)!r} already holds {target.stat().st_size} bytes (another run's "
                          f"log?); pass a new file, or {append_flag} to add this run after a run_start line")


def check_input_file(path: str | os.PathLike, flag: str, what: str) -> Path:
    """``path`` must be an existing regular file (a folder is named as one)."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {str(target)!r} is a directory; pass {what}")
    if not target.is_file():
        raise ConfigError(f"{flag} {str(target)!r} does not exist; pass {what}")
    return target
