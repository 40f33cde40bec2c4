"""What every planner shares: its inputs, its interface and the registry.

A planner is a pure function of the batch's sequence lengths and a
:class:`PlanContext`; it returns a valid :class:`~megatron_zeppelin.plan.Plan`
or raises :class:`~megatron_zeppelin.errors.InfeasibleError`.  Same input, same
plan, on every rank.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.plan import Plan, SeqPlacement, Span, attention_buffers
from megatron_zeppelin.topology import Topology


@dataclass(frozen=True, kw_only=True)
class PlanContext:
    """Everything a planner may look at besides the lengths."""

    cost: CostModel
    """Cost model of the cluster and model (also carries the topology)."""
    tokens_per_gpu: int
    """Per-GPU token cap (memory budget) for both layouts."""
    cp_size: int | None = None
    """Static CP (``te_cp``) or SP (``ulysses_sp``) group size (None: the
    smallest power of two that fits the batch's longest sequence)."""
    time_limit_s: float = 10.0
    """Solver time limit for MILP-based planners (``flexsp``)."""
    tp_size: int = 1
    """Tensor-parallel size: each rank's engine sees ``heads / tp_size`` heads, so
    a Ulysses group size must divide the per-rank head counts."""
    remap_enabled: bool = True
    """Give the linear modules a token-balanced layout (``ZeppelinRemap``); when
    off, a planner's linear layout is its attention layout."""
    remap_decided: bool = True
    """With ``remap_enabled``: Zeppelin remaps a batch only where the modeled
    step says it pays; False remaps every batch (the trainer's ``--remap on``,
    so that the flag does what it says)."""
    step_model: Callable[[Plan], float] | None = None
    """Modeled step seconds of a plan under ``cost`` (the simulator's timeline).
    Zeppelin decides per batch with it whether to remap and which plan's
    crossings to route (``planner/zeppelin_decide.py``); without it Zeppelin
    plans once with the flags as given."""
    settle_model: Callable[[Plan], float] | None = None
    """The clock that settles the decision's close calls (the replay's step,
    ``sim/timeline.py: replay_clock``): the candidates ``step_model`` prices
    within a few percent of its least are replayed and the fastest runs
    (``planner/settle.py``).  None: ``step_model``'s pick runs."""
    rounds_model: Callable[[Sequence[Plan]], float] | None = None
    """Modeled step seconds of a batch run as the given plans' passes one after
    another (the simulator's ``sim/rounds.py: rounds_timeline``), set where the
    caller runs a planner's ``plan_rounds`` as passes (the simulator and the
    trainer; Megatron-LM's hooks run one Plan per batch and leave it None).
    With ``step_model``, Zeppelin's decision then also offers Megatron hybrid
    CP's schedule of several passes (``DecidingZeppelinPlanner.plan_rounds``)."""

    @property
    def local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) each tensor-parallel rank computes."""
        m = self.cost.model
        return m.num_attention_heads // self.tp_size, max(m.num_query_groups // self.tp_size, 1)

    @property
    def topology(self) -> Topology:
        return self.cost.cluster.topology


class Planner(Protocol):
    """Turns one global batch's sequence lengths into a Plan."""

    name: str

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan: ...


#: strategy name -> "module:ClassName" (imported on first use).
PLANNERS: dict[str, str] = {
    "zeppelin": "megatron_zeppelin.planner.zeppelin_decide:DecidingZeppelinPlanner",
    "te_cp": "megatron_zeppelin.planner.te_cp:TeCpPlanner",
    "packing_dp": "megatron_zeppelin.planner.packing_dp:PackingDpPlanner",
    "megatron_hybrid_cp": "megatron_zeppelin.planner.hybrid_cp:HybridCpPlanner",
    "megatron_dynamic_cp": "megatron_zeppelin.planner.dynamic_cp:DynamicCpPlanner",
    "megatron_dp_balanced": "megatron_zeppelin.planner.dp_balanced:DpBalancedPlanner",
    "flexsp": "megatron_zeppelin.planner.flexsp:FlexSpPlanner",
    "ulysses_sp": "megatron_zeppelin.planner.ulysses_sp:UlyssesSpPlanner",
}


def get_planner(name: str) -> Planner:
    """Instantiate the planner registered as ``name``."""
    if name not in PLANNERS:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(PLANNERS)}")
    module, cls = PLANNERS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def same_layout_linear(world_size: int, attention: Sequence[SeqPlacement]) -> tuple[tuple[Span, ...], ...]:
    """Linear layout equal to the attention layout (strategies without remap)."""
    return tuple(tuple(spans) for spans in attention_buffers(world_size, attention))
