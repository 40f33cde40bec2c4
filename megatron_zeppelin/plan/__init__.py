"""The Plan data structure and its shard geometry (pure Python, no torch)."""

from megatron_zeppelin.plan.plan import (Mode, Plan, SeqPlacement, Span, TierCounts, Transfer, attention_buffers,
                                         placement, rings_by_ranks, ulysses_by_ranks)
from megatron_zeppelin.plan.shards import causal_pairs, chunk_bounds, contiguous_shards, zigzag_shards

__all__ = ["Mode", "Plan", "SeqPlacement", "Span", "TierCounts", "Transfer", "attention_buffers",
           "placement", "rings_by_ranks", "ulysses_by_ranks", "causal_pairs", "chunk_bounds", "contiguous_shards",
           "zigzag_shards"]
