"""What the static baselines share: fixed groups, packed, micro-batches on overflow.

``te_cp`` and ``ulysses_sp`` split the world into ``world / d`` replicas of
``d`` consecutive ranks for the whole run and pack each batch's sequences
into them longest first; what a pass cannot hold waits for the next
micro-batch (:func:`~megatron_zeppelin.planner.packing.pack_in_rounds`).  They
differ in the group size rule, the split mode and how a sequence's tokens
spread over the group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from megatron_zeppelin.plan import Mode, Plan, SeqPlacement
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.packing import Bins, Shares, check_lengths, fit_in_one_pass, pack_in_rounds, placements
from megatron_zeppelin.planner.plan_arrays import Placements
from megatron_zeppelin.planner.rounds import RoundsPlan, build_rounds


class StaticGroupPlanner(ABC):
    """Packed fixed groups; subclasses give ``name``, ``mode``, ``shares``,
    ``group`` (a word for messages) and :meth:`group_size`."""

    name: str
    mode: Mode
    shares: Shares
    group: str

    @abstractmethod
    def group_size(self, lens: tuple[int, ...], ctx: PlanContext) -> int:
        """GPUs per group for a batch of ``lens`` (fixed for the run)."""

    def plan_rounds(self, seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan:
        lens = check_lengths(seq_lens)
        d = self.group_size(lens, ctx)
        bins = pack_in_rounds(lens, lambda: self._bins(d, ctx), type(self).shares,
                              strategy=self.name, what=self._what(d))
        return build_rounds(self.name, ctx.topology, lens, [self._placements(b, lens, d) for b in bins],
                            ctx.tokens_per_gpu)

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        return self.plan_rounds(seq_lens, ctx).merged

    def one_pass(self, seq_lens: Sequence[int], ctx: PlanContext) -> Placements | None:
        """The placements of :meth:`plan` when the batch fits one pass, as
        columns, else None, without packing the rounds that would follow or
        building a Plan.  Raises :class:`InfeasibleError` as :meth:`group_size` does."""
        lens = check_lengths(seq_lens)
        d = self.group_size(lens, ctx)
        return fit_in_one_pass(lens, self._bins(d, ctx), type(self).shares, self.mode)

    def _bins(self, d: int, ctx: PlanContext) -> Bins:
        return Bins(ctx.topology.world_size // d, d, ctx.tokens_per_gpu)

    def _what(self, d: int) -> str:
        return f"{self.group} of {d} GPUs"

    def _placements(self, bins: Bins, lens: tuple[int, ...], d: int) -> list[SeqPlacement]:
        return placements(bins, lens, self.mode, first_rank=lambda i: i * d)
