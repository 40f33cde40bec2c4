"""The step's Plan on its way into Megatron-Core: a ``PackedSeqParams`` subclass.

Megatron-Core hands ``packed_seq_params`` unchanged from ``GPTModel.forward`` down
to every core attention module, so it is the one channel that reaches
:class:`~megatron_zeppelin.megatron.attention.ZeppelinAttention` without touching
Megatron's signatures.  ``cu_seqlens_*`` describe this rank's buffer as THD spans
(one span per sequence piece it holds), which is also what Megatron's unfused THD
RoPE needs to apply the per-token frequencies built from ``position_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_zeppelin.attention.backends import AttentionBackend
from megatron_zeppelin.attention.engine import AttentionCounter
from megatron_zeppelin.comm.base import Communicator
from megatron_zeppelin.plan import Plan, Span


@dataclass
class ZeppelinPackedSeqParams(PackedSeqParams):
    """THD parameters of this rank's tokens plus everything the engine needs."""

    plan: Plan | None = None
    """The step's Plan; ``None`` means plain packed causal attention over
    ``cu_seqlens_q`` (whole sequences, no communication: the reference path)."""
    rank: int = 0
    """Global rank whose tokens the buffer holds (``plan.attention_spans(rank)``)."""
    communicator: Communicator | None = None
    """Round-based communicator the engine's rings and all-to-alls use."""
    backend: AttentionBackend | None = None
    """Attention kernel backend object (``megatron_zeppelin.attention.backends``)."""
    position_ids: torch.Tensor | None = None
    """``[t]`` int64: each token's position inside its own sequence (RoPE)."""
    pad_tokens: int = 0
    """Rows after the span tokens that belong to no sequence (a rank holding no token
    still needs one row: Megatron's layers cannot run on an empty tensor).  They
    attend only to themselves, carry no loss and are invisible to the engine."""
    counters: AttentionCounter | None = None
    """Counts the causal pairs this rank's attention computes (all layers), or ``None``."""


def build_packed_seq_params(spans: Sequence[Span], *, plan: Plan | None, rank: int,
                            communicator: Communicator | None, backend: AttentionBackend | None,
                            device: torch.device, pad_tokens: int = 0,
                            counters: AttentionCounter | None = None) -> ZeppelinPackedSeqParams:
    """Packed parameters for a buffer made of ``spans`` in order.

    With a plan, ``spans`` must be ``plan.attention_spans(rank)``; without one,
    each span must be a whole sequence (causal attention runs inside each span).
    """
    lengths = [sp.length for sp in spans] + ([pad_tokens] if pad_tokens else [])
    cu = torch.cumsum(torch.tensor([0] + lengths, dtype=torch.int32), 0, dtype=torch.int32).to(device)
    positions = torch.cat([torch.arange(sp.start, sp.end) for sp in spans]
                          + [torch.arange(pad_tokens)]).to(device)
    max_len = max(lengths, default=0)
    return ZeppelinPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
        max_seqlen_kv=max_len, plan=plan, rank=rank, communicator=communicator,
        backend=backend, position_ids=positions, pad_tokens=pad_tokens, counters=counters)
