"""Timing a step that runs as several micro-batches (``planner/rounds.py``).

Each round is a full forward and backward of its sequences; a barrier (or the
next micro-batch's collectives) separates rounds, so the step is the sum of
each round's slowest rank, plus one gradient sync after the last backward
(gradients accumulate over micro-batches).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.step_sync import forward_backward_split, step_sync
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.base import PlanContext, Planner
from megatron_zeppelin.sim.timeline import StepTimeline, step_timeline


def plan_batch(planner: Planner, lens: Sequence[int], ctx: PlanContext) -> tuple[Plan, tuple[Plan, ...]]:
    """(the plan of the whole batch, the plans of its rounds in order)."""
    plan_rounds = getattr(planner, "plan_rounds", None)
    if plan_rounds is None:
        plan = planner.plan(lens, ctx)
        return plan, (plan,)
    rounds = plan_rounds(lens, ctx)
    return rounds.merged, rounds.rounds


def rounds_timeline(rounds: Sequence[Plan], cost: CostModel) -> StepTimeline:
    """The step of ``rounds`` run one after another: the first round's timeline
    (for plots and imbalance) with the step time of all of them."""
    if len(rounds) == 1:
        return step_timeline(rounds[0], cost)
    parts = [step_timeline(p, cost, sync=False) for p in rounds]
    fwd = bwd = 0.0
    for tl in parts:
        slowest = tl.ranks[tl.slowest_rank]
        f, b = forward_backward_split(slowest.attn_compute_s, slowest.linear_s)
        fwd, bwd = fwd + f, bwd + b
    sync = step_sync(cost, fwd, bwd)
    return dataclasses.replace(parts[0], step_s=sum(tl.compute_s for tl in parts) + sync.exposed_s,
                               sync=sync)
