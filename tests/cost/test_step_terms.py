"""Gradient all-reduce, optimizer and tensor-parallel terms of the cost model."""

from __future__ import annotations

import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.step_sync import (ADAM_BYTES_PER_PARAM, collective_link, GRAD_BYTES, OPTIMIZER_HBM_EFFICIENCY,
                                              grad_sync_s, optimizer_s, overlapped_exposed_s,
                                              step_sync)
from megatron_zeppelin.cost.tp import tp_view
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.topology import load_cluster


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(load_cluster("h100-8x400g", nodes=4), load_model("llama-7b"))


def test_parameter_count_matches_llama_7b():
    assert load_model("llama-7b").num_parameters == 6_738_415_616   # HF LlamaForCausalLM, untied


def test_grad_sync_is_a_reduce_scatter_and_all_gather_over_every_rank(cost):
    rs, ag, buckets = grad_sync_s(cost)
    p, n = cost.model.num_parameters, 32
    assert buckets == -(-p // 40_000_000)
    link = collective_link(cost)               # across nodes: the node's 8 NICs
    assert link.bandwidth_GBps == pytest.approx(8 * 50)
    latency = buckets * (n - 1) * link.latency_us * 1e-6
    assert rs == pytest.approx((n - 1) / n * p * GRAD_BYTES / (link.bandwidth_GBps * 1e9) + latency)
    assert ag == pytest.approx((n - 1) / n * p * 2 / (link.bandwidth_GBps * 1e9) + latency)


def test_overlap_hides_all_but_the_last_bucket_when_compute_is_long(cost):
    rs, ag, buckets = grad_sync_s(cost)
    assert step_sync(cost, 100.0, 100.0).grad_exposed_s == pytest.approx((rs + ag) / buckets)
    assert step_sync(cost, 0.0, 0.0).grad_exposed_s == pytest.approx(rs + ag)
    assert overlapped_exposed_s(rs, buckets, rs / 2) == pytest.approx(rs / 2 + rs / 2 / buckets)


def test_optimizer_is_memory_bound_on_the_dp_shard(cost):
    shard = cost.model.num_parameters / 32
    assert optimizer_s(cost) == pytest.approx(shard * ADAM_BYTES_PER_PARAM / (3350e9 * OPTIMIZER_HBM_EFFICIENCY))


def test_tp_view_widens_ranks_and_charges_collectives(cost):
    tp = tp_view(cost, 8)
    assert tp.cluster.topology.world_size == 4 and tp.cluster.topology.gpus_per_node == 1
    # 8 GPUs' compute, and the TP all-reduces on top of the linear work.
    no_comm = cost.linear_s(8192) / 8
    assert tp.linear_s(8192) == pytest.approx(no_comm + tp.tp_comm_s(8192))
    assert tp.tp_comm_s(8192) > 0 and cost.tp_comm_s(8192) == 0
    # Each GPU keeps its own NIC: the group's inter-node bandwidth is 8 NICs.
    assert tp.cluster.nic.bandwidth_GBps == pytest.approx(8 * 50)
    a800 = CostModel(load_cluster("a800-4x200g", nodes=2), load_model("llama-7b"))
    assert tp_view(a800, 2).cluster.nic.bandwidth_GBps == pytest.approx(25)  # two GPUs share a NIC


def test_tp_view_rejects_sizes_the_model_or_node_cannot_use(cost):
    with pytest.raises(ConfigError, match="does not divide the 8 GPUs"):
        tp_view(cost, 16)
    odd = CostModel(cost.cluster, load_model("llama-3b"))   # check heads divide
    heads = odd.model.num_attention_heads
    bad = next(t for t in (3, 5, 6, 7) if heads % t)
    with pytest.raises(ConfigError):
        tp_view(odd, bad)


def test_cluster_yaml_missing_new_field_names_it(tmp_path):
    src = (load_cluster.__globals__["resolve_preset"]("clusters", "h100-8x400g")).read_text()
    broken = tmp_path / "c.yaml"
    broken.write_text("\n".join(line for line in src.splitlines() if "hbm_GBps" not in line))
    with pytest.raises(ConfigError, match="missing key 'hbm_GBps'"):
        load_cluster(broken)
