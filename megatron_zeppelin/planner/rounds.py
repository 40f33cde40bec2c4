"""Micro-batches of one global batch, run one after another.

Static baselines cannot always hold a whole global batch at once: a TE CP
group packs at most ``c x cap`` tokens, Megatron's hybrid CP schedules its
sub-samples in rounds with a barrier after each, and FlexSP's "sequence
blaster" splits a batch that does not fit into micro-batches.  Such a planner
offers ``plan_rounds`` besides ``plan``: one Plan per micro-batch (over
that micro-batch's sequences only, indices renumbered from 0), in execution
order, with the merged plan (:class:`RoundsPlan`).  Gradients accumulate over the micro-batches and are synchronised once,
so the simulator times a step as the sum of the rounds plus one gradient sync.
``plan`` returns :func:`merge_rounds`: every placement of every round in one
Plan over the whole batch (what the trainer executes; the per-GPU token cap
holds per round, not for the merged plan, so it carries none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from megatron_zeppelin.plan import Plan, SeqPlacement, placement
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.topology import Topology


@dataclass(frozen=True)
class RoundsPlan:
    """One global batch as micro-batches."""

    merged: Plan
    """Every round's placements in one Plan over the whole batch (what
    ``plan`` returns and ``--dump-plans`` writes)."""
    rounds: tuple[Plan, ...]
    """One Plan per micro-batch, over its own sequences, in execution order."""


class RoundPlanner(Protocol):
    """A planner whose step is a sequence of micro-batches."""

    name: str

    def plan_rounds(self, seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan: ...


class MergedRounds:
    """A round planner's ``plan``: the merged plan of its ``plan_rounds``."""

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        return self.plan_rounds(seq_lens, ctx).merged      # type: ignore[attr-defined]


def build_rounds(strategy: str, topo: Topology, lens: Sequence[int],
                 rounds: Sequence[Sequence[SeqPlacement]], token_cap: int | None) -> RoundsPlan:
    """The merged plan and the per-round plans of ``rounds`` (placements with
    batch-wide sequence indices); ``token_cap`` holds per round."""
    merged = merge_rounds(strategy, topo, lens, rounds, token_cap)
    if len(rounds) == 1:        # one pass: the merged plan is the round (and validating once is enough)
        return RoundsPlan(merged, (merged,))
    return RoundsPlan(merged, tuple(round_plan(strategy, topo, lens, r, token_cap) for r in rounds))


def round_plan(strategy: str, topo: Topology, lens: Sequence[int], attention: Sequence[SeqPlacement],
               token_cap: int | None) -> Plan:
    """The Plan of one micro-batch: ``attention`` (batch-wide sequence indices)
    renumbered over the sequences it places, in placement order."""
    order = {p.seq: i for i, p in enumerate(attention)}
    local = tuple(placement(order[p.seq], lens[p.seq], p.mode, p.ranks) for p in attention)
    return Plan(strategy=strategy, world_size=topo.world_size, gpus_per_node=topo.gpus_per_node,
                seq_lens=tuple(lens[p.seq] for p in attention), attention=local,
                linear=same_layout_linear(topo.world_size, local), token_cap=token_cap).validate()


def merge_rounds(strategy: str, topo: Topology, lens: Sequence[int],
                 rounds: Sequence[Sequence[SeqPlacement]], token_cap: int | None) -> Plan:
    """One Plan over the whole batch holding every round's placements; the
    token cap only when there is a single round."""
    attention = tuple(p for r in rounds for p in r)
    return Plan(strategy=strategy, world_size=topo.world_size, gpus_per_node=topo.gpus_per_node,
                seq_lens=tuple(lens), attention=attention,
                linear=same_layout_linear(topo.world_size, attention),
                token_cap=token_cap if len(rounds) == 1 else None).validate()
