"""A strategy the simulator runs, and the context it plans every batch with.

Its own module so that the static layout search (``sim/static_layout.py``),
which tries layouts as strategies, and the simulator (``sim/simulate.py``),
which runs the chosen ones, both import it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.planner.base import PlanContext, Planner
from megatron_zeppelin.planner.surrogate import surrogate_clock
from megatron_zeppelin.sim.rounds import rounds_clock
from megatron_zeppelin.sim.timeline import replay_clock


@dataclass(frozen=True)
class Strategy:
    """A planner plus the conditions its plans run under."""

    name: str
    """Name in reports (a planner name, or a key of :data:`~megatron_zeppelin.sim.simulate.VARIANTS`)."""
    planner: Planner
    """Produces the plan of each batch."""
    cost: CostModel
    """Cost model the planner plans with and the step is timed with; its
    ``routing`` flag says whether inter-node transfers use the routing layer."""
    cp_size: int | None = None
    """Static CP / SP size handed to the planner (``te_cp``, ``ulysses_sp``)."""
    remap_enabled: bool = True
    """``PlanContext.remap_enabled``: only Zeppelin's planner reads it (the
    baselines' linear layout is always their attention layout)."""
    decide: bool = True
    """Zeppelin picks each batch's plan by the surrogate of the replayed step
    (:attr:`~megatron_zeppelin.sim.simulate.Variant.decide`)."""
    tp_size: int = 1
    """GPUs per rank of its plans (``cost`` is then a TP view); the per-GPU
    token cap becomes ``tp_size`` times larger per rank."""
    layout: str | None = None
    """The static layout search's report (``sim/static_layout.py``)."""
    infeasible: str | None = None
    """Why the strategy cannot run at all on this configuration (no static
    layout fits); it is then reported infeasible without planning."""


def plan_context(s: Strategy, tokens_per_gpu: int, time_limit_s: float) -> PlanContext:
    """The context ``s`` plans every batch with (``tokens_per_gpu`` per GPU).
    Its decisions compare candidates by the replay's certified surrogate
    (``planner/surrogate.py``), so the planner's latency is what a user's
    planner pays; a schedule of several passes against the one pass by the
    replay of both (``rounds_model``: the simulator runs passes)."""
    return PlanContext(cost=s.cost, tokens_per_gpu=tokens_per_gpu * s.tp_size, cp_size=s.cp_size,
                       time_limit_s=time_limit_s, remap_enabled=s.remap_enabled, tp_size=s.tp_size,
                       remap_decided=s.decide, step_model=surrogate_clock(s.cost) if s.decide else None,
                       settle_model=replay_clock(s.cost) if s.decide else None,
                       rounds_model=rounds_clock(s.cost) if s.decide else None)
