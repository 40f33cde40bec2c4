"""Zeppelin decides per batch, by the cost model, which of its layers pay.

The remapping layer costs two all-to-all-v per layer and pass; when the
attention layout is already nearly token-balanced it costs more than it saves.
Routing helps a ring's node crossings but its planner then prefers rings that
a plan made without routing would not use, and its dispatch and combine legs
compete with the other NVLink traffic.  So every batch is planned with
each choice the run allows -- remap on and off (on only if
``PlanContext.remap_enabled``, off only if ``remap_decided``), planned and run
with routed or with direct crossings (routed only if ``cost.routing``; a plan
run with direct crossings carries ``Plan.routed = False``, which the engine and
the replay honor), and each plan made for routed crossings also run direct (a
relay's lanes post its relayed pieces in their batches beside its own ring
traffic, so where the relays hold long rings of their own the layout routing
chose can run faster direct than routed, and than the layout planned for direct
crossings) -- and the plan with the smallest step by
``PlanContext.step_model`` runs: the replay's surrogate
(``planner/surrogate.py: surrogate_clock``) in the simulator, the trainer and
``pretrain_gpt.py``.  Every candidate is timed under the run's own cost model,
so Zeppelin is not modeled slower than its variants beyond the surrogate's
misorderings (``docs/results/surrogate.md`` measures them against the replay).
The candidates come from :func:`decision_candidates`; a new kind of candidate
is one more list there.  :func:`decide` prices only those that can win: in
order of the surrogate's lower bound (``surrogate.layout_floor`` of each
candidate's layout, read before its plan is built), each context's packing
passes one by one where the step model is the surrogate its planner picks a
pass by, stopping once the next bound is above the best step
(``planner/fastest.py``); the pick is ``min``'s, ties included.  It builds a
candidate's plan only when it prices one with a remap, or runs it
(docs/planner.md: "What the decision costs").

The baselines' layouts of the batch -- static CP's and Ulysses SP's uniform
groups, Megatron's hybrid CP groups, FlexSP's heterogeneous Ulysses groups --
are plans Zeppelin's engine runs as well, and on some batches (a few very long
sequences on wide TP groups, short documents) they beat the hierarchical
partitioning.  They join the candidates (``planner/baseline_candidates.py``),
so Zeppelin is not modeled slower than any of those plans run by its engine
(within the surrogate's misorderings).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.baseline_candidates import Draft, baseline_drafts, hybrid_cp_passes, static_passes
from megatron_zeppelin.planner.fastest import Floor, LaidOut, fastest, first_least, surrogate_cost
from megatron_zeppelin.planner.plan_arrays import PlanArrays
from megatron_zeppelin.planner.rounds import RoundsPlan
from megatron_zeppelin.planner.settle import doubt_band, settle
from megatron_zeppelin.planner.surrogate import StepSurrogate
from megatron_zeppelin.planner.zeppelin import ZeppelinPlanner
from megatron_zeppelin.planner.zeppelin.planner import PassDraft, gc_paused


def candidate_contexts(ctx: PlanContext) -> list[PlanContext]:
    """The contexts to plan a batch with, the run's own first (ties keep it)."""
    remaps = ((True, False) if ctx.remap_decided else (True,)) if ctx.remap_enabled else (False,)
    costs = (ctx.cost, ctx.cost.routed(False)) if ctx.cost.routing else (ctx.cost,)
    return [dataclasses.replace(ctx, cost=c, remap_enabled=r) for c in costs for r in remaps]


