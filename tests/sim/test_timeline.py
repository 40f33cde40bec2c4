"""Step timeline arithmetic on hand-built plans, and the simulate() driver with a
stand-in planner (the real planners have their own tests)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.contention import ring_links
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Mode, Plan, Span, placement
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.sim.simulate import SimResult, Strategy, simulate, te_cp_size
from megatron_zeppelin.sim.timeline import imbalance, step_timeline
from megatron_zeppelin.topology import Topology, load_cluster

LOCAL, RING, ULYSSES = Mode.LOCAL, Mode.RING, Mode.ULYSSES


def make_cost(nodes: int = 2, gpus: int = 2, nics: int = 2, routing: bool = True) -> CostModel:
    cluster = load_cluster("h100-8x400g")
    topo = Topology(nodes=nodes, gpus_per_node=gpus, nics_per_node=nics)
    return CostModel(dataclasses.replace(cluster, topology=topo), load_model("llama-7b"), routing=routing)


def make_plan(cost: CostModel, seq_lens, placements, linear=None) -> Plan:
    topo = cost.cluster.topology
    attention = tuple(placement(i, seq_lens[i], mode, ranks) for i, (mode, ranks) in enumerate(placements))
    linear = linear if linear is not None else same_layout_linear(topo.world_size, attention)
    plan = Plan("hand", topo.world_size, topo.gpus_per_node, tuple(seq_lens), attention,
                tuple(tuple(spans) for spans in linear))
    return plan.validate()


def test_local_only_matches_formula_by_hand():
    cost = make_cost()
    plan = make_plan(cost, [4096, 1024, 2048, 8], [(LOCAL, (0,)), (LOCAL, (1,)), (LOCAL, (1,)), (LOCAL, (3,))])
    tl = step_timeline(plan, cost)
    g, m = cost.cluster.gpu, cost.model

    def attn(L):  # causal pairs x 4 h layers x (1 + 2.5 backward) / (peak x eff(L))
        eff = g.attn_efficiency * L / (L + g.attn_half_block)
        return L * (L + 1) / 2 * 4 * m.hidden_size * m.num_layers * 3.5 / (g.peak_tflops * 1e12 * eff)

    def lin(tokens):
        return tokens * m.linear_flops_per_token * 3 / (g.peak_tflops * 1e12 * g.linear_efficiency)

    expect_attn = [attn(4096), attn(1024) + attn(2048), 0.0, attn(8)]
    expect_lin = [lin(4096), lin(3072), 0.0, lin(8)]
    for r, rt in enumerate(tl.ranks):
        assert rt.attn_compute_s == pytest.approx(expect_attn[r], rel=1e-12)
        assert rt.linear_s == pytest.approx(expect_lin[r], rel=1e-12)
        assert rt.exposed_comm_s == 0 and rt.remap_s == 0
    assert tl.compute_s == pytest.approx(max(a + b for a, b in zip(expect_attn, expect_lin)), rel=1e-12)
    assert tl.step_s == pytest.approx(tl.compute_s + tl.sync.grad_exposed_s + tl.sync.optimizer_s, rel=1e-12)
    assert tl.slowest_rank == 0
    assert tl.ranks[2].segments == ()
    assert (tl.tiers.local, tl.tiers.intra, tl.tiers.inter) == (4, 0, 0)


def test_inter_node_ring_exposed_comm_is_filled_by_local_work():
    cost = make_cost()
    L, short = 8192, 1024
    plan = make_plan(cost, [L, short], [(RING, (0, 2)), (LOCAL, (0,))])
    rc = cost.ring_cost([L], 2, cost.link_for((0, 2)))
    assert rc.exposed_s > cost.local_attn_s(short) > 0   # the case under test: a partly filled gap
    tl = step_timeline(plan, cost)
    r0, r2 = tl.ranks[0], tl.ranks[2]
    assert r2.attn_compute_s == pytest.approx(rc.compute_s, rel=1e-12)
    assert r2.exposed_comm_s == pytest.approx(rc.exposed_s, rel=1e-12)
    assert r0.attn_compute_s == pytest.approx(rc.compute_s + cost.local_attn_s(short), rel=1e-12)
    assert r0.exposed_comm_s == pytest.approx(rc.exposed_s - cost.local_attn_s(short), rel=1e-12)
    # Attention phase = ring total + max(0, local - ring exposed): both ranks end together.
    assert r0.attn_compute_s + r0.exposed_comm_s == pytest.approx(rc.total_s, rel=1e-12)
    assert tl.tiers.inter == 1 and tl.tiers.local == 1


def test_local_work_longer_than_gaps_hides_all_ring_comm():
    cost = make_cost()
    plan = make_plan(cost, [4096, 32768], [(RING, (0, 2)), (LOCAL, (0,))])
    rc = cost.ring_cost([4096], 2, cost.link_for((0, 2)))
    tl = step_timeline(plan, cost)
    assert cost.local_attn_s(32768) > rc.exposed_s > 0
    assert tl.ranks[0].exposed_comm_s == 0
    assert tl.ranks[2].exposed_comm_s == pytest.approx(rc.exposed_s, rel=1e-12)
    assert tl.ranks[0].attn_compute_s == pytest.approx(rc.compute_s + cost.local_attn_s(32768), rel=1e-12)


def test_identical_rank_tuples_pack_into_one_ring():
    cost = make_cost()
    plan = make_plan(cost, [8192, 4096, 2048], [(RING, (0, 2)), (RING, (0, 2)), (RING, (2, 0))])
    kv = cost.model.kv_bytes_per_token
    # Both rings cross both node boundaries at once: they share the NICs.
    shared, shared_alone = ring_links(cost, [((0, 2), kv * 12288 / 2), ((2, 0), kv * 2048 / 2)])
    packed = cost.ring_cost([8192, 4096], 2, shared)
    alone = cost.ring_cost([2048], 2, shared_alone)
    link = cost.link_for((0, 2))
    tl = step_timeline(plan, cost)
    for r in (0, 2):
        assert tl.ranks[r].attn_compute_s == pytest.approx(packed.compute_s + alone.compute_s, rel=1e-12)
        assert tl.ranks[r].exposed_comm_s == pytest.approx(packed.exposed_s + alone.exposed_s, rel=1e-12)
    separate = sum(cost.ring_cost([L], 2, link).exposed_s for L in (8192, 4096))
    assert packed.exposed_s != pytest.approx(separate)     # packing changes the cost


def test_ulysses_comm_is_not_hidden_by_local_work():
    cost = make_cost()
    plan = make_plan(cost, [8192, 65536], [(ULYSSES, (0, 1, 2, 3)), (LOCAL, (0,))])
    uc = cost.ulysses_cost([8192], 4, cost.alltoall_link((0, 1, 2, 3)))
    tl = step_timeline(plan, cost)
    assert tl.ranks[0].exposed_comm_s == pytest.approx(uc.exposed_s, rel=1e-12)
    assert tl.ranks[0].attn_compute_s == pytest.approx(uc.compute_s + cost.local_attn_s(65536), rel=1e-12)
    assert tl.ranks[3].attn_compute_s == pytest.approx(uc.compute_s, rel=1e-12)
    assert tl.tiers.ulysses == 1


def test_remap_bytes_split_intra_inter_and_by_routing():
    # Sequence 0 lives on rank 0 for attention; its linear tokens go 0 -> 1 (NVLink)
    # and 0 -> 2 (other node).  Rank 3 is idle in both layouts.
    seq_lens = [3000, 1000]
    linear = [[Span(0, 0, 1000)], [Span(0, 1000, 1500), Span(1, 0, 1000)], [Span(0, 1500, 3000)], []]
    for routing in (True, False):
        cost = make_cost(routing=routing)
        plan = make_plan(cost, seq_lens, [(LOCAL, (0,)), (LOCAL, (1,))], linear)
        h = cost.model.hidden_bytes_per_token
        tl = step_timeline(plan, cost)
        expect = cost.remap_s(500 * h, 1500 * h, messages=2)   # rank 0 talks to 2 peers
        assert all(r.remap_s == pytest.approx(expect, rel=1e-12) for r in tl.ranks)
        # By hand: 4 switches per layer, the slower of NVLink and the node's NICs.
        c = cost.cluster
        nic_bw = c.nic.bandwidth_GBps * (2 if routing else 1) * 1e9
        one = max(500 * h / (c.nvlink.bandwidth_GBps * 1e9), 1500 * h / nic_bw) + 2 * c.nvlink.latency_us * 1e-6
        assert expect == pytest.approx(4 * cost.model.num_layers * one, rel=1e-12)
        assert tl.linear_imbalance == pytest.approx(1500 / 1000, rel=1e-12)


def test_remap_inter_node_counts_busiest_node_with_routing_busiest_nic_without():
    # Ranks 0 and 1 each send 1000 tokens to node 1.
    seq_lens = [1000, 1000]
    linear = [[], [], [Span(0, 0, 1000)], [Span(1, 0, 1000)]]
    cases = [  # (NICs per node, routing, inter-node tokens on the busiest unit)
        (1, False, 2000),   # both GPUs share NIC 0
        (2, False, 1000),   # one NIC per GPU: each carries its own tokens
        (2, True, 2000),    # the node's two NICs carry all of the node's tokens together
    ]
    for nics, routing, busiest in cases:
        cost = make_cost(nics=nics, routing=routing)
        plan = make_plan(cost, seq_lens, [(LOCAL, (0,)), (LOCAL, (1,))], linear)
        h = cost.model.hidden_bytes_per_token
        got = step_timeline(plan, cost).ranks[0].remap_s
        assert got == pytest.approx(cost.remap_s(0, busiest * h, 1), rel=1e-12), (nics, routing)


def test_imbalance():
    assert imbalance([1, 1, 1]) == 1.0
    assert imbalance([3, 1, 0, 0]) == 3.0
    assert imbalance([0, 0]) == 1.0


def test_te_cp_size():
    assert te_cp_size(131072, 16384) == 8
    assert te_cp_size(131073, 16384) == 16
    assert te_cp_size(1000, 16384) == 1


# ------------------------------------------------------- property: random plans

class StandInPlanner:
    """Test stand-in: sequences over ``ring_over`` tokens ring over two ranks
    (alternately intra- and inter-node), the rest go local to the least loaded rank."""

    name = "standin"

    def __init__(self, ring_over: int = 4096, cap_error: bool = False):
        self.ring_over, self.cap_error = ring_over, cap_error

    def plan(self, seq_lens, ctx):
        topo = ctx.topology
        w, g = topo.world_size, topo.gpus_per_node
        if self.cap_error and max(seq_lens) > ctx.tokens_per_gpu:
            raise InfeasibleError(f"sequence of {max(seq_lens)} tokens over the cap")
        load, attention = [0] * w, []
        for i, L in enumerate(seq_lens):
            if L >= self.ring_over and w > 1:
                a = i % w
                b = (a + g) % w if i % 2 and topo.nodes > 1 else (a + 1) % w
                attention.append(placement(i, L, RING, (a, b)))
                load[a] += L // 2
                load[b] += L // 2
            else:
                r = min(range(w), key=load.__getitem__)
                attention.append(placement(i, L, LOCAL, (r,)))
                load[r] += L
        return Plan(self.name, w, g, tuple(seq_lens), tuple(attention), same_layout_linear(w, attention))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(8, 40000), min_size=1, max_size=24), st.booleans())
def test_timeline_identities_on_random_plans(seq_lens, routing):
    cost = make_cost(nodes=2, gpus=4, nics=2, routing=routing)
    plan = StandInPlanner().plan(seq_lens, PlanContext(cost=cost, tokens_per_gpu=1 << 20)).validate()
    tl = step_timeline(plan, cost)
    assert len(tl.ranks) == 8
    for r in tl.ranks:
        parts = r.linear_s + r.attn_compute_s + r.exposed_comm_s + r.remap_s
        assert r.total_s == pytest.approx(parts, rel=1e-12)
        assert min(r.linear_s, r.attn_compute_s, r.exposed_comm_s, r.remap_s) >= 0
        assert sum(s.duration_s for s in r.segments) == pytest.approx(r.total_s, rel=1e-12)
        assert all(a.start_s + a.duration_s == pytest.approx(b.start_s) for a, b in zip(r.segments, r.segments[1:]))
    assert tl.step_s == max(r.total_s for r in tl.ranks) + tl.sync.exposed_s
    pairs = plan.attn_pairs_per_rank()
    assert tl.attn_imbalance == pytest.approx(max(pairs) / (sum(pairs) / 8), rel=1e-12)
    # Linear time is exactly linear in tokens, and the layout covers every token once.
    assert sum(r.linear_s for r in tl.ranks) == pytest.approx(cost.linear_s(sum(seq_lens)), rel=1e-9)


# -------------------------------------------------------------- simulate()

def test_simulate_records_infeasible_and_speedups():
    cost = make_cost(routing=False)
    batches = [[1000, 9000, 300], [20000, 100], [500] * 8]
    strategies = [Strategy("te_cp", StandInPlanner(ring_over=1 << 30), cost),
                  Strategy("ringy", StandInPlanner(ring_over=4096), cost.routed(True)),
                  Strategy("capped", StandInPlanner(cap_error=True), cost)]
    seen = []
    res = simulate(batches, strategies, tokens_per_gpu=16384, on_plan=lambda k, n, p: seen.append((k, n)),
                   plot_step=1)
    assert isinstance(res, SimResult) and res.seq_lens == batches
    assert seen == [(0, "te_cp"), (0, "ringy"), (0, "capped"), (1, "te_cp"), (1, "ringy"),
                    (2, "te_cp"), (2, "ringy")]     # capped stops after its first failure
    capped = res.strategies["capped"]
    assert not capped.feasible and capped.error.startswith("step 1: sequence of 20000 tokens")
    assert capped.step_time_s is None and res.speedup("capped") is None
    te, ringy = res.strategies["te_cp"], res.strategies["ringy"]
    expect = [step_timeline(StandInPlanner(1 << 30).plan(b, _ctx(cost)), cost).step_s for b in batches]
    assert te.step_s == pytest.approx(expect, rel=1e-12)
    assert res.speedup("ringy") == pytest.approx(te.step_time_s / ringy.step_time_s, rel=1e-12)
    assert res.speedup("te_cp") == pytest.approx(1.0)
    assert res.lower_bound_step_s == pytest.approx(sum(cost.lower_bound_s(b) for b in batches) / 3, rel=1e-12)
    assert te.timeline is not None and te.timeline.step_s == pytest.approx(expect[1], rel=1e-12)
    d = res.to_dict({"x": 1})
    assert d["steps"] == 3 and d["config"] == {"x": 1}
    assert d["strategies"]["capped"]["feasible"] is False
    assert d["strategies"]["capped"]["step_time_s"] is None
    assert set(d["strategies"]["ringy"]) >= {"step_time_s", "planner_ms", "speedup_vs_te_cp", "feasible", "error"}
    assert len(te.planner_ms) == 3 and all(ms >= 0 for ms in te.planner_ms)


def _ctx(cost):
    return PlanContext(cost=cost, tokens_per_gpu=16384)
