"""Preset loading and the bad-input errors of topology and model configs."""

from __future__ import annotations

import pytest

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.presets import preset_names
from megatron_zeppelin.topology import Topology, load_cluster


@pytest.mark.parametrize("name", ["h100-8x400g", "a800-4x200g", "h200-8x400g", "cpu-sim"])
def test_cluster_presets_load(name):
    c = load_cluster(name, nodes=3)
    assert c.topology.nodes == 3 and c.name == name
    t = c.topology
    assert [t.node_of(r) for r in range(t.world_size)] == [r // t.gpus_per_node for r in range(t.world_size)]
    assert all(0 <= t.nic_of(r) < t.nics_per_node for r in range(t.world_size))


def test_a800_two_gpus_per_nic():
    t = load_cluster("a800-4x200g").topology
    assert [t.nic_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("name", ["llama-3b", "llama-7b", "llama-13b", "llama-30b", "llama-70b", "tiny", "tiny-ulysses"])
def test_model_presets_load(name):
    m = load_model(name)
    assert m.hidden_size % m.num_attention_heads == 0
    assert m.kv_bytes_per_token == 2 * m.kv_size * 2


def test_bundled_names_listed():
    assert {"h100-8x400g", "a800-4x200g", "h200-8x400g", "cpu-sim"} <= set(preset_names("clusters"))


def test_unknown_preset_suggests_close_name():
    with pytest.raises(ConfigError, match="did you mean 'h100-8x400g'"):
        load_cluster("h100-8x400")


def test_bad_topologies():
    with pytest.raises(ConfigError, match="3 NICs per node do not divide 8 GPUs"):
        Topology(nodes=1, gpus_per_node=8, nics_per_node=3)
    with pytest.raises(ConfigError, match="names NIC 4"):
        Topology(nodes=1, gpus_per_node=4, nics_per_node=2, nic_affinity=(0, 1, 4, 1))
    with pytest.raises(ConfigError, match="lists 3 GPUs"):
        Topology(nodes=1, gpus_per_node=4, nics_per_node=2, nic_affinity=(0, 1, 1))
    with pytest.raises(ConfigError, match="world size 6 does not match"):
        Topology(nodes=2, gpus_per_node=2, nics_per_node=1).check_world_size(6)


def test_bad_yaml_files(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: x\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                    "num_query_groups: 2\nffn_hiden_size: 128\nvocab_size: 10\n")
    with pytest.raises(ConfigError, match="unknown key 'ffn_hiden_size' \\(did you mean 'ffn_hidden_size'"):
        load_model(typo)
    heads = tmp_path / "heads.yaml"
    heads.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 5\nnum_query_groups: 5\n"
                     "ffn_hidden_size: 128\nvocab_size: 10\n")
    with pytest.raises(ConfigError, match="5 heads do not divide hidden size 64"):
        load_model(heads)
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_cluster(broken)
    missing = tmp_path / "missing.yaml"
    missing.write_text("nodes: 1\ngpus_per_node: 2\nnics_per_node: 1\n")
    with pytest.raises(ConfigError, match="section 'gpu'"):
        load_cluster(missing)
    with pytest.raises(ConfigError, match="does not exist"):
        load_cluster(tmp_path / "nope.yaml")
