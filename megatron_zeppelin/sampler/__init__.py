"""Token-budget sampling of variable-length documents (pure Python + numpy)."""

from megatron_zeppelin.sampler.batch_sampler import (
    DEFAULT_BATCH_FILL,
    EpochOrder,
    GlobalBatch,
    Piece,
    PieceTable,
    TokenBudgetSampler,
    ZeppelinBatchSampler,
    batch_budget,
)
from megatron_zeppelin.sampler.blend import BlendedSampler
from megatron_zeppelin.sampler.lengths import load_lengths

__all__ = ["DEFAULT_BATCH_FILL", "BlendedSampler", "EpochOrder", "GlobalBatch", "Piece", "PieceTable", "TokenBudgetSampler",
           "ZeppelinBatchSampler", "batch_budget", "load_lengths"]
