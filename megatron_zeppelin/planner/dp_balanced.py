"""``megatron_dp_balanced``: Megatron-LM's packed-sequence scheduler at a fixed CP size.

Follows ``DpBalancedScheduler`` on Megatron-LM's ``dev`` branch
(``megatron/core/datasets/data_schedule.py``, read at dev commit
d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1, 2026-08-21),
``--sequence-packing-scheduler dp_balanced`` with ``--context-parallel-size c``
and ``--max-seqlen-per-dp-cp-rank`` = our ``tokens_per_gpu``: the baseline
NVIDIA measures dynamic CP (``planner/dynamic_cp.py``) against
(``examples/dynamic_context_parallel``: 1.21-1.50x).

* The global batch's sequences are packed **in their order** (no sorting):
  a pack takes the next sequence while it holds at most ``c * cap`` tokens,
  else a new pack starts.
* The number of packs is made a multiple of the DP size by moving the last
  sequence of the last packs holding more than one into packs of their own.
* Micro-batch ``i`` gives DP replica ``j`` (the ``c`` consecutive ranks of its
  CP group, Megatron's CP-inside-DP order) pack ``i * dp + j``; every sequence
  of a pack is zigzag-split over the group (TE's THD attention, p2p ring).

The micro-batches run one after another (rounds, ``planner/rounds.py``).
The CP size is the run's static one (``PlanContext.cp_size``; the simulator
searches TP x CP as for ``te_cp``).
"""

from __future__ import annotations

from typing import Sequence

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.packing import Bins, check_lengths, placements, zigzag_or_one_rank
from megatron_zeppelin.planner.rounds import MergedRounds, RoundsPlan, build_rounds
from megatron_zeppelin.planner.te_cp import te_cp_size


def dp_balanced_packs(seq_lens: Sequence[int], pack_tokens: int, dp_size: int) -> list[list[int]]:
    """``DpBalancedScheduler.get_groups_and_subsamples``: packs of sequence
    indices, a multiple of ``dp_size`` of them; micro-batch ``i`` runs packs
    ``i * dp_size ... (i + 1) * dp_size - 1``."""
    packs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for seq, L in enumerate(seq_lens):
        if total + L <= pack_tokens:
            current.append(seq)
            total += L
        else:
            packs.append(current)
            current, total = [seq], L
    if current:
        packs.append(current)
    missing = -len(packs) % dp_size
    i = len(packs) - 1
    while missing:
        if i < 0:
            raise InfeasibleError(f"megatron_dp_balanced: {len(seq_lens)} sequences cannot fill {dp_size} "
                                  "DP replicas in every micro-batch; use a larger global batch or fewer replicas")
        if len(packs[i]) > 1:
            packs.append([packs[i].pop()])
            missing -= 1
        else:
            i -= 1
    return packs


class DpBalancedPlanner(MergedRounds):
    """In-order packs of ``c * cap`` tokens, one per DP replica per micro-batch."""

    name = "megatron_dp_balanced"
    #: It cuts the whole global batch into its micro-batches (``sim/rounds.py: batch_groups``).
    schedules_global_batch = True

    def plan_rounds(self, seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan:
        lens = check_lengths(seq_lens)
        topo, cap = ctx.topology, ctx.tokens_per_gpu
        c = te_cp_size(lens, cap, topo.world_size, ctx.cp_size)
        dp = topo.world_size // c
        for seq, L in enumerate(lens):
            if L > c * cap:
                raise InfeasibleError(f"megatron_dp_balanced: sequence {seq} has {L} tokens, more than "
                                      f"context-parallel size {c} x {cap} tokens per GPU; raise the CP size "
                                      "or --tokens-per-gpu")
        packs = dp_balanced_packs(lens, c * cap, dp)
        rounds = []
        for first in range(0, len(packs), dp):
            bins = Bins(dp, c, c * cap)   # the packs are built within c * cap; the ranks' shares follow
            for replica, pack in enumerate(packs[first:first + dp]):
                for seq in pack:
                    share = tuple(zigzag_or_one_rank(lens[seq], bins.loads[replica]))
                    bins.loads[replica] = [a + b for a, b in zip(bins.loads[replica], share)]
                    bins.items[replica].append((seq, share))
            rounds.append(placements(bins, lens, Mode.RING, first_rank=lambda b: b * c))
        return build_rounds(self.name, topo, lens, rounds, None)
