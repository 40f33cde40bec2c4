"""The replay settles the decision's close calls (``planner/zeppelin_decide.py: settled``):
where a plan with routed crossings of node-spanning rings -- what the surrogate
prices least surely -- is priced near the least, the candidates near it are
replayed and the fastest runs; elsewhere nothing is replayed."""

from __future__ import annotations

import dataclasses

from megatron_zeppelin.planner.fastest import first_least, least_within
from megatron_zeppelin.planner.surrogate import StepSurrogate
from megatron_zeppelin.planner.settle import RING_BAND, SETTLE_PLANS
from megatron_zeppelin.planner.zeppelin_decide import decide, decision_candidates
from megatron_zeppelin.sampler.lengths import resolve_lengths
from megatron_zeppelin.sim.timeline import step_timeline
from tests.planner.decision_picks import latency_case, matrix_case


def test_least_within_keeps_the_pick_and_the_banded_candidates_near_it():
    steps = [10.0, 10.4, 10.5, 10.2, 10.8, 12.0]
    bounds = [9.0, 10.1, 10.4, 10.0, 10.45, 11.9]
    bands = [0.0, 0.05, 0.05, 0.0, 0.05, 0.05]
    priced: list[int] = []

    def price(i):
        return lambda: (priced.append(i) or steps[i], i)

    close = least_within([(bounds[i], price(i)) for i in range(6)], bands)
    # 0 is the pick; 1 and 2 are within their 5 %; 3 has no band and can at best
    # tie (unpriced); 4 is priced beyond its band; 5 is bounded beyond every band.
    assert [i for *_, i in close] == [0, 1, 2] and [s for s, *_ in close] == [10.0, 10.4, 10.5]
    assert priced == [0, 1, 2, 4]
    priced.clear()
    assert first_least([(bounds[i], price(i)) for i in range(6)]) == 0 and priced == [0]


def test_a_close_call_on_routed_rings_is_settled_by_the_replay(monkeypatch):
    # 16 H100s, llama-7b, 128K synthetic-longtail: the surrogate's pick, a plan
    # whose routed rings span nodes, replays slower than a candidate it prices
    # within the band.
    case = matrix_case(resolve_lengths("synthetic-longtail"), "h100-8x400g", 16, "llama-7b", 128, True, True)
    ctx = case.context()
    replayed: list = []

    def replay(plan):
        replayed.append(plan)
        return step_timeline(plan, ctx.cost, reuse=False).step_s

    settled = decide(case.lens, dataclasses.replace(ctx, settle_model=replay))
    surrogates = decide(case.lens, dataclasses.replace(ctx, settle_model=None))
    assert 2 <= len(replayed) <= SETTLE_PLANS and surrogates in replayed and settled in replayed
    assert replay(settled) == min(replay(p) for p in replayed[:-1]) < replay(surrogates)
    # Every plan replayed is priced within the band of the least, as the decision compares them.
    clock = StepSurrogate(ctx.cost)
    least = min(clock.step_s(p) for p in decision_candidates(case.lens, ctx))
    assert all(clock.step_s(p) <= least * (1 + RING_BAND) for p in replayed)


def test_nothing_is_replayed_where_no_candidate_near_the_least_is_in_doubt():
    # Two of the latency benchmark's batches: local sequences and Ulysses groups,
    # no ring spans nodes; the pick runs routed crossings, but routing moves
    # nothing the surrogate sees of it, so its price is not in doubt; it runs
    # unreplayed.
    for case in (latency_case(16, 2), latency_case(32, 0)):
        ctx = case.context()
        replayed: list = []
        plan = decide(case.lens, dataclasses.replace(ctx, settle_model=lambda p: replayed.append(p) or 0.0))
        assert replayed == [] and plan == decide(case.lens, dataclasses.replace(ctx, settle_model=None))
