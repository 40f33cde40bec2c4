"""The validation layer: presets and flags get types, finiteness, ranges and known names checked."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.launch.preset import load_launch_preset
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.presets import CONFIG_ROOT
from megatron_zeppelin.sampler.lengths import load_lengths
from megatron_zeppelin.topology import load_cluster
from megatron_zeppelin.validation import check_float, check_int, check_output_dir, check_output_file


def _variant(tmp_path, kind: str, base: str, **changes) -> str:
    data = yaml.safe_load((CONFIG_ROOT / kind / f"{base}.yaml").read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            data[key] = value
    path = tmp_path / f"{base}-bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("changes, message", [
    ({"nic__bandwidth_GBps": math.nan}, r"nic\]: bandwidth_GBps must be a finite number, got nan"),
    ({"nodes": 2.5}, r"nodes must be a whole number, got 2.5"),
    ({"gpu__peak_tflops": "fast"}, r"peak_tflops must be a number, got 'fast'"),
])
def test_cluster_yaml_values_are_checked(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_cluster(_variant(tmp_path, "clusters", "h100-8x400g", **changes))


@pytest.mark.parametrize("changes, message", [
    ({"num_layers": 2.5}, r"num_layers must be a whole number, got 2.5"),
    ({"num_layers": "two"}, r"num_layers must be a whole number, got 'two'"),
    ({"hidden_size": True}, r"hidden_size must be a whole number, got True"),
])
def test_model_yaml_values_are_checked(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_model(_variant(tmp_path, "models", "tiny", **changes))


def _launch_base() -> str:
    return sorted(p.stem for p in (CONFIG_ROOT / "presets").glob("*.yaml"))[0]


@pytest.mark.parametrize("changes, message", [
    ({"routing": "off"}, r"routing must be true or false \(unquoted\), got 'off'"),
    ({"nodes": 2.5}, r"nodes must be a whole number, got 2.5"),
    ({"seq_length": -4096}, r"seq_length must be >= 1, got -4096"),
    ({"cluster": "no-such-cluster"}, r"unknown cluster preset 'no-such-cluster'"),
    ({"model": "llama-7"}, r"unknown model preset 'llama-7' \(did you mean 'llama-7b'\?\)"),
    ({"lr": math.inf}, r"lr must be a finite number, got inf"),
])
def test_launch_preset_values_are_checked(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_launch_preset(_variant(tmp_path, "presets", _launch_base(), **changes))


@pytest.mark.parametrize("name, write, message", [
    ("l.txt", lambda p: p.write_text("100\n" + "1" * 24 + "\n"), r":2: length 1{24} is more than 1099511627776"),
    ("l.npy", lambda p: np.save(p, np.array([5, 2**62])), r"entry 1 is 4611686018427387904 tokens, more than"),
    ("l.npy", lambda p: np.save(p, np.array([5, 2**64 - 3], dtype=np.uint64)),
     r"entry 1 is 18446744073709551613 tokens"),
    ("l.txt", lambda p: p.mkdir(), r"is a directory"),
])
def test_lengths_files_with_impossible_values_are_one_line(tmp_path, name, write, message):
    path = tmp_path / name
    write(path)
    with pytest.raises(ConfigError, match=message):
        load_lengths(path)


def test_number_checks():
    assert check_int(np.int64(3), "x", minimum=1) == 3
    assert check_float(2, "x", positive=True) == 2.0
    for bad in (True, 2.5, "3", None):
        with pytest.raises(ConfigError, match="x must be a whole number"):
            check_int(bad, "x")
    for bad in (math.nan, -math.inf):
        with pytest.raises(ConfigError, match="x must be a finite number"):
            check_float(bad, "x")
    with pytest.raises(ConfigError, match="x must be > 0, got 0"):
        check_float(0.0, "x", positive=True)
    with pytest.raises(ConfigError, match="x must be <= 1, got 1.5"):
        check_float(1.5, "x", maximum=1)


def test_output_paths_are_proved_writable(tmp_path):
    assert check_output_dir(tmp_path / "a" / "b", "--save").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--save .* is a file, not a directory"):
        check_output_dir(tmp_path / "file", "--save")
    with pytest.raises(ConfigError, match="--save .* cannot be written"):
        check_output_dir(tmp_path / "file" / "sub", "--save")
    with pytest.raises(ConfigError, match="--json-log .* is a directory"):
        check_output_file(tmp_path, "--json-log")
    with pytest.raises(ConfigError, match="--json-log .* cannot be written"):
        check_output_file(tmp_path / "file" / "log.jsonl", "--json-log")
    assert list((tmp_path / "a" / "b").iterdir()) == []   # the probe leaves nothing behind
