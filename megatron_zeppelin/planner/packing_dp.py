"""``packing_dp``: plain data parallelism with token-balanced sequence packing.

No sequence is ever split: each runs whole on one rank (attention and linear
layouts are the same), ranks receive sequences longest first onto the rank with
the fewest tokens.  A sequence longer than the per-GPU token cap cannot run at
all, which is the limitation context parallelism exists to remove.
"""

from __future__ import annotations

from typing import Sequence

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode, Plan
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.planner.packing import Bins, check_lengths, one_rank, pack_longest_first, placements


class PackingDpPlanner:
    """Whole sequences, token-balanced over all ranks."""

    name = "packing_dp"

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        lens = check_lengths(seq_lens)
        topo, cap = ctx.topology, ctx.tokens_per_gpu
        longest = max(range(len(lens)), key=lambda i: (lens[i], -i), default=None)
        if longest is not None and lens[longest] > cap:
            raise InfeasibleError(
                f"packing_dp: sequence {longest} has {lens[longest]} tokens, over the per-GPU cap "
                f"of {cap}; data parallelism cannot split a sequence (raise --tokens-per-gpu, "
                f"cut documents with a lower --max-seq-len, or use a CP strategy)")
        bins = pack_longest_first(lens, Bins(topo.world_size, 1, cap), one_rank, strategy=self.name,
                                  what="rank")
        attention = placements(bins, lens, Mode.LOCAL)
        return Plan(strategy=self.name, world_size=topo.world_size,
                    gpus_per_node=topo.gpus_per_node, seq_lens=lens,
                    attention=tuple(attention),
                    linear=same_layout_linear(topo.world_size, attention),
                    token_cap=cap).validate()
