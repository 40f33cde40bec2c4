"""The fastest of several plans by a step model, pricing as few as it must.

``min(plans, key=step)`` prices every plan.  With a lower bound of ``step``
per candidate (the surrogate's :func:`~megatron_zeppelin.planner.surrogate.layout_floor`,
which a draft -- a baseline's layout, a packing pass's -- gets before its plan is built),
candidates are priced in order of their bounds, and the search stops once the
next bound is above the best step found: the rest cannot win.  The pick is
the one ``min`` makes, ties included (the first candidate of the least step).
:func:`least_within` also keeps the candidates priced within a band of the
least, pricing as far as the bands reach (``planner/settle.py`` replays them).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol, Sequence, TypeVar

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.plan_arrays import PlanArrays, plan_arrays
from megatron_zeppelin.planner.surrogate import StepSurrogate, layout_floor

T = TypeVar("T")
#: A candidate: (lower bound of its step, what prices it: (step, result)).
Candidate = tuple[float, Callable[[], tuple[float, T]]]


def first_least(candidates: Sequence[Candidate]) -> T:
    """The result of the first candidate of least step, pricing candidates in
    order of their bounds and none whose bound says it cannot win."""
    return least_within(candidates, [0.0] * len(candidates))[0][2]


def least_within(candidates: Sequence[Candidate], bands: Sequence[float]) -> list[tuple[float, int, T]]:
    """(step, index, result) of the first candidate of least step and of every
    other of a positive band whose step is at most ``1 + bands[i]`` times that
    least, in order of step (ties: index).  Candidates are priced in order of their bounds, and
    none whose bound is above what it may be kept within; one of band 0 that
    can at best tie a former one is not priced (the former wins ties)."""
    priced: list[tuple[float, int, T]] = []
    best: tuple[float, int] | None = None
    widest = max(bands, default=0.0)
    for i in sorted(range(len(candidates)), key=lambda i: (candidates[i][0], i)):
        bound, price = candidates[i]
        if best is not None and bound > best[0] * (1 + widest):
            break               # every later bound is at least this one
        if best is not None and (bound > best[0] * (1 + bands[i])
                                 or (bands[i] == 0 and bound == best[0] and i > best[1])):
            continue            # cannot be kept, or at best a tie a former candidate wins
        step, result = price()
        priced.append((step, i, result))
        if best is None or (step, i) < best:
            best = (step, i)
    if best is None:
        raise ValueError("least_within: no candidate")
    return sorted((p for p in priced if p[1] == best[1] or (bands[p[1]] > 0 and p[0] <= best[0] * (1 + bands[p[1]]))),
                  key=lambda p: p[:2])


def surrogate_cost(step: Callable[[Plan], float]) -> CostModel | None:
    """The cost model of ``step`` when it is the surrogate's clock
    (:func:`~megatron_zeppelin.planner.surrogate.surrogate_clock`), else None."""
    owner = getattr(step, "__self__", None)
    return owner.cost if isinstance(owner, StepSurrogate) and step.__func__ is StepSurrogate.step_s else None


#: A plan's arrays (``planner/plan_arrays.py``) by its layouts' identity, with
#: the plan (it keeps them alive): a plan and its direct-crossings copy share
#: their layouts, and a context's pick is priced under its model and the run's.
#: Its packed rings and Ulysses groups are part of the key: a layout's packed copy shares its
#: placements, but not its arrays nor its bound (a packed ring's larger kernels lower it).
Reads = dict[tuple[int, int, int, int], tuple[Plan, PlanArrays]]


def layout_key(plan: Plan) -> tuple[int, int, int, int]:
    return id(plan.attention), id(plan.linear), id(plan.packed_rings), id(plan.packed_ulysses)


class LaidOut(Protocol):
    """A plan not built yet: a baseline's or a packing pass's draft."""

    def arrays(self) -> PlanArrays:
        """The arrays of its attention layout."""

    def linear_tokens(self) -> np.ndarray:
        """Every rank's tokens in its linear layout."""


class Floor:
    """A lower bound of a step model: the surrogate's (``surrogate.layout_floor``),
    or none (-inf) for another step model.  It reads each plan's arrays once
    (into ``reads``, which Floors of other cost models may share) and
    :meth:`price` prices from them: one per decision, so what it keeps goes
    with the decision."""

    def __init__(self, step: Callable[[Plan], float], reads: Reads | None = None) -> None:
        self.cost = surrogate_cost(step)
        self.reads: Reads = {} if reads is None else reads
        self.bounds: dict[tuple[int, int, int], float] = {}
        # Per draft (by identity: the decision's candidates hold their drafts for
        # as long as this Floor lives): a routed context's passes are bounded
        # once for their routed and once for their direct run.
        self.drafts: dict[int, float] = {}

    def arrays(self, plan: Plan) -> PlanArrays:
        key = layout_key(plan)
        hit = self.reads.get(key)
        if hit is None:
            hit = self.reads[key] = (plan, plan_arrays(plan))
        return hit[1]

    def of_plan(self, plan: Plan) -> float:
        if self.cost is None:
            return -math.inf
        key = layout_key(plan)
        if key not in self.bounds:
            # The arrays' linear tokens are the plan's, as step_floor reads them.
            arrays = self.arrays(plan)
            self.bounds[key] = layout_floor(self.cost, arrays, arrays.linear_tokens)
        return self.bounds[key]

    def of_layout(self, draft: LaidOut) -> float:
        """Of a plan before it is built, from its layout (``draft.arrays()``,
        ``planner/plan_arrays.py``) and its linear layout's tokens per rank."""
        if self.cost is None:
            return -math.inf
        if id(draft) not in self.drafts:
            self.drafts[id(draft)] = layout_floor(self.cost, draft.arrays(), draft.linear_tokens())
        return self.drafts[id(draft)]

    def price(self, step: Callable[[Plan], float], plan: Plan) -> float:
        """``step(plan)``; the surrogate's from the arrays read once."""
        if surrogate_cost(step) is None:
            return step(plan)
        clock: StepSurrogate = step.__self__      # type: ignore[attr-defined]
        return clock.layout_step_s(self.arrays(plan), plan.world_size, plan.routed)


def fastest(plans: Sequence[Plan], step: Callable[[Plan], float]) -> Plan:
    """``min(plans, key=step)``, pricing only the plans that can win."""
    if len(plans) == 1:
        return plans[0]
    floor = Floor(step)
    return first_least([(floor.of_plan(p), lambda p=p: (floor.price(step, p), p)) for p in plans])
