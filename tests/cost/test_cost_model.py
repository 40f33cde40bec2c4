"""Cost model: units, monotonicity, and the ring/routing relations the planner relies on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.model import ATTN_BWD_RATIO
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import causal_pairs
from megatron_zeppelin.topology import load_cluster


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(load_cluster("h100-8x400g", nodes=4), load_model("llama-7b"))


def test_units_local_attention_matches_flop_count(cost):
    L = 65536
    eff = cost.attn_efficiency(L)
    flops = causal_pairs(0, L) * 4 * 4096 * 32 * (1 + ATTN_BWD_RATIO)
    assert cost.local_attn_s(L) == pytest.approx(flops / (989e12 * eff))
    # 7B: ~6 * 6.7e9 FLOPs per token for fwd+bwd linear work (rule of thumb, + logits)
    per_token = cost.linear_s(1) * 989e12 * 0.65
    assert 3 * 13.2e9 == pytest.approx(per_token, rel=0.01)


@given(st.integers(16, 1 << 20), st.integers(16, 1 << 20))
def test_monotone_in_length(a, b):
    cost = CostModel(load_cluster("a800-4x200g"), load_model("llama-3b"))
    lo, hi = sorted((a, b))
    assert cost.local_attn_s(lo) <= cost.local_attn_s(hi)
    assert cost.linear_s(lo) <= cost.linear_s(hi)
    assert cost.attn_efficiency(lo) <= cost.attn_efficiency(hi) <= cost.cluster.gpu.attn_efficiency


def test_ring_overlap_bounds(cost):
    for L, ranks in ((8192, [0, 1]), (131072, list(range(16))), (4096, list(range(32)))):
        r = cost.ring_cost([L], len(ranks), cost.link_for(ranks))
        # The critical path is at least each of compute and transfer, at most their sum.
        assert max(r.compute_s, r.transfer_s) <= r.total_s * (1 + 1e-9)
        assert r.total_s <= r.compute_s + r.transfer_s + 1e-12
        assert r.exposed_s >= 0


def test_long_sequences_earn_splits_short_ones_do_not(cost):
    nvl = cost.link_for([0, 1, 2, 3, 4, 5, 6, 7])
    long_ring = cost.ring_cost([131072], 8, nvl).total_s
    assert long_ring < cost.local_attn_s(131072) / 4
    inter = cost.link_for(list(range(16)))
    assert cost.ring_cost([2048], 16, inter).total_s > cost.local_attn_s(2048)


def test_routing_spreads_inter_node_bandwidth(cost):
    ranks = list(range(16))
    routed, direct = cost.link_for(ranks), cost.routed(False).link_for(ranks)
    assert direct == cost.cluster.nic
    # Store-and-forward hops add up: dispatch and combine 7/8 of the bytes over
    # NVLink (450 GB/s) each, 1/8 through each of 8 NICs (50 GB/s).
    assert 1 / routed.bandwidth_GBps == pytest.approx(2 * 7 / 8 / 450 + 1 / (8 * 50))
    assert cost.link_for([0, 3]) == cost.cluster.nvlink
    # Routing wins where the direct ring waits on its NIC: 64K tokens over 16 GPUs.
    slow = cost.routed(False).ring_cost([65536], 16, direct)
    assert slow.transfer_s > slow.compute_s   # the case the claim is about, on this preset
    assert cost.ring_cost([65536], 16, routed).total_s < slow.total_s


def test_alltoall_link_gets_no_routing_gain(cost):
    assert cost.alltoall_link(range(8)) == cost.cluster.nvlink
    across = cost.alltoall_link(range(16))
    # 8 NICs for 8 GPUs: each GPU has one NIC's bandwidth, routed or not.
    assert across.bandwidth_GBps == cost.cluster.nic.bandwidth_GBps
    assert cost.routed(False).alltoall_link(range(16)) == across
    a800 = CostModel(load_cluster("a800-4x200g"), load_model("llama-7b"))
    assert a800.alltoall_link(range(16)).bandwidth_GBps == pytest.approx(25 / 2)  # 2 GPUs per NIC


def test_ulysses_and_remap_costs(cost):
    nvl = cost.cluster.nvlink
    u = cost.ulysses_cost([32768], 8, nvl)
    assert u.total_s == pytest.approx(u.compute_s + u.transfer_s)
    assert u.compute_s == pytest.approx(cost.attn_s(causal_pairs(0, 32768) / 8, 32768))
    assert cost.remap_s(0, 0, messages=0) == 0
    assert cost.remap_s(1e6, 0) < cost.remap_s(0, 1e6)


def test_lower_bound_is_work_over_gpus(cost):
    lens = [1000, 50000, 3000]
    work = sum(cost.local_attn_s(L) for L in lens) + cost.linear_s(sum(lens))
    assert cost.lower_bound_s(lens) == pytest.approx(work / 32)


def test_packed_ulysses_pays_latency_once_per_group(cost):
    """470 short sequences on one group: one all-to-all per layer and pass for all
    of them (FlexSP/DeepSpeed pack), so latency is paid once, not 470 times."""
    link = cost.alltoall_link(range(64))
    many = cost.ulysses_cost([1000] * 470, 64, link)
    one = cost.ulysses_cost([470 * 1000], 64, link)
    assert many.transfer_s == pytest.approx(one.transfer_s)
    n = cost.model.num_layers
    latency = 4 * n * 63 * link.latency_us * 1e-6
    bare = cost.ulysses_cost([1000] * 470, 64, link, latency=False)
    assert many.transfer_s - bare.transfer_s == pytest.approx(latency)


def test_crossing_link_routes_only_when_it_pays(cost):
    small, big = 1e3, 1e8
    assert cost.crossing_link(small) == cost.direct_link()          # two extra hops of latency
    assert cost.crossing_link(big) == cost.routed_link()
    assert cost.routed(False).crossing_link(big) == cost.direct_link()
    # Two rings leaving one NIC halve it; two routed messages from one node share its NICs.
    assert cost.direct_link(2).bandwidth_GBps == pytest.approx(25)
    assert cost.routed_link(2).bandwidth_GBps < cost.routed_link(1).bandwidth_GBps


def test_nic_contention_between_concurrent_rings():
    from megatron_zeppelin.cost.contention import ring_links
    a800 = CostModel(load_cluster("a800-4x200g", nodes=2), load_model("llama-7b")).routed(False)
    # Rings over (0, 8) and (1, 9): GPUs 0 and 1 share NIC 0 on node 0, 8 and 9 NIC 0 on node 1.
    shared = ring_links(a800, [((0, 8), 1e8), ((1, 9), 1e8)])
    apart = ring_links(a800, [((0, 8), 1e8), ((2, 10), 1e8)])
    assert shared[0].bandwidth_GBps == pytest.approx(25 / 2)
    assert apart[0].bandwidth_GBps == pytest.approx(25)
    assert ring_links(a800, [((0, 1), 1e8)])[0] == a800.cluster.nvlink


def test_linear_s_memo_answers_as_computed_and_stays_bounded(monkeypatch):
    import megatron_zeppelin.cost.model as model
    monkeypatch.setattr(model, "LINEAR_MEMO_SIZE", 4)
    memoized = CostModel(load_cluster("h100-8x400g", nodes=4), load_model("llama-7b"), tp_size=2)
    counts = [1, 4096, 7, 4096, 65536, 3, 1, 12345, 7]
    got = [memoized.linear_s(n) for n in counts]
    assert got == [memoized.linear_s(float(n)) for n in counts]     # floats are never memoized
    assert len(memoized.linear_memo) <= 4
    assert memoized.routed(False).linear_memo == {}                 # a copy starts empty


def _ulysses_reference(cost: CostModel, lengths: list[int], d: int, link) -> tuple[float, float]:
    """(compute, latency-free transfer) of ``ulysses_cost`` as Python floats, one
    sequence at a time (the formula before it answered for arrays)."""
    compute = sum(cost.attn_s(causal_pairs(0, L) / d, L) for L in lengths)
    if d <= 1:
        return compute, 0.0
    sent = sum(cost.ulysses_bytes_per_rank(L, d) for L in lengths) * (d - 1) / d
    return compute, 2 * cost.model.num_layers * sent / (link.bandwidth_GBps * 1e9)


@pytest.mark.parametrize("cluster,model", [("h100-8x400g", "llama-7b"), ("a800-4x200g", "llama-moe-8x7b"),
                                           ("h200-8x400g", "gpt-13b")])
def test_ulysses_costs_for_arrays_equal_the_scalar_formula_bit_for_bit(cluster, model):
    """``ulysses_alone_s`` (all lengths at once) and ``ulysses_cost`` (packed) equal
    the one-sequence-at-a-time float formula exactly, on many lengths and sizes."""
    c = CostModel(load_cluster(cluster, nodes=4), load_model(model))
    rng = np.random.default_rng(0)
    lengths = sorted({1, 2, 3, 767, 768, 769, 1 << 20, 1 << 24}
                     | set(rng.integers(1, 600_000, 3000).tolist()))
    for d in (1, 2, 3, 4, 6, 8, 16, 32):
        link = c.alltoall_link(range(d))
        alone = c.ulysses_alone_s(np.array(lengths), d, link).tolist()
        for L, got in zip(lengths, alone):
            compute, transfer = _ulysses_reference(c, [L], d, link)
            assert got == compute + transfer == c.ulysses_cost([L], d, link, latency=False).total_s
        packed = c.ulysses_cost(lengths[:200], d, link)
        compute, transfer = _ulysses_reference(c, lengths[:200], d, link)
        assert packed.compute_s == compute
        assert c.ulysses_cost(lengths[:200], d, link, latency=False).transfer_s == transfer
    assert c.ulysses_cost([], 4, c.cluster.nvlink, latency=False).total_s == 0


def test_the_ring_grad_dtype_sets_the_dkv_bytes_and_refuses_other_values():
    from megatron_zeppelin.errors import ConfigError
    from megatron_zeppelin.sim.simulate import strategy_cost

    cost = CostModel(load_cluster("h100-8x400g"), load_model("llama-7b"))
    fp32 = dataclasses.replace(cost, ring_grad_dtype="fp32")
    assert (cost.ring_grad_dtype, cost.ring_grad_bytes, fp32.ring_grad_bytes) == ("model", 2, 4)
    fp32_model = dataclasses.replace(cost.model, dtype_bytes=4)
    assert CostModel(cost.cluster, fp32_model).ring_grad_bytes == CostModel(cost.cluster, fp32_model,
                                                                            ring_grad_dtype="fp32").ring_grad_bytes == 4
    with pytest.raises(ConfigError, match="'bf16' is not one of model, fp32"):
        dataclasses.replace(cost, ring_grad_dtype="bf16")
    # Zeppelin's variants follow the setting; the baselines keep TransformerEngine's.
    assert [strategy_cost(fp32, n).ring_grad_dtype for n in ("zeppelin", "zeppelin_base", "te_cp",
                                                             "megatron_hybrid_cp")] == ["fp32", "fp32", "model", "model"]
