"""The attention engine: kernels (backends/), LSE merge, zigzag ring, Ulysses,
and :func:`plan_attention`, which runs one rank's share of a whole Plan."""

from megatron_zeppelin.attention.backends import AttentionBackend, get_backend
from megatron_zeppelin.attention.engine import AttentionCounter, build_schedule, plan_attention
from megatron_zeppelin.attention.layout import rank_pieces, shard_sequences
from megatron_zeppelin.attention.merge import update_out_and_lse

__all__ = ["AttentionBackend", "AttentionCounter", "build_schedule", "get_backend", "plan_attention",
           "rank_pieces", "shard_sequences", "update_out_and_lse"]
