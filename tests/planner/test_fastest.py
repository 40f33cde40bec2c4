"""The decision's branch and bound (``planner/fastest.py``): it picks what
``min`` picks, ties included, while pricing fewer plans, and its bound
(``surrogate.layout_floor``) is below the surrogate's step on every candidate."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.baseline_candidates import baseline_candidates, baseline_drafts
from megatron_zeppelin.planner.fastest import Floor, first_least, surrogate_cost
from megatron_zeppelin.planner.surrogate import StepSurrogate, layout_floor, step_floor, surrogate_clock
from megatron_zeppelin.planner.zeppelin import ZeppelinPlanner
from megatron_zeppelin.planner.zeppelin_decide import candidate_contexts, decide, decision_candidates
from megatron_zeppelin.sampler.lengths import resolve_lengths
from tests.planner.decision_picks import latency_case, matrix_case
from tests.planner.test_containment import CLUSTERS, cost_of
from tests.planner.test_zeppelin import long_tail_batches, make_ctx


def test_first_least_is_min_with_first_ties_and_skips_what_cannot_win():
    steps = [3.0, 3.0, 7.0, 3.0, 9.0]
    bounds = [3.0, 2.0, 6.9, 3.0, 8.0]
    priced: list[int] = []

    def price(i):
        return lambda: (priced.append(i) or steps[i], i)

    assert first_least([(bounds[i], price(i)) for i in range(5)]) == 0 == min(range(5), key=steps.__getitem__)
    assert priced == [1, 0]     # 3 ties at best but comes later; 2 and 4 are bounded above it
    priced.clear()
    assert first_least([(-math.inf, price(i)) for i in range(5)]) == 0 and priced == [0, 1, 2, 3, 4]


def test_the_decision_picks_the_exhaustive_pick_pricing_fewer_plans(monkeypatch):
    calls = []
    layout_step_s = StepSurrogate.layout_step_s

    def counted(self, layout, w, routed):      # a built plan's pricing and an unbuilt draft's
        calls.append(layout)
        return layout_step_s(self, layout, w, routed)

    cases = [latency_case(16, 5), matrix_case(resolve_lengths("synthetic-longtail"), "a800-4x200g", 8,
                                              "llama-7b", 128, True, False)]
    for case in cases:
        ctx = case.context()
        plans = decision_candidates(case.lens, ctx)
        surrogate = StepSurrogate(ctx.cost)
        assert all(step_floor(ctx.cost, p) < surrogate.step_s(p) for p in plans)
        # A baseline's layout gets the bound and the step its plan gets, before the plan is built.
        for draft, routed in baseline_drafts(case.lens, ctx):
            plan = draft.candidate(routed)
            assert (layout_floor(ctx.cost, draft.arrays(), draft.tokens_per_rank())
                    == Floor(surrogate.step_s).of_layout(draft) == step_floor(ctx.cost, plan))
            assert surrogate.layout_step_s(draft.arrays(), plan.world_size, routed) == surrogate.step_s(plan)
        # So does a packing pass's (its plan priced unbuilt only without the remap).
        for option in candidate_contexts(ctx):
            for draft in ZeppelinPlanner().pass_drafts(case.lens, option):
                plan = draft.plan()
                assert Floor(surrogate.step_s).of_layout(draft) == step_floor(ctx.cost, plan)
                assert draft.remap or surrogate.layout_step_s(draft.arrays(), plan.world_size, True) \
                    == surrogate.step_s(plan)
        exhaustive = min(plans, key=surrogate.step_s)
        with monkeypatch.context() as m:
            m.setattr(StepSurrogate, "layout_step_s", counted)
            calls.clear()
            # The surrogate's own pick: no close call settled by the replay (tests/planner/test_settle.py).
            pick = decide(case.lens, dataclasses.replace(case.context(), settle_model=None))
        assert (pick.attention, pick.linear, pick.routed) == (exhaustive.attention, exhaustive.linear,
                                                              exhaustive.routed)
        # min() over the candidates priced every pass of every context, then every candidate.
        every = sum(len(ZeppelinPlanner().pass_plans(case.lens, o)) for o in candidate_contexts(ctx))
        assert 0 < len(calls) < every + len(baseline_candidates(case.lens, ctx))


def test_the_surrogate_clock_has_a_floor_and_other_step_models_none():
    cost = latency_case(8, 0).context().cost
    assert surrogate_cost(surrogate_clock(cost)) == cost
    assert surrogate_cost(lambda plan: 0.0) is None
    assert Floor(lambda plan: 0.0).of_plan(None) == -math.inf


def test_a_floor_keeps_a_packed_copy_apart_from_its_unpacked_twin():
    """A packed copy (static CP's rings, Ulysses SP's and FlexSP's groups) shares
    its twin's placements, not its arrays: the Floor bounds and prices each as
    its own, whichever it reads first (a packed ring's larger kernels lower the
    bound; a packed group's larger block lowers it where that group's ranks bound the step)."""
    case = latency_case(16, 5)
    ctx = case.context()
    surrogate = StepSurrogate(ctx.cost)
    packed = [d.candidate(routed) for d, routed in baseline_drafts(case.lens, ctx) if d.unpacked is not None]
    assert any(p.packed_rings for p in packed) and any(p.packed_ulysses for p in packed)
    floor = Floor(surrogate.step_s)
    for plan in packed:
        twin = dataclasses.replace(plan, packed_rings=(), packed_ulysses=())
        for p in (plan, twin, plan):
            assert floor.of_plan(p) == step_floor(ctx.cost, p)
            assert floor.price(surrogate.step_s, p) == surrogate.step_s(p)
        assert floor.price(surrogate.step_s, plan) != floor.price(surrogate.step_s, twin)
        if plan.packed_rings:
            assert floor.of_plan(plan) < floor.of_plan(twin)
        else:
            assert floor.of_plan(plan) <= floor.of_plan(twin)


def test_the_floor_is_below_the_surrogate_on_random_batches():
    """Every pass plan of every context and every baseline plan, on 24 random
    batches of 2 to 16 GPUs (both clusters of the containment test, routing and
    remap on and off, short and long sequences)."""
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(24):
        nodes, gpn = int(rng.integers(1, 3)), int(rng.choice([2, 4, 8]))
        cap = int(rng.choice([1024, 2048, 4096]))
        cost = cost_of(str(rng.choice(CLUSTERS)), nodes, gpn).routed(bool(rng.integers(2)))
        world = nodes * gpn
        lens = [int(x) for x in rng.integers(16, cap * min(world, 4), int(rng.integers(1, 4 * world)))]
        lens = lens[:max(1, int(np.searchsorted(np.cumsum(lens), 0.9 * cap * world)))]
        ctx = PlanContext(cost=cost, tokens_per_gpu=cap, remap_enabled=bool(rng.integers(2)),
                          step_model=surrogate_clock(cost))
        try:
            plans = [p for o in candidate_contexts(ctx) for p in ZeppelinPlanner().pass_plans(lens, o)]
        except InfeasibleError:
            continue
        plans += baseline_candidates(lens, ctx)
        surrogate = StepSurrogate(cost)
        for plan in plans:
            assert step_floor(cost, plan) <= surrogate.step_s(plan)
            checked += 1
    assert checked > 100


def test_the_direct_context_reuses_only_passes_that_never_asked_across_nodes():
    """The planner takes a direct-crossings context's passes from its routed
    twin only when those never asked about a group across nodes: the plans are
    those a fresh planner makes for it either way, on a latency batch whose
    passes stay within nodes and on the A800 batch whose routed passes take
    other inter-node groups than its direct ones
    (``test_zeppelin.py: test_routing_no_longer_buys_inter_node_rings_the_replay_calls_slower``)."""
    a800 = make_ctx(8, nics=4, cluster="a800-4x200g", model="llama-13b")
    batches = [(latency_case(16, 1).lens, latency_case(16, 1).context()),
               (long_tail_batches(7, int(0.95 * 16384 * 64), 3)[2], a800)]
    reused = []
    for lens, ctx in batches:
        routed, _, direct, _ = candidate_contexts(ctx)
        planner = ZeppelinPlanner()
        planner.pass_plans(lens, routed)
        reused.append(bool(planner._within_nodes[1]))
        again = planner.pass_plans(lens, direct)
        fresh = ZeppelinPlanner().pass_plans(lens, direct)
        assert [(p.attention, p.linear) for p in again] == [(p.attention, p.linear) for p in fresh]
    assert reused == [True, False]


def test_a_layout_planned_for_routed_crossings_is_also_offered_run_direct():
    """On the speedup matrix's A800 512K books batch (64 GPUs) routing's layouts
    put relayed pieces on ranks that hold long rings of their own (node 7's
    5-ring): their lanes post the pieces in batches beside that ring's dK/dV, so
    the pass the decision once picked replayed 38.0 s routed (the surrogate
    put it at 27.8 s) against 29.2 s for the fastest other candidate.  Each
    routed context's passes are also offered run direct: the pick is one of
    them, and it replays faster than every candidate that is not."""
    from megatron_zeppelin.cost import CostModel
    from megatron_zeppelin.model_config import load_model
    from megatron_zeppelin.sim.timeline import step_timeline
    from megatron_zeppelin.topology import load_cluster
    case = matrix_case(resolve_lengths("synthetic-books"), "a800-4x200g", 64, "llama-3b", 512, True, True)
    cost = CostModel(load_cluster("a800-4x200g", nodes=8), load_model("llama-3b"), routing=True)  # the matrix's
    ctx = PlanContext(cost=cost, tokens_per_gpu=case.cap, remap_enabled=True, remap_decided=True,
                      step_model=surrogate_clock(cost))
    pick = decide(case.lens, ctx)
    routed_passes_direct = [(p.attention, p.linear) for o in candidate_contexts(ctx) if o.cost.routing
                            for p in (d.plan(False) for d in ZeppelinPlanner().pass_drafts(case.lens, o))]
    assert not pick.routed and (pick.attention, pick.linear) in routed_passes_direct
    others = [p for p in decision_candidates(case.lens, ctx)
              if p.routed or (p.attention, p.linear) not in routed_passes_direct]
    assert len(others) >= 10
    replayed = step_timeline(pick, ctx.cost, reuse=False).step_s
    assert all(replayed < step_timeline(p, ctx.cost, reuse=False).step_s for p in others)
