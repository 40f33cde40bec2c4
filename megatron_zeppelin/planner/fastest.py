"""The fastest of several plans by a step model, pricing as few as it must.

``min(plans, key=step)`` prices every plan.  With a lower bound of ``step``
per candidate (the surrogate's :func:`~megatron_zeppelin.planner.surrogate.layout_floor`,
which a baseline's layout gets before its plan is built),
candidates are priced in order of their bounds, and the search stops once the
next bound is above the best step found: the rest cannot win.  The pick is
the one ``min`` makes, ties included (the first candidate of the least step).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, TypeVar

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.plan_arrays import PlanArrays
from megatron_zeppelin.planner.surrogate import StepSurrogate, layout_floor, step_floor

T = TypeVar("T")
#: A candidate: (lower bound of its step, what prices it: (step, result)).
Candidate = tuple[float, Callable[[], tuple[float, T]]]


def first_least(candidates: Sequence[Candidate]) -> T:
    """The result of the first candidate of least step, pricing candidates in
    order of their bounds and none whose bound says it cannot win."""
    best: tuple[float, int, T] | None = None
    for i in sorted(range(len(candidates)), key=lambda i: (candidates[i][0], i)):
        bound, price = candidates[i]
        if best is not None and bound > best[0]:
            break               # every later bound is at least this one
        if best is not None and bound == best[0] and i > best[1]:
            continue            # at best a tie, and a later candidate loses ties
        step, result = price()
        if best is None or step < best[0] or (step == best[0] and i < best[1]):
            best = (step, i, result)
    if best is None:
        raise ValueError("first_least: no candidate")
    return best[2]


def surrogate_cost(step: Callable[[Plan], float]) -> CostModel | None:
    """The cost model of ``step`` when it is the surrogate's clock
    (:func:`~megatron_zeppelin.planner.surrogate.surrogate_clock`), else None."""
    owner = getattr(step, "__self__", None)
    return owner.cost if isinstance(owner, StepSurrogate) and step.__func__ is StepSurrogate.step_s else None


class Floor:
    """A lower bound of a step model: the surrogate's (``surrogate.layout_floor``),
    or none (-inf) for another step model."""

    def __init__(self, step: Callable[[Plan], float]) -> None:
        self.cost = surrogate_cost(step)
        #: Bounds by the layouts' identity (with a plan holding them): a plan
        #: and its direct-crossings copy share their layouts and their bound
        #: (not a packed copy: a packed ring's larger kernels lower it).
        self.known: dict[tuple, tuple[Plan, float]] = {}

    def of_plan(self, plan: Plan) -> float:
        if self.cost is None:
            return -math.inf
        key = (id(plan.attention), id(plan.linear), plan.packed_rings)
        if key not in self.known:
            self.known[key] = (plan, step_floor(self.cost, plan))
        return self.known[key][1]

    def of_layout(self, layout: Callable[[], PlanArrays]) -> float:
        """Of the plan of ``layout()`` (its arrays, ``planner/plan_arrays.py``),
        before it is built."""
        if self.cost is None:
            return -math.inf
        arrays = layout()
        return layout_floor(self.cost, arrays, arrays.linear_tokens)


def fastest(plans: Sequence[Plan], step: Callable[[Plan], float]) -> Plan:
    """``min(plans, key=step)``, pricing only the plans that can win."""
    if len(plans) == 1:
        return plans[0]
    floor = Floor(step)
    return first_least([(floor.of_plan(p), lambda p=p: (step(p), p)) for p in plans])
