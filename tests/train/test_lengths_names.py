"""The trainer takes the bundled lengths names the simulator takes (one resolution,
``sampler.lengths.resolve_lengths``)."""

from __future__ import annotations

import pytest

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.presets import CONFIG_ROOT
from megatron_zeppelin.sampler.lengths import resolve_lengths
from megatron_zeppelin.train.cli import parse_args

ARGS = ["--nodes", "1", "--gpus-per-node", "2", "--strategy", "zeppelin", "--max-seq-len", "512",
        "--tokens-per-gpu", "1024", "--steps", "1"]


@pytest.mark.parametrize("name", ["tiny-longtail", "synthetic-web"])
def test_trainer_resolves_a_bundled_name_like_the_simulator(name):
    cfg = parse_args([*ARGS, "--lengths", name])
    assert cfg.lengths == str(CONFIG_ROOT / "lengths" / f"{name}.npy")
    assert resolve_lengths(name) == CONFIG_ROOT / "lengths" / f"{name}.npy"   # what the simulator reads


def test_a_path_stays_a_path_and_an_unknown_name_lists_the_bundled_ones(tmp_path):
    own = tmp_path / "tiny-longtail"          # a file named like a bundled sample wins
    own.write_text("5\n7\n")
    assert parse_args([*ARGS, "--lengths", str(own)]).lengths == str(own)
    with pytest.raises(ConfigError, match="bundled sample: .*tiny-longtail"):
        parse_args([*ARGS, "--lengths", "tiny-longtial"])
