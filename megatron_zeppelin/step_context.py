"""One step's context: the single channel from the training loop to every Zeppelin module.

A training step hands its :class:`StepContext` to the model on the packed
parameters (``ZeppelinPackedSeqParams.context``); ``ZeppelinGPTModel.forward``
binds it to every module that uses it (:class:`UsesStepContext`: the core
attention, the remapping layers, later the MoE layers) before any layer runs.
The project's trainer and the Megatron-LM hooks build the context the same way,
so both reach the modules through this one path.  A module that runs without a
context raises: it never passes its input through unchanged.

Data derived from the step's Plan (the attention schedule, the remap exchange
maps) lives in :attr:`StepContext.cache` rather than in module-level caches keyed
by ``id(plan)``: the context lives exactly as long as its Plan is in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, TypeVar

import torch

from megatron_zeppelin.attention.backends import AttentionBackend
from megatron_zeppelin.attention.engine import AttentionCounter
from megatron_zeppelin.comm.base import Communicator
from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.plan import Plan

T = TypeVar("T")


@dataclass
class RemapCounters:
    """Bytes this rank's layout switches put on the communicator (forward and
    backward), as the communicator counted them, apart from the attention's."""

    remap_intra_node: int = 0
    """Bytes sent to GPUs of the same node (with routing: also the dispatch and
    combine hops of routed transfers)."""
    remap_inter_node: int = 0
    """Bytes sent to other nodes, over all of this rank's NICs."""

    def reset(self) -> None:
        self.remap_intra_node = 0
        self.remap_inter_node = 0

    @property
    def total(self) -> int:
        """All bytes of the switches."""
        return self.remap_intra_node + self.remap_inter_node


@dataclass(frozen=True)
class StepContext:
    """Everything a Zeppelin module needs in one training (or evaluation) step."""

    plan: Plan | None
    """The step's Plan; ``None`` is the data-parallel reference: plain packed causal
    attention over whole sequences, no communication, no remap."""
    rank: int
    """The Plan's rank whose tokens this process holds (the data-parallel rank)."""
    communicator: Communicator | None
    """Round-based communicator of the rings, all-to-alls and remaps (None: reference)."""
    backend: AttentionBackend | None
    """Attention kernel backend (``megatron_zeppelin.attention.backends``)."""
    ring_grad_dtype: str = DEFAULT_RING_GRAD_DTYPE
    """What the backward ring's dK/dV messages travel in: ``model`` (the K/V dtype,
    as TransformerEngine sends them) or ``fp32`` (exact accumulation); the cost
    model that planned the step reads the same (``CostModel.ring_grad_dtype``)."""
    attention_counter: AttentionCounter = field(default_factory=AttentionCounter)
    """Causal pairs this rank's attention computed in this step (all layers)."""
    remap_counters: RemapCounters = field(default_factory=RemapCounters)
    """Bytes this rank's remapping layers put on the communicator in this step."""
    tp_size: int = 1
    """Tensor-parallel size: every TP rank of a group holds the same tokens and Plan
    rank and runs its own heads; the Plan sees one rank per TP group."""
    tp_rank: int = 0
    """This process's rank inside its tensor-parallel group."""
    remap_buffer_limit: int | None = None
    """Largest hidden-state buffer a layout switch may allocate, in bytes (None: no limit)."""
    sequence_parallel_group: Any = None
    """The tensor-parallel group when Megatron's sequence parallelism splits the
    MLP's rows over it (``remap/sequence_parallel.py``); None without SP."""
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    """Per-plan derived data (engine schedules, remap exchanges), keyed by what it
    depends on besides the Plan; dropped with the context."""

    def cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """``cache[key]``, built by ``build()`` on first use."""
        try:
            return self.cache[key]
        except KeyError:
            value = self.cache[key] = build()
            return value

    def require_plan(self, who: str) -> Plan:
        """The Plan, or a clear error for a module that cannot run without one."""
        if self.plan is None:
            raise ConfigError(f"{who} needs a Plan but the step's context has none (the data-parallel "
                              "reference); build the reference model with remap off")
        return self.plan


class UsesStepContext:
    """Mixin of the modules the step's context reaches (set by :func:`bind_step_context`)."""

    step_context: StepContext | None = None

    def require_step_context(self) -> StepContext:
        """This step's context; without one the module refuses to run."""
        context = self.step_context
        if context is None:
            raise ConfigError(
                f"{type(self).__name__} ran without a Zeppelin step context: feed the model "
                "ZeppelinPackedSeqParams built with build_packed_seq_params(..., context=StepContext(...)) "
                "(ZeppelinGPTModel binds it to every Zeppelin module)")
        return context


def bind_step_context(model: torch.nn.Module, context: StepContext | None) -> int:
    """Give every :class:`UsesStepContext` module of ``model`` this step's context
    (None unbinds: those modules then refuse to run); returns how many were found."""
    found = 0
    for module in model.modules():
        if isinstance(module, UsesStepContext):
            module.step_context = context
            found += 1
    return found


def step_context_of(packed_seq_params: Any) -> StepContext | None:
    """The context a batch's packed parameters carry (None for any other object)."""
    context = getattr(packed_seq_params, "context", None)
    return context if isinstance(context, StepContext) else None
