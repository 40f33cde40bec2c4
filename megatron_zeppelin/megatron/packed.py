"""A batch's THD geometry and its step context on their way into Megatron-Core.

Megatron-Core hands ``packed_seq_params`` unchanged from ``GPTModel.forward`` down
to every core attention module.  ``cu_seqlens_*`` describe this rank's buffer as
THD spans (one span per sequence piece it holds), which is also what Megatron's
unfused THD RoPE needs to apply the per-token frequencies built from
``position_ids``.  The step's :class:`~megatron_zeppelin.step_context.StepContext`
rides along: ``ZeppelinGPTModel.forward`` binds it to every Zeppelin module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_zeppelin.plan import Span
from megatron_zeppelin.step_context import StepContext


@dataclass
class ZeppelinPackedSeqParams(PackedSeqParams):
    """THD parameters of this rank's tokens plus the step's context."""

    context: StepContext | None = None
    """The step's context (Plan, communicator, backend, counters, caches)."""
    position_ids: torch.Tensor | None = None
    """``[t]`` int64: each token's position inside its own sequence (RoPE)."""
    pad_tokens: int = 0
    """Rows after the span tokens that belong to no sequence (a rank holding no token
    still needs one row: Megatron's layers cannot run on an empty tensor).  They
    attend only to themselves, carry no loss and are invisible to the engine."""


def build_packed_seq_params(spans: Sequence[Span], *, context: StepContext, device: torch.device,
                            pad_tokens: int = 0) -> ZeppelinPackedSeqParams:
    """Packed parameters for a buffer made of ``spans`` in order.

    With a plan, ``spans`` must be ``context.plan.attention_spans(context.rank)``;
    without one, each span must be a whole sequence (causal attention runs inside
    each span).  With a plan the buffer is ONE span: the engine takes its geometry
    from the plan, and Megatron's THD RoPE, which reads ``cu_seqlens`` back with one
    ``.item()`` per span, then applies the per-token frequencies in one pass.
    ``cu_seqlens`` stay in host memory (a device tensor would stall the stream at
    each read); the position ids go to ``device``, pinned and non-blocking.
    """
    lengths = [sp.length for sp in spans] + ([pad_tokens] if pad_tokens else [])
    spans_of_rope = [sum(lengths)] if context.plan is not None and lengths else lengths
    cu = torch.cumsum(torch.tensor([0] + spans_of_rope, dtype=torch.int32), 0, dtype=torch.int32)
    positions = torch.cat([torch.arange(sp.start, sp.end) for sp in spans] + [torch.arange(pad_tokens)])
    positions = (positions.pin_memory().to(device, non_blocking=True) if device.type == "cuda"
                 else positions.to(device))
    max_len = max(lengths, default=0)
    return ZeppelinPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
        max_seqlen_kv=max_len, context=context, position_ids=positions, pad_tokens=pad_tokens)
