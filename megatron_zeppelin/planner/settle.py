"""The replay settles the decision's close calls.

The decision (``planner/zeppelin_decide.py``) prices its candidates by the
replay's surrogate, which is exact on most plans and least sure on routed
crossings: relays' lanes carry relayed pieces beside rings of their own, and
the surrogate prices such plans up to 6-14 % too fast (TP views of two ranks a
node, where every relay holds a ring, are the worst; docs/results/surrogate.md).
So where a candidate whose price is in doubt is priced near the least, the
plans near it are replayed (``PlanContext.settle_model``, the replay's step)
and the fastest runs.  A candidate is in doubt when it runs crossings of
node-spanning rings (routed ones most of all), or other routed crossings
(Ulysses groups', the remap's) whose routing moves its price; other direct
plans are taken at the surrogate's word.  Nothing is replayed on batches
without such candidates near the least, which keeps the decision's median
latency where it was (docs/results/planner_latency.md).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.fastest import Candidate, Floor, LaidOut, layout_key, least_within
from megatron_zeppelin.planner.plan_arrays import has_inter_node_ring
from megatron_zeppelin.planner.surrogate import StepSurrogate

#: How far above the least surrogate step a plan with routed crossings of
#: node-spanning rings is a close call.  The surrogate's error on such plans of
#: the speedup matrix's cells: p95 6.95 %, p99 11.9 % (1,036 plans); the
#: replay's fastest candidate was priced up to +4.5 % above the surrogate's pick
#: (llama-30b a800 256K python-dirs, TP=4).
RING_BAND = 0.05
#: The same for a plan whose other routed crossings move its price: the
#: surrogate's error on routed plans without node-spanning rings there: p95
#: 0.33 %, p99 0.99 % (545 plans).
ROUTED_BAND = 0.01
#: The same for a plan of direct crossings with node-spanning rings: the
#: surrogate's error on such plans of the speedup matrix's cells: p95 1.97 %,
#: p99 4.42 % (1,294 plans); the replay's fastest candidate was priced 1.08 %
#: above such a pick (llama-30b h100 256K synthetic-longtail, TP=4).
DIRECT_RING_BAND = 0.02
#: The narrower bands (:data:`ROUTED_BAND`, :data:`DIRECT_RING_BAND`: at most
#: 2 % to gain) are settled only on batches of at most this many sequences: a
#: replay's CPU time grows with them (15-40 ms at 64 GPUs and 1,024 sequences,
#: ~0.7 s at 1,024 GPUs and 16K), and on batches of many short sequences they
#: would replay on a third of the batches for a few tenths of a percent; the
#: speedup matrix's cells they settle hold 36-94.
NARROW_BANDS_MAX_SEQUENCES = 512
#: At most this many distinct plans are replayed per batch, the closest first (on
#: llama-30b a800 128K python-dirs, TP=4, the fastest was the fifth).
SETTLE_PLANS = 6


def doubt_band(routed: bool, layouts: Sequence[LaidOut], gpus_per_node: int, sequences: int) -> float:
    """The band a candidate is priced within, before its plan is built:
    :data:`RING_BAND` for routed crossings of node-spanning rings,
    :data:`ROUTED_BAND` for other routed crossings (in doubt only if routing
    moves its price: :func:`settle` checks), :data:`DIRECT_RING_BAND` for
    direct crossings of node-spanning rings, 0 for other direct plans; the
    narrower two only on batches of at most :data:`NARROW_BANDS_MAX_SEQUENCES`
    ``sequences``."""
    rings = any(has_inter_node_ring(d.arrays(), gpus_per_node) for d in layouts)
    if routed and rings:
        return RING_BAND
    if sequences > NARROW_BANDS_MAX_SEQUENCES:
        return 0.0
    return (DIRECT_RING_BAND if rings else 0.0) if not routed else ROUTED_BAND


def settle(candidates: Sequence[Candidate], bands: Sequence[float], floor: Floor,
           step: Callable[[Plan], float], replay: Callable[[Plan], float]) -> Plan:
    """The plan the decision runs: the surrogate's pick (``step``, priced from
    ``floor``'s reads), unless a candidate in doubt is priced within its band
    (``bands``: :func:`doubt_band`) of the least -- then the fastest by
    ``replay`` of the pick and those; and where the pick itself is in doubt, of
    every candidate within its band.  Candidates' prices must be cached
    (they may be asked twice)."""
    clock: StepSurrogate = step.__self__      # type: ignore[attr-defined]
    close = least_within(candidates, bands)

    @functools.cache
    def plan_of(i: int) -> Plan:
        return candidates[i][1]()[1]()      # its cached price's builder

    def doubt(i: int, priced: float) -> float:
        if bands[i] == ROUTED_BAND:
            plan = plan_of(i)
            if clock.layout_step_s(floor.arrays(plan), plan.world_size, False) == priced:
                return 0.0      # routing moves nothing the surrogate sees
        return bands[i]

    least, pick = close[0][:2]
    own = doubt(pick, least)
    if own > 0:
        close = least_within(candidates, [own] * len(candidates))
        return settled([plan_of(i) for _, i, _ in close], replay)
    return settled([plan_of(pick)] + [plan_of(i) for s, i, _ in close[1:] if doubt(i, s) > 0], replay)


def settled(plans: Sequence[Plan], replay: Callable[[Plan], float]) -> Plan:
    """The first of least ``replay`` step among the first :data:`SETTLE_PLANS`
    distinct ``plans`` (in the surrogate's order; one plan reached from two
    contexts, same layouts and crossings, is replayed once)."""
    distinct: dict[tuple, Plan] = {}
    for plan in plans:
        distinct.setdefault((layout_key(plan), plan.routed), plan)
    shortlist = list(distinct.values())[:SETTLE_PLANS]
    return shortlist[0] if len(shortlist) == 1 else min(shortlist, key=replay)    # ties: the surrogate's order
