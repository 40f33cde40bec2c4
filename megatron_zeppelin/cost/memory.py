"""Does a static TP x CP layout fit in GPU memory?  (Megatron-LM's footprint.)

Megatron with ``--use-distributed-optimizer`` keeps, per GPU, the bf16 weights
and fp32 main gradients of its tensor-parallel shard, plus its DP shard of the
fp32 master weights and Adam's two moments (Rajbhandari et al. 2020, ZeRO-1
accounting; Megatron's ``DistributedOptimizer``).  Activations are what the
user's per-GPU token cap stands for (``--tokens-per-gpu`` is the memory left
for them), so only these model states are checked here: they decide which TP
sizes can run at all (a 7B model's states alone overflow a 40 GiB GPU at TP=1).
"""

from __future__ import annotations

from megatron_zeppelin.model_config import ModelConfig

#: bf16 weight (2 B) + fp32 main gradient (4 B) per parameter of the TP shard.
REPLICATED_BYTES_PER_PARAM = 6
#: fp32 master weight, Adam m and v per parameter, sharded over data parallelism.
SHARDED_BYTES_PER_PARAM = 12
#: Fraction of HBM a run can fill: the CUDA context, NCCL buffers and allocator
#: fragmentation take the rest (estimate: a few GiB on a 40-80 GiB GPU).
USABLE_MEMORY = 0.9
GIB = 2 ** 30


def megatron_state_bytes(model: ModelConfig, tp: int, dp: int) -> float:
    """Bytes of weights, gradients and optimizer states one GPU holds for TP
    size ``tp`` and ``dp`` ranks sharing the optimizer (Megatron shards it over
    DP x CP)."""
    params = model.num_parameters / tp
    return params * (REPLICATED_BYTES_PER_PARAM + SHARDED_BYTES_PER_PARAM / dp)


def memory_problem(model: ModelConfig, memory_gib: float, tp: int, dp: int) -> str | None:
    """Why the model states do not fit ``memory_gib`` GiB per GPU, or None."""
    need = megatron_state_bytes(model, tp, dp)
    have = memory_gib * GIB * USABLE_MEMORY
    if need <= have:
        return None
    return (f"weights, gradients and optimizer states need {need / GIB:.1f} GiB per GPU at TP={tp}, over "
            f"{have / GIB:.1f} usable of {memory_gib:g} GiB")
