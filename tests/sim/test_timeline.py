"""Step timeline arithmetic on hand-built plans, and the simulate() driver with a
stand-in planner (the real planners have their own tests)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Mode, Plan, Span, placement
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.sim.simulate import SimResult, Strategy, simulate, te_cp_size
from megatron_zeppelin.sim.replay import replay_schedule
from megatron_zeppelin.sim.timeline import decision_step_s, imbalance, step_parts, step_timeline
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


def _waiting(tl, rank):
    r = tl.ranks[rank]
    assert r.total_s == pytest.approx(r.linear_s + r.attn_compute_s + r.exposed_comm_s + r.remap_s, rel=1e-9)
    return r.exposed_comm_s


def test_local_work_fills_the_gaps_of_an_inter_node_ring():
    cost = make_cost()
    # short enough for one step's gap of each pass (under bf16 dK/dV a backward
    # step's gap is shorter than under fp32, where 1024 tokens fitted)
    L, short = 8192, 512
    alone = step_timeline(make_plan(cost, [L], [(RING, (0, 2))]), cost)
    filled = step_timeline(make_plan(cost, [L, short], [(RING, (0, 2)), (LOCAL, (0,))]), cost)
    local = cost.local_attn_s(short)
    assert _waiting(alone, 0) > local > 0                 # the case under test: a gap local work can fill
    # Rank 0 ran the local sequence while its ring waited for K/V: its waiting
    # shrank by exactly the local work, and only the linear work of the extra
    # tokens made its step longer.
    a, f = alone.ranks[0], filled.ranks[0]
    assert f.exposed_comm_s == pytest.approx(a.exposed_comm_s - local, rel=1e-9)
    assert f.attn_compute_s == pytest.approx(a.attn_compute_s + local, rel=1e-9)
    assert f.total_s - a.total_s == pytest.approx(f.linear_s - a.linear_s, rel=1e-9)
    assert filled.tiers.inter == 1 and filled.tiers.local == 1


def test_local_work_longer_than_the_gaps_delays_only_what_waits_for_it():
    cost = make_cost()
    alone = step_timeline(make_plan(cost, [4096], [(RING, (0, 2))]), cost)
    long_ = step_timeline(make_plan(cost, [4096, 32768], [(RING, (0, 2)), (LOCAL, (0,))]), cost)
    local = cost.local_attn_s(32768)
    assert local > _waiting(alone, 0) > 0
    # All of rank 0's waiting disappears into the long local call; what remains
    # is less than the ring alone left, and the step grows by less than the call.
    assert _waiting(long_, 0) < _waiting(alone, 0)
    assert long_.step_s < alone.step_s + local + (long_.ranks[0].linear_s - alone.ranks[0].linear_s)


def test_te_cp_packs_identical_rank_tuples_into_one_ring():
    cost = make_cost()
    lens, places = [8192, 4096, 2048], [(RING, (0, 2)), (RING, (0, 2)), (RING, (2, 0))]
    zeppelin = make_plan(cost, lens, places)
    te = dataclasses.replace(zeppelin, strategy="te_cp")

    def kv_messages(plan):
        (_, fwd, _), *_ = step_parts(plan, cost, pack=plan.strategy == "te_cp")
        return {op.key[0]: op.nbytes for op in fwd.ops if op.name == "kv.nic"}

    # Zeppelin: one ring per sequence (3 rings x 2 positions x 1 step); TE: the
    # two sequences on (0, 2) share one ring, so each step sends both together.
    assert len(kv_messages(zeppelin)) == 3 * 2 and len(kv_messages(te)) == 2 * 2
    assert sum(kv_messages(zeppelin).values()) == sum(kv_messages(te).values())
    assert step_timeline(te, cost).step_s != pytest.approx(step_timeline(zeppelin, cost).step_s)


@pytest.mark.parametrize("ring_grad_dtype, zeppelin_ratio", [("model", 1), ("fp32", 2)])
def test_backward_ring_bytes_follow_the_ring_grad_dtype(ring_grad_dtype, zeppelin_ratio):
    # TransformerEngine's p2p ring (non-FP8) carries dK/dV in the K/V buffer's
    # dtype whatever the setting; Zeppelin's engine sends them as the setting
    # says: the bf16 K/V dtype under model, fp32 (twice the bytes) under fp32.
    cost = dataclasses.replace(make_cost(), ring_grad_dtype=ring_grad_dtype)
    zeppelin = make_plan(cost, [8192, 4096], [(RING, (0, 2)), (RING, (0, 2))])
    te = dataclasses.replace(zeppelin, strategy="te_cp")

    def sizes(plan):
        (_, _, bwd), *_ = step_parts(plan, cost, pack=plan.strategy == "te_cp")
        out = {}
        for op in bwd.ops:
            if op.nbytes:
                out.setdefault(op.name.split(".")[0], set()).add(op.nbytes)
        return out

    te_sizes, zeppelin_sizes = sizes(te), sizes(zeppelin)
    assert te_sizes["dkv"] == te_sizes["kv"]                                   # one K/V-shaped half each
    assert {zeppelin_ratio * n for n in zeppelin_sizes["kv"]} == zeppelin_sizes["dkv"]
    assert cost.model.dtype_bytes == 2 and cost.ring_grad_bytes == 2 * zeppelin_ratio


def test_the_surrogate_and_the_replay_price_the_same_ring_grad_bytes():
    """Both clocks read ``CostModel.ring_grad_bytes``: a ring over both nodes,
    bound by its transfers, takes longer under fp32 dK/dV in each, by the same."""
    from megatron_zeppelin.planner.surrogate import StepSurrogate

    model = make_cost(routing=False)
    fp32 = dataclasses.replace(model, ring_grad_dtype="fp32")
    plan = make_plan(model, [16384], [(RING, (0, 1, 2, 3))])
    replayed = [step_timeline(plan, c, reuse=False).step_s for c in (model, fp32)]
    surrogate = [StepSurrogate(c).step_s(plan) for c in (model, fp32)]
    assert replayed[1] > 1.2 * replayed[0]
    assert surrogate == pytest.approx(replayed, rel=0.02)


def test_local_work_fills_the_ulysses_all_to_all_wait():
    cost = make_cost()
    plan = make_plan(cost, [8192, 2048], [(ULYSSES, (0, 1, 2, 3)), (LOCAL, (0,))])
    tl = step_timeline(plan, cost)
    assert 0 < _waiting(tl, 0) < _waiting(tl, 3)
    assert tl.ranks[0].attn_compute_s == pytest.approx(tl.ranks[3].attn_compute_s + cost.local_attn_s(2048),
                                                       rel=1e-9)
    assert tl.tiers.ulysses == 1


def test_layout_switch_moves_every_token_it_must_and_routing_spreads_it():
    # Sequence 0 lives on rank 0 for attention; its linear tokens go 0 -> 1 (NVLink)
    # and 0 -> 2 (other node).  Rank 3 is idle in both layouts.
    seq_lens = [3000, 1000]
    linear = [[Span(0, 0, 1000)], [Span(0, 1000, 1500), Span(1, 0, 1000)], [Span(0, 1500, 3000)], []]
    remap = {}
    for routing in (True, False):
        cost = make_cost(routing=routing)
        plan = make_plan(cost, seq_lens, [(LOCAL, (0,)), (LOCAL, (1,))], linear)
        parts = dict((name, (f, b)) for name, f, b in step_parts(plan, cost))
        fwd = parts["to_linear"][0]
        h = cost.model.hidden_size * cost.model.dtype_bytes
        landed = {}
        for op in fwd.ops:
            if op.peer in (1, 2) and op.name in ("remap", "remap.nic", "remap.combine"):
                landed[op.peer] = landed.get(op.peer, 0) + op.nbytes
        assert landed == {1: 500 * h, 2: 1500 * h}
        nics = {op.nic for op in fwd.ops if op.nic is not None}
        assert nics == ({0, 1} if routing else {cost.cluster.topology.nic_of(0)})
        tl = step_timeline(plan, cost)
        # Rank 3 takes part only as the routed pieces' peer on node 1.
        assert (tl.ranks[3].remap_s > 0) == routing and tl.ranks[2].remap_s > 0
        remap[routing] = tl.ranks[2].remap_s
        assert tl.linear_imbalance == pytest.approx(1500 / 1000, rel=1e-12)
    assert remap[True] < remap[False]            # two NICs carry the 1500 tokens instead of one


def test_two_senders_share_one_nic_without_routing():
    # Ranks 0 and 1 each send 1000 tokens to node 1 at once: through one shared
    # NIC the second waits for the first; with a NIC each they go side by side.
    seq_lens = [1000, 1000]
    linear = [[], [], [Span(0, 0, 1000)], [Span(1, 0, 1000)]]
    landed = {}
    for nics in (1, 2):
        cost = make_cost(nics=nics, routing=False)
        plan = make_plan(cost, seq_lens, [(LOCAL, (0,)), (LOCAL, (1,))], linear)
        switch = dict((name, f) for name, f, _ in step_parts(plan, cost))["to_linear"]
        landed[nics] = sorted(t.end_s for t in replay_schedule(switch, cost).timings[0])
    one = cost.cluster.nic.transfer_s(1000 * cost.model.hidden_size * cost.model.dtype_bytes)
    assert landed[2] == pytest.approx([one, one], rel=1e-12)
    assert landed[1] == pytest.approx([one, 2 * one], rel=1e-12)


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


def test_a_plan_timed_before_is_served_from_the_memo():
    """The same plan timed twice in a run is replayed once; ``reuse=False`` replays
    it again, to the same step."""
    cost = make_cost()
    plan = make_plan(cost, [8192, 1024], [(RING, (0, 2)), (LOCAL, (1,))])
    fresh = step_timeline(plan, cost, reuse=False)          # replayed and remembered
    assert step_timeline(plan, cost) is fresh
    again = step_timeline(plan, cost, reuse=False)
    assert again is not fresh and decision_step_s(plan, cost) == again.step_s == fresh.step_s
