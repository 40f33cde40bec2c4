"""Loading YAML presets (clusters, models, launch presets) by name or path.

A preset is named by its file stem under ``configs/<kind>/`` (``h100-8x400g``),
or given as a path to a YAML file.  Keys map 1:1 onto dataclass fields; an
unknown or missing key is a :class:`ConfigError` that names it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from megatron_zeppelin.errors import ConfigError, brief
from megatron_zeppelin.validation import check_fields

#: ``configs/`` at the repository root; ``MEGATRON_ZEPPELIN_CONFIGS`` overrides it.
CONFIG_ROOT = Path(
    os.environ.get("MEGATRON_ZEPPELIN_CONFIGS", Path(__file__).resolve().parent.parent / "configs")
)


def preset_names(kind: str) -> list[str]:
    """Names of the bundled presets of one kind (``clusters``, ``models``, ``presets``)."""
    folder = CONFIG_ROOT / kind
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def resolve_preset(kind: str, name_or_path: str | os.PathLike) -> Path:
    """Path of a preset given by bundled name or by file path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"{kind} file {str(path)!r} does not exist; pass an existing YAML file "
                              f"or one of the bundled names: {', '.join(preset_names(kind))}")
        return path
    candidate = CONFIG_ROOT / kind / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    names = preset_names(kind)
    close = difflib.get_close_matches(str(name_or_path), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    label = "launch" if kind == "presets" else kind[:-1]
    raise ConfigError(f"unknown {label} preset {str(name_or_path)!r}{hint}; "
                      f"choose one of: {', '.join(names)} or pass a YAML file")


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML mapping, with a clear error for malformed files."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{path}: malformed YAML{line}: {brief(getattr(exc, 'problem', None) or exc)}; fix "
                          "the file (it must be a mapping of key: value)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping of key: value, got {type(data).__name__}")
    return data


def build_dataclass(cls: type, data: Mapping[str, Any], source: str) -> Any:
    """Instantiate dataclass ``cls`` from ``data``, naming unknown and missing keys."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, list(fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{source}: unknown key {k!r}{hint}; valid keys: {', '.join(fields)}")
    missing = [name for name, f in fields.items()
               if name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{source}: missing key {missing[0]!r}; add it to the file")
    check_fields(cls, data, source)   # types and finiteness; ranges are the class's own checks
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None
