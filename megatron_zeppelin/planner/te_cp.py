"""``te_cp``: static context parallelism as Megatron-Core + TransformerEngine run it.

The CP size ``c`` is fixed for the whole run (``--context-parallel-size``), so
the world is ``world / c`` DP replicas of ``c`` consecutive ranks each
(Megatron's rank order puts CP inside DP: a CP group is node-contiguous and
spans nodes only when ``c > gpus_per_node``).  Each replica packs whole
sequences into its THD buffer (longest first onto the replica with the fewest
tokens, at most ``c * tokens_per_gpu`` of them), and TE's THD attention cuts
*every* packed sequence into ``2c`` chunks (DualChunkSwap, rank ``i`` holds
chunks ``i`` and ``2c-1-i``) and runs the p2p ring over the whole group --
short sequences pay ring traffic too.  That is the waste Zeppelin removes.
"""

from __future__ import annotations

from typing import Sequence

from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.plan import Mode, Plan
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.planner.packing import (Bins, check_lengths, pack_longest_first, placements,
                                               zigzag_or_one_rank)


def te_cp_size(seq_lens: Sequence[int], tokens_per_gpu: int, world_size: int,
               cp_size: int | None = None) -> int:
    """The static CP size: ``cp_size`` when configured, else the smallest power of
    two dividing the world whose share of the longest sequence fits one GPU.

    A real run fixes ``c`` from ``--max-seq-len`` (the simulator passes it as
    ``PlanContext.cp_size``); deriving it from this batch is only a fallback."""
    if cp_size is not None:
        if cp_size < 1 or world_size % cp_size:
            raise ConfigError(f"te_cp: context-parallel size {cp_size} must divide the world "
                              f"size {world_size}; pick a divisor")
        return cp_size
    longest = max(seq_lens, default=1)
    c = 1
    while c <= world_size:
        if world_size % c == 0 and -(-longest // c) <= tokens_per_gpu:
            return c
        c *= 2
    raise InfeasibleError(f"te_cp: a sequence of {longest} tokens needs more than {world_size} "
                          f"GPUs at {tokens_per_gpu} tokens per GPU; raise --tokens-per-gpu or "
                          "add nodes")


class TeCpPlanner:
    """DP replicas of one fixed CP group size; every sequence zigzag-split over its group."""

    name = "te_cp"

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        lens = check_lengths(seq_lens)
        topo, cap = ctx.topology, ctx.tokens_per_gpu
        c = te_cp_size(lens, cap, topo.world_size, ctx.cp_size)
        for seq, L in enumerate(lens):
            if -(-L // c) > cap:
                raise InfeasibleError(
                    f"te_cp: sequence {seq} has {L} tokens, more than context-parallel size {c} "
                    f"x {cap} tokens per GPU; raise the CP size or --tokens-per-gpu")
        bins = pack_longest_first(lens, Bins(topo.world_size // c, c, cap),
                                  zigzag_or_one_rank, strategy=self.name,
                                  what=f"CP group of {c} GPUs")
        attention = placements(bins, lens, Mode.RING, first_rank=lambda b: b * c)
        return Plan(strategy=self.name, world_size=topo.world_size,
                    gpus_per_node=topo.gpus_per_node, seq_lens=lens,
                    attention=tuple(attention),
                    linear=same_layout_linear(topo.world_size, attention),
                    token_cap=cap).validate()
