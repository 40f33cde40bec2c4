"""FlashAttention-2 varlen kernels (CUDA, fp16/bf16).

Forward uses the public ``flash_attn_varlen_func(..., return_attn_probs=True)``,
which also returns the LSE (``[hq, total_q]`` fp32 since flash-attn 2.4).  The
backward needs to be fed the *final* output and LSE of a ring, which only the
private ``_flash_attn_varlen_backward`` accepts; its signature changed across
releases (``window_size`` tuple -> ``window_size_left/right``, ``softcap``), so
:func:`_backward_kwargs` is the one version shim: it names every argument and
keeps those the installed release declares.
"""

from __future__ import annotations

import inspect

import torch

from megatron_zeppelin.attention.backends.base import (BACKEND_FLAGS, check_block, check_fused_input,
                                                        contiguous)
from megatron_zeppelin.errors import ConfigError


def _import_flash():
    try:
        from flash_attn import flash_attn_interface
    except ImportError as exc:
        raise ConfigError(f"attention backend 'flash' needs flash-attn ({exc}); install it with "
                          f"`pip install flash-attn --no-build-isolation` on a CUDA machine, or choose "
                          f"the torch or auto kernels ({BACKEND_FLAGS})") from None
    return flash_attn_interface


def _cu(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


class FlashBackend:
    """flash-attn varlen kernels; one block pair is a batch of one sequence."""

    name = "flash"

    def __init__(self) -> None:
        self._fa = _import_flash()
        self._bwd_params = set(inspect.signature(self._fa._flash_attn_varlen_backward).parameters)

    def _check(self, q: torch.Tensor) -> None:
        check_fused_input(self.name, q)

    def varlen_forward(self, q, k, v, *, cu_seqlens, max_seqlen, scale, cu_seqlens_k=None, max_seqlen_k=None,
                       causal=True):
        self._check(q)
        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
        q, k, v = contiguous(q, k, v)
        out, lse, _ = self._fa.flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, dropout_p=0.0, softmax_scale=scale,
            causal=causal, return_attn_probs=True)
        if lse.dim() != 2:
            raise ConfigError("flash-attn returned a padded LSE (release < 2.4); upgrade flash-attn")
        return out, lse.float()

    def varlen_backward(self, dout, q, k, v, out, lse, *, cu_seqlens, max_seqlen, scale, cu_seqlens_k=None,
                        max_seqlen_k=None, causal=True):
        self._check(q)
        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
        dout, q, k, v, out, lse = contiguous(dout, q, k, v, out, lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_varlen_backward(**self._backward_kwargs(
            dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen, max_seqlen_k=max_k, softmax_scale=scale, causal=causal))
        return dq, dk, dv

    def _backward_kwargs(self, **kwargs) -> dict:
        extra = {"dropout_p": 0.0, "window_size": (-1, -1), "window_size_left": -1,
                 "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None,
                 "deterministic": False, "rng_state": None}
        merged = {**extra, **kwargs}
        return {name: value for name, value in merged.items() if name in self._bwd_params}

    def forward(self, q, k, v, *, causal, scale):
        check_block(q, k, v, causal)
        return self.varlen_forward(q, k, v, cu_seqlens=_cu([q.shape[0]], q.device), max_seqlen=q.shape[0],
                                   scale=scale, cu_seqlens_k=_cu([k.shape[0]], q.device),
                                   max_seqlen_k=k.shape[0], causal=causal)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        check_block(q, k, v, causal)
        return self.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=_cu([q.shape[0]], q.device),
                                    max_seqlen=q.shape[0], scale=scale,
                                    cu_seqlens_k=_cu([k.shape[0]], q.device), max_seqlen_k=k.shape[0],
                                    causal=causal)
