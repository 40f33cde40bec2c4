"""MoE pricing: expert FLOPs per token and the router's all-to-all."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.moe import ALLTOALLS_PER_LAYER
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.topology import load_cluster

H100 = load_cluster("h100-8x400g")


def test_moe_flops_count_the_router_and_topk_experts():
    m = load_model("llama-moe-8x7b")
    h, layers = m.hidden_size, m.num_layers
    attn_proj = h * (h + 2 * m.kv_size) + h * h
    mlp = h * m.num_experts + m.moe_router_topk * 3 * h * m.moe_ffn_hidden_size
    assert m.linear_flops_per_token == 2.0 * (layers * (attn_proj + mlp) + h * m.vocab_size)
    # Mixtral-8x7B has ~12.9B active parameters: ~2 FLOPs each per token.
    assert m.linear_flops_per_token == pytest.approx(2 * 12.9e9, rel=0.02)


def test_router_alltoall_is_priced_only_across_expert_parallel_ranks():
    moe = load_model("llama-moe-8x7b")  # experts over the 8 GPUs of a node
    cost = CostModel(H100, moe)
    per_rank = 1000 * moe.moe_router_topk * moe.hidden_bytes_per_token
    link = cost.alltoall_link(list(range(8)))
    assert link == H100.nvlink
    expected = ALLTOALLS_PER_LAYER * moe.num_layers * cost.alltoall_s(per_rank, 8, link)
    assert cost.moe_dispatch_s(1000) == pytest.approx(expected) and expected > 0
    local = CostModel(H100, dataclasses.replace(moe, expert_parallel_size=1))
    assert local.moe_dispatch_s(1000) == 0.0
    assert cost.linear_s(1000) == pytest.approx(local.linear_s(1000) + expected)
    assert CostModel(H100, load_model("llama-7b")).moe_dispatch_s(1000) == 0.0


def test_moe_preset_checks():
    with pytest.raises(ConfigError, match="do not divide over expert_parallel_size 3"):
        dataclasses.replace(load_model("llama-moe-8x7b"), expert_parallel_size=3)
    with pytest.raises(ConfigError, match="moe_router_topk 9 must be at most num_experts 8"):
        dataclasses.replace(load_model("llama-moe-8x7b"), moe_router_topk=9)
