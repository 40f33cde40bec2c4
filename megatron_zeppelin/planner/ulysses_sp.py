"""``ulysses_sp``: static DeepSpeed-Ulysses sequence parallelism.

One SP size ``d`` for the whole run (``sequence_parallel_size``), so the world
is ``world / d`` DP replicas of ``d`` consecutive ranks.  Each replica packs
whole sequences into one buffer (longest first onto the replica with the
fewest tokens, at most ``d * tokens_per_gpu``) and every layer runs one
all-to-all of Q, K, V for the whole packed buffer (tokens -> heads), attention
on ``heads / d`` heads, and one all-to-all back (Jacobs et al. 2023); the
simulator prices the group's sequences together (``CostModel.ulysses_cost``).
``d`` must divide the KV heads.  Weights and optimizer states are ZeRO-sharded
over all GPUs, as DeepSpeed-Ulysses runs, so memory limits only the tokens.
What does not fit one pass waits for the next micro-batch.
"""

from __future__ import annotations


from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.packing import contiguous_or_one_rank
from megatron_zeppelin.planner.static_groups import StaticGroupPlanner
from megatron_zeppelin.planner.te_cp import StaticLayout


def ulysses_layouts(cost: CostModel, max_seq_len: int, tokens_per_gpu: int) -> list[StaticLayout]:
    """Every SP size (power of two up to the world) with the reason it fails or None."""
    world, kv = cost.cluster.topology.world_size, cost.model.num_query_groups
    out, d = [], 1
    while d <= world:
        problem = None
        if kv % d:
            problem = f"SP={d} does not divide the {kv} KV heads"
        elif max_seq_len > d * tokens_per_gpu:
            problem = f"a {max_seq_len}-token sequence is over {d} GPUs x {tokens_per_gpu} tokens per GPU"
        out.append(StaticLayout(1, d, problem))
        d *= 2
    return out


class UlyssesSpPlanner(StaticGroupPlanner):
    """DP replicas of one fixed Ulysses group size; the group's sequences share its all-to-alls."""

    name = "ulysses_sp"
    mode = Mode.ULYSSES
    shares = contiguous_or_one_rank
    group = "SP group"

    def group_size(self, lens: tuple[int, ...], ctx: PlanContext) -> int:
        cap, world = ctx.tokens_per_gpu, ctx.topology.world_size
        kv = ctx.local_heads[1]
        d = ctx.cp_size or next((d for d in (1 << i for i in range(world.bit_length()))
                                 if kv % d == 0 and world % d == 0 and -(-max(lens, default=1) // d) <= cap),
                                None)
        if d is None or world % d or kv % d:
            what = "no SP size" if d is None else f"SP size {d}"
            raise InfeasibleError(f"ulysses_sp: {what} divides both {world} GPUs and {kv} KV heads while holding "
                                  f"the longest sequence at {cap} tokens per GPU; static Ulysses cannot run this "
                                  "configuration (raise the tokens per GPU or lower the maximum length)")
        return d
