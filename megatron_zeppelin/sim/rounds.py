"""Timing a step that runs as several micro-batches (``planner/rounds.py``).

Each round is a full forward and backward of its sequences; a barrier (or the
next micro-batch's collectives) separates rounds, so the step is the sum of
each round's slowest rank, plus one gradient sync after the last backward
(gradients accumulate over micro-batches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.step_sync import forward_backward_split, step_sync
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.base import PlanContext, Planner
from megatron_zeppelin.sim.timeline import RecentResults, StepTimeline, step_timeline


def plan_batch(planner: Planner, lens: Sequence[int], ctx: PlanContext) -> tuple[Plan, tuple[Plan, ...]]:
    """(the plan of the whole batch, the plans of its rounds in order)."""
    plan_rounds = getattr(planner, "plan_rounds", None)
    if plan_rounds is None:
        plan = planner.plan(lens, ctx)
        return plan, (plan,)
    rounds = plan_rounds(lens, ctx)
    return rounds.merged, rounds.rounds


def batch_groups(planner: Planner, lens: Sequence[int], split_groups: list[list[int]]) -> list[list[int]]:
    """The sequence groups ``planner`` plans one by one: the micro-batch split's,
    or the whole global batch for a planner that cuts it into micro-batches
    itself (``schedules_global_batch``: Megatron-LM's sequence-packing
    schedulers gather the global batch's lengths over DP and re-pack them)."""
    if getattr(planner, "schedules_global_batch", False):
        return [list(range(len(lens)))]
    return split_groups


def rounds_timeline(rounds: Sequence[Plan], cost: CostModel) -> StepTimeline:
    """The step of ``rounds`` run one after another: the first round's timeline
    (for plots and imbalance) with the step time of all of them."""
    return round_timelines(rounds, cost)[0]


def rounds_clock(cost: CostModel) -> Callable[[Sequence[Plan]], float]:
    """``PlanContext.rounds_model`` under ``cost``: :func:`rounds_timeline`'s step."""
    return lambda rounds: rounds_timeline(rounds, cost).step_s


def round_timelines(rounds: Sequence[Plan], cost: CostModel) -> tuple[StepTimeline, tuple[StepTimeline, ...]]:
    """(:func:`rounds_timeline`, each round's own timeline without the gradient sync)."""
    if len(rounds) == 1:
        whole = step_timeline(rounds[0], cost)
        # One round: its timeline without the sync is the same replay, minus the tail.
        return whole, (dataclasses.replace(whole, step_s=whole.compute_s, sync=None),)
    parts = [step_timeline(p, cost, sync=False) for p in rounds]
    fwd = bwd = 0.0
    for tl in parts:
        slowest = tl.ranks[tl.slowest_rank]
        f, b = forward_backward_split(slowest.attn_compute_s, slowest.linear_s)
        fwd, bwd = fwd + f, bwd + b
    sync = step_sync(cost, fwd, bwd)
    return (dataclasses.replace(parts[0], step_s=sum(tl.compute_s for tl in parts) + sync.exposed_s, sync=sync),
            tuple(parts))


@dataclass(frozen=True)
class TimedBatch:
    """One batch planned and timed."""

    merged: Plan
    """The plan of the whole batch."""
    rounds: tuple[Plan, ...]
    """The plans of its rounds in order."""
    step: StepTimeline
    """The step (:func:`rounds_timeline`)."""
    parts: tuple[StepTimeline, ...]
    """Each round's timeline without the gradient sync."""


#: Batches :func:`timed_batch` remembers (a benchmark's layout search and its
#: measurement afterwards plan the same few batches under the same context).
_timed = RecentResults(64)


def timed_batch(planner: Planner, lens: Sequence[int], ctx: PlanContext) -> TimedBatch:
    """``lens`` planned by ``planner`` under ``ctx`` and timed under ``ctx.cost``,
    remembered for the next identical call.  Planning and the replay are
    deterministic functions of the planner, the context and the lengths -- up to
    ``ctx.step_model``, which the key only records as present or not: callers
    with a step model pass the simulator's (``sim.strategy.plan_context``).
    An :class:`~megatron_zeppelin.errors.InfeasibleError` is not remembered."""
    key = (getattr(planner, "name", type(planner).__name__), ctx.cost, ctx.tokens_per_gpu, ctx.cp_size,
           ctx.time_limit_s, ctx.tp_size, ctx.remap_enabled, ctx.remap_decided, ctx.step_model is not None,
           ctx.rounds_model is not None,
           tuple(int(x) for x in lens))
    hit = _timed.get(key)
    if hit is not None:
        return hit
    merged, rounds = plan_batch(planner, lens, ctx)
    step, parts = round_timelines(rounds, ctx.cost)
    out = TimedBatch(merged, rounds, step, parts)
    _timed.put(key, out)
    return out
