"""The one log-sum-exp merge of partial attention results.

For one query row, attention over key set A gives ``o_A = sum_j p_j v_j / Z_A``
with ``lse_A = log Z_A``.  Over the union of disjoint key sets A and B:

    lse   = log(Z_A + Z_B)           = logaddexp(lse_A, lse_B)
    o     = (Z_A o_A + Z_B o_B) / Z  = exp(lse_A - lse) o_A + exp(lse_B - lse) o_B

The weights are written as ``sigmoid`` of the LSE difference (ring-flash-attention's
form, ``exp(lse_B - lse) = sigmoid(lse_B - lse_A)``), which never overflows.
A running ``lse`` of ``-inf`` (no keys yet) takes the block as is
(``sigmoid(+inf) = 1``, ``logaddexp(-inf, x) = x``), so accumulators can start at
``(0, -inf)``.  Accumulators are float32 (float64 for float64 inputs) whatever the kernel dtype.
"""

from __future__ import annotations

import torch


def update_out_and_lse(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                       block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one block result into the running ``(out [t, h, d] fp32, lse [h, t] fp32)``
    **in place** (views of larger accumulators included); ``None`` starts a new
    accumulator.  Returns the pair.  In place because a ring merges every block of
    every step: the functional form cost about four full-size fp32 temporaries each."""
    acc = torch.promote_types(block_out.dtype, torch.float32)
    block_out = block_out.to(acc)
    block_lse = block_lse.to(torch.promote_types(block_lse.dtype, acc))
    if out is None:
        return block_out, block_lse
    # weight of the new block per row: [h, t] -> [t, h, 1] to broadcast over d;
    # lerp: out + w (block - out) = exp(lse_A - lse) o_A + exp(lse_B - lse) o_B.
    w = torch.sigmoid(block_lse - lse).transpose(0, 1).unsqueeze(-1)
    out.lerp_(block_out, w)
    torch.logaddexp(lse, block_lse, out=lse)
    return out, lse
