"""Token-budget sampling of variable-length documents (pure Python + numpy)."""

from megatron_zeppelin.sampler.batch_sampler import (
    EpochOrder,
    GlobalBatch,
    Piece,
    PieceTable,
    TokenBudgetSampler,
    ZeppelinBatchSampler,
)
from megatron_zeppelin.sampler.blend import BlendedSampler
from megatron_zeppelin.sampler.lengths import load_lengths

__all__ = ["BlendedSampler", "EpochOrder", "GlobalBatch", "Piece", "PieceTable", "TokenBudgetSampler",
           "ZeppelinBatchSampler", "load_lengths"]
