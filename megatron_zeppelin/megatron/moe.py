"""Megatron-Core's MoE layer on CPU: a router whose gate stays on the input's device.

Megatron-Core 0.16.1's ``TopKRouter.gating`` moves a CPU gate weight to CUDA on
every call, and its ``router_gating_linear`` needs TransformerEngine.  The layer
spec plugs :class:`ZeppelinTopKRouter` into the MoE submodules instead (on
Megatron-Core's local layers): the same top-k routing, the gate computed with
``torch.nn.functional.linear`` on whatever device the tokens are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class ZeppelinTopKRouter(TopKRouter):
    """``TopKRouter`` whose gating runs on the input's device (CPU included)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        if input.is_cuda:
            return super().gating(input)
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)  # logits: [tokens, experts]
