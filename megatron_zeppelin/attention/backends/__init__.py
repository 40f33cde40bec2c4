"""Attention kernels behind one interface (:class:`AttentionBackend`).

``get_backend("torch" | "flash" | "te" | "auto")``: ``torch`` always works (CPU
and GPU); ``flash`` needs flash-attn, ``te`` TransformerEngine (both CUDA,
fp16/bf16 only); ``auto`` runs each call on flash-attn, else TransformerEngine,
when CUDA is present, one of them imports and the tensors are fp16/bf16 CUDA
tensors, and on the PyTorch kernels otherwise (fp32, CPU).
"""

from __future__ import annotations

import torch

from megatron_zeppelin.attention.backends.base import HALF_DTYPES, AttentionBackend
from megatron_zeppelin.attention.backends.torch_backend import TorchBackend
from megatron_zeppelin.errors import ConfigError, ZeppelinError

BACKENDS = ("torch", "flash", "te", "auto")


class AutoBackend:
    """Fused kernels where they compute (fp16/bf16 on CUDA), PyTorch's elsewhere: a
    run in fp32 never reaches flash-attn or TransformerEngine, which would refuse it."""

    name = "auto"

    def __init__(self, fused: AttentionBackend | None) -> None:
        self.fused = fused
        """flash-attn or TransformerEngine kernels, None when neither is usable."""
        self.torch = TorchBackend()

    def pick(self, q: torch.Tensor) -> AttentionBackend:
        """The backend that runs a call on ``q``."""
        if self.fused is not None and q.is_cuda and q.dtype in HALF_DTYPES:
            return self.fused
        return self.torch

    def forward(self, q, k, v, **kwargs):
        return self.pick(q).forward(q, k, v, **kwargs)

    def backward(self, dout, q, k, v, out, lse, **kwargs):
        return self.pick(q).backward(dout, q, k, v, out, lse, **kwargs)

    def varlen_forward(self, q, k, v, **kwargs):
        return self.pick(q).varlen_forward(q, k, v, **kwargs)

    def varlen_backward(self, dout, q, k, v, out, lse, **kwargs):
        return self.pick(q).varlen_backward(dout, q, k, v, out, lse, **kwargs)


def get_backend(name: str = "auto") -> AttentionBackend:
    """Instantiate the backend ``name``; a clear :class:`ConfigError` when it is
    requested but not installed."""
    if name == "torch":
        return TorchBackend()
    if name == "flash":
        from megatron_zeppelin.attention.backends.flash import FlashBackend
        return FlashBackend()
    if name == "te":
        from megatron_zeppelin.attention.backends.te import TeBackend
        return TeBackend()
    if name == "auto":
        fused = None
        if torch.cuda.is_available():
            for candidate in ("flash", "te"):
                try:
                    fused = get_backend(candidate)
                    break
                except ZeppelinError:
                    continue
        return AutoBackend(fused)
    raise ConfigError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AutoBackend", "BACKENDS", "TorchBackend", "get_backend"]
