"""Zeppelin decides per batch, by the cost model, which of its layers pay.

The remapping layer costs two all-to-all-v per layer and pass; when the
attention layout is already nearly token-balanced it costs more than it saves.
Routing helps a ring's node crossings but its planner then prefers rings that
a plan made without routing would not use.  So every batch is planned with
each choice the run allows -- remap on and off (on only if
``PlanContext.remap_enabled``), planned for routed and for direct crossings
(routed only if ``cost.routing``) -- and the plan with the smallest modeled
step (``PlanContext.step_model``) runs.  Every candidate is timed under the
run's own cost model, where each cross-node message takes the faster of
routed and direct (``CostModel.crossing_link``, the routing layer's own
break-even), so Zeppelin is never modeled slower than its variants.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.zeppelin import ZeppelinPlanner


def candidate_contexts(ctx: PlanContext) -> list[PlanContext]:
    """The contexts to plan a batch with, the run's own first (ties keep it)."""
    remaps = (True, False) if ctx.remap_enabled else (False,)
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
        best, best_s = None, float("inf")
        for option in candidate_contexts(ctx):
            plan = self.inner.plan(seq_lens, option)
            step = ctx.step_model(plan)
            if step < best_s:
                best, best_s = plan, step
        return best
