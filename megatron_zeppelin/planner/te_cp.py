"""``te_cp``: static TP x CP as a Megatron-Core + TransformerEngine user runs it.

The layout is fixed for the whole run (``--tensor-model-parallel-size t``,
``--context-parallel-size c``).  A competent user picks it for the model,
the maximum length and the cluster: among the TP sizes that divide a node and
the heads, and the CP sizes that hold the longest sequence in memory
(:func:`te_cp_layouts` lists them with the reason each other one fails), the
fastest on their data (the simulator times each, ``sim/static_layout.py``).
A rank of the plan is one TP group (``cost/tp.py``).

The world is then ``world / c`` DP replicas of ``c`` consecutive ranks
(Megatron's rank order puts CP inside DP: a CP group is node-contiguous and
spans nodes only when it outgrows a node).  Each replica packs whole sequences
into its THD buffer (longest first onto the replica with the fewest tokens,
at most ``c * tokens_per_gpu`` of them), and TE's THD attention cuts *every*
packed sequence into ``2c`` chunks (DualChunkSwap) and runs one p2p ring over
the group carrying all of them (``Plan.packed_rings``) -- short sequences pay
ring traffic too.  No
routing: TE's p2p sends go through each GPU's own NIC.  What does not fit one
pass waits for the next micro-batch (gradient accumulation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.memory import memory_problem
from megatron_zeppelin.cost.tp import tp_problem
from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.plan import Mode, rings_by_ranks
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.packing import zigzag_or_one_rank
from megatron_zeppelin.planner.rounds import RoundsPlan
from megatron_zeppelin.planner.static_groups import StaticGroupPlanner

#: TP sizes a Megatron user tries (TP stays inside a node's NVLink).
TP_SIZES = (1, 2, 4, 8)
#: Feasible CP sizes tried per TP size, smallest first: a wider ring holds the
#: same tokens in more steps, so a user stops after the first two that fit.
CP_SIZES_PER_TP = 2


@dataclass(frozen=True)
class StaticLayout:
    """One static parallel layout a user could launch."""

    tp: int
    """Tensor-parallel size (GPUs per rank of the plan)."""
    size: int
    """CP (or SP) group size, in ranks of the plan."""
    problem: str | None = None
    """Why it cannot run (None: feasible)."""

    def __str__(self) -> str:
        return f"TP={self.tp} x CP={self.size}"


def tp_problems(cost: CostModel, max_seq_len: int, tokens_per_gpu: int) -> dict[int, str | None]:
    """For every TP size a user might launch on ``cost``'s cluster (TP=1 view):
    why it cannot run, or None.  The TP x CP layouts add their own reasons."""
    topo, m = cost.cluster.topology, cost.model
    out = {}
    for tp in TP_SIZES:
        problem = tp_problem(cost.cluster, m.num_attention_heads, m.num_query_groups, tp)
        if problem is None and max_seq_len > topo.world_size * tokens_per_gpu:
            problem = f"a {max_seq_len}-token sequence is over {topo.world_size} GPUs x {tokens_per_gpu} tokens"
        if problem is None:
            problem = memory_problem(m, cost.cluster.gpu.memory_gib, tp, topo.world_size // tp)
        out[tp] = problem
    return out


def te_cp_layouts(cost: CostModel, max_seq_len: int, tokens_per_gpu: int) -> list[StaticLayout]:
    """Every TP x CP a user might launch for ``max_seq_len`` on ``cost``'s
    cluster (TP=1 view), each with the reason it fails or None."""
    world = cost.cluster.topology.world_size
    out = []
    for tp, problem in tp_problems(cost, max_seq_len, tokens_per_gpu).items():
        c, fits = 1, 0
        while c * tp <= world and fits < CP_SIZES_PER_TP:
            why = problem
            if why is None and world % (c * tp):
                why = f"TP x CP = {tp * c} does not divide {world} GPUs"
            if why is None and max_seq_len > c * tp * tokens_per_gpu:
                why = f"a {max_seq_len}-token sequence is over {c * tp} GPUs x {tokens_per_gpu} tokens per GPU"
            out.append(StaticLayout(tp, c, why))
            fits += why is None
            c *= 2
    return out


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


class TeCpPlanner(StaticGroupPlanner):
    """DP replicas of one fixed CP group size; every sequence zigzag-split over
    its group, a group's ring sequences of a pass in one packed ring."""

    name = "te_cp"
    mode = Mode.RING
    shares = zigzag_or_one_rank
    group = "CP group"

    def plan_rounds(self, seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan:
        """As static groups plan them, each pass's CP groups' ring sequences in
        one packed ring each (``Plan.packed_rings``), as TE's THD ring carries
        them: the engine runs the plans as TE runs them (but for its fp32
        dK/dV), and the simulator times them so (``add_attention(pack=True)``)."""
        planned = super().plan_rounds(seq_lens, ctx)
        rounds = tuple(dataclasses.replace(r, packed_rings=rings_by_ranks(r.attention)) for r in planned.rounds)
        if len(rounds) == 1:
            return RoundsPlan(rounds[0], rounds)
        # The merged plan lists every round's placements, round after round: each round packs its own.
        merged, start, packed = planned.merged, 0, []
        for r in planned.rounds:
            packed += rings_by_ranks(merged.attention[start:start + len(r.attention)])
            start += len(r.attention)
        return RoundsPlan(dataclasses.replace(merged, packed_rings=tuple(packed)), rounds)

    def group_size(self, lens: tuple[int, ...], ctx: PlanContext) -> int:
        cap = ctx.tokens_per_gpu
        c = te_cp_size(lens, cap, ctx.topology.world_size, ctx.cp_size)
        for seq, L in enumerate(lens):
            if -(-L // c) > cap:
                raise InfeasibleError(
                    f"te_cp: sequence {seq} has {L} tokens, more than context-parallel size {c} "
                    f"x {cap} tokens per GPU; raise the CP size or --tokens-per-gpu")
        return c