class DecidingZeppelinPlanner:
    """:class:`ZeppelinPlanner` run once per allowed choice; the fastest plan wins."""

    name = "zeppelin"

    def __init__(self) -> None:
        self.inner = ZeppelinPlanner()

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        if ctx.step_model is None:
            return self.inner.plan(seq_lens, ctx)
        # One pause of the cyclic collector for every candidate, on the main
        # thread (gc_paused): each pass_drafts ending its own pause ran a full
        # collection over the plans built so far (~80 ms a context at 4,096
        # GPUs).  A fresh inner planner (decide's default): its plans of the
        # batch and the decision's arrays are freed before the collector
        # resumes, which then scans only the plan that runs.
        with gc_paused():
            return decide(seq_lens, ctx)

    def plan_rounds(self, seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan:
        """:meth:`plan`'s one pass, or, where the caller runs passes
        (``ctx.rounds_model``), a baseline's schedule of several passes --
        Megatron hybrid CP's, static Ulysses SP's or static CP's
        (``baseline_candidates.static_passes``) -- when that clock puts it
        faster (ties: the one pass, then the first).  All are timed by
        ``ctx.rounds_model``, the clock the simulator times those baselines'
        rounds by, so the plan run is no slower than their rounds by it."""
        plan = self.plan(seq_lens, ctx)
        one = RoundsPlan(plan, (plan,))
        if ctx.rounds_model is None or ctx.step_model is None:
            return one
        hybrid = hybrid_cp_passes(seq_lens, ctx)
        others = ([hybrid] if hybrid is not None else []) + static_passes(seq_lens, ctx)
        if not others:
            return one
        return min([one, *others], key=lambda o: ctx.rounds_model(o.rounds))    # ties: the first


def decide(seq_lens: Sequence[int], ctx: PlanContext, inner: ZeppelinPlanner | None = None) -> Plan:
    """The first of :func:`decision_candidates` (``every_pass``, where the step
    model is a surrogate) of least ``ctx.step_model`` (ties: the run's own
    choice), or the fastest by ``ctx.settle_model`` of the close calls it
    prices least surely (``planner/settle.py``), pricing only candidates that can win
    (``planner/fastest.py``): every context's passes are priced one by one
    when the step model is a surrogate (a context planned under another cost
    model -- direct crossings -- offers each of its passes, not only the one
    its own model keeps), else the pass its planner picks is priced as one
    candidate whose bound is its passes' least.  Every
    candidate is bounded by its layout, unbuilt; a plan is built when it is
    priced with a remap (the surrogate reads the remap's messages from its
    spans) or when it wins (without a remap it is priced from its layout)."""
    contexts, baselines = _candidate_plans(seq_lens, ctx, inner)
    step = ctx.step_model
    floor, own = Floor(step), surrogate_cost(step)

    def picked(option: PlanContext, drafts: list[PassDraft], routed: bool) -> Plan:
        """The pass its context's planner keeps: the least step under its own model."""
        clock = StepSurrogate(option.cost).step_s
        return first_least(_pass_candidates(drafts, routed, Floor(clock, floor.reads), clock))()

    settling = ctx.settle_model is not None and own is not None
    g = ctx.topology.gpus_per_node

    def band(routed: bool, layouts: Sequence[LaidOut]) -> float:
        return doubt_band(routed, layouts, g, len(seq_lens)) if settling else 0.0

    candidates: list = []
    bands: list[float] = []
    for option, drafts, routed in contexts:
        if len(drafts) == 1 or own is not None:
            candidates += _pass_candidates(drafts, routed, floor, step)
            bands += [band(routed, [d]) for d in drafts]
        else:
            candidates.append((min(floor.of_layout(d) for d in drafts),
                               _priced(floor, step, functools.partial(picked, option, drafts, routed))))
            bands.append(band(routed, drafts))
    for d, routed in baselines:
        candidates.append((floor.of_layout(d), _drafted(floor, step, d.arrays, d.topology.world_size, routed,
                                                        functools.partial(d.candidate, routed))))
        bands.append(band(routed, [d]))
    if not settling:
        return first_least(candidates)()
    # The replay settles close calls on plans the surrogate prices least surely
    # (planner/settle.py); their prices may be asked twice.
    cached = [(bound, functools.cache(price)) for bound, price in candidates]
    return settle(cached, bands, floor, step, ctx.settle_model)


#: A candidate's price: its step, and what builds its plan.
Priced = Callable[[], tuple[float, Callable[[], Plan]]]


def _priced(floor: Floor, step: Callable[[Plan], float], build: Callable[[], Plan]) -> Priced:
    """Builds the plan, then prices it."""
    def price() -> tuple[float, Callable[[], Plan]]:
        plan = build()
        return floor.price(step, plan), lambda: plan
    return price


def _drafted(floor: Floor, step: Callable[[Plan], float], arrays: Callable[[], PlanArrays], world: int,
             routed: bool, build: Callable[[], Plan]) -> Priced:
    """Prices the plan of a layout whose linear layout is its attention layout
    from the layout's arrays (the plan has those arrays), unbuilt: it is built
    only if it wins."""
    if floor.cost is None:
        return _priced(floor, step, build)
    clock: StepSurrogate = step.__self__      # type: ignore[attr-defined]
    return lambda: (clock.layout_step_s(arrays(), world, routed), build)


def _pass_candidates(drafts: list[PassDraft], routed: bool, floor: Floor, step: Callable[[Plan], float]) -> list:
    """Zeppelin's passes as candidates, bounded by their layouts and built only
    if priced (with the remap: its messages are read from the plan's spans) or,
    without, only if they win."""
    out = []
    for d in drafts:
        build = functools.partial(d.plan, routed)
        out.append((floor.of_layout(d), _priced(floor, step, build) if d.remap
                    else _drafted(floor, step, d.arrays, d.world_size, routed, build)))
    return out


def decision_candidates(seq_lens: Sequence[int], ctx: PlanContext, inner: ZeppelinPlanner | None = None,
                        every_pass: bool = False) -> list[Plan]:
    """Every plan the decision compares for one batch, the run's own choice first:
    Zeppelin's plan under each of :func:`candidate_contexts` (the pass its
    planner keeps; ``every_pass``: every pass :func:`decide` may run -- each of a
    context it prices pass by pass, whose runner-up passes the replay may
    settle on), then the baselines'.  Raises the first planning error when no
    candidate can be planned."""
    contexts, baselines = _candidate_plans(seq_lens, ctx, inner)
    own = surrogate_cost(ctx.step_model)
    plans = []
    for option, drafts, routed in contexts:
        passes = [d.plan(routed) for d in drafts]
        apart = every_pass and (len(drafts) == 1 or own is not None)
        plans += passes if apart else [fastest(passes, StepSurrogate(option.cost).step_s)]
    return plans + [draft.candidate(routed) for draft, routed in baselines]


def _candidate_plans(seq_lens: Sequence[int], ctx: PlanContext, inner: ZeppelinPlanner | None
                     ) -> tuple[list[tuple[PlanContext, list[PassDraft], bool]], list[tuple[Draft, bool]]]:
    """(each context Zeppelin could plan the batch under, with its passes,
    unbuilt, and whether their plans run routed; the baselines' candidates,
    unbuilt: :func:`baseline_drafts`).  Raises the first planning error when
    there is none."""
    inner = inner or ZeppelinPlanner()
    contexts, errors = [], []
    for option in candidate_contexts(ctx):
        try:
            drafts = inner.pass_drafts(seq_lens, option)
        except InfeasibleError as exc:    # e.g. remap's balanced layout has no room; others may
            errors.append(exc)
            continue
        # A plan made for direct crossings also runs them direct: routing's
        # dispatch and combine legs share NVLink with the other traffic, and
        # on some batches they cost more than they save.
        contexts.append((option, drafts, option.cost.routing == ctx.cost.routing))
        if option.cost.routing:
            # Its layout run direct too: where a crossing's relays are busy with
            # rings of their own, their lanes' batches hold the relayed pieces
            # (docs/engine.md), and the direct run of the layout routing chose
            # can beat both that and the layout planned for direct crossings.
            contexts.append((option, drafts, False))
    baselines = baseline_drafts(seq_lens, ctx)   # so no baseline's plan is faster
    if not contexts and not baselines:
        raise errors[0]
    return contexts, baselines
