"""Attention kernels behind one interface (:class:`AttentionBackend`).

``get_backend("auto" | "torch" | "torch_flash" | "flash" | "te")``: ``torch``
always works (CPU and GPU); ``torch_flash`` is PyTorch's own FlashAttention
(CUDA, fp16/bf16, nothing to install); ``flash`` needs flash-attn 2.6-2.8, ``te``
TransformerEngine (both CUDA, fp16/bf16 only, used only when named); ``auto``
runs fp16/bf16 CUDA tensors on ``torch_flash`` when torch has its ops and CUDA
is present, and everything else (fp32, CPU) on the PyTorch kernels.
"""

from __future__ import annotations

import torch

from megatron_zeppelin.attention.backends.base import HALF_DTYPES, AttentionBackend
from megatron_zeppelin.attention.backends.torch_backend import TorchBackend
from megatron_zeppelin.errors import ConfigError, ZeppelinError

#: Every name :func:`get_backend` takes (the flags' choices list the same).
BACKENDS = ("auto", "torch", "torch_flash", "flash", "te")


class AutoBackend:
    """Fused kernels where they compute (fp16/bf16 on CUDA), PyTorch's elsewhere: a
    run in fp32 never reaches a fused kernel, which would refuse it."""

    name = "auto"

    def __init__(self, fused: AttentionBackend | None) -> None:
        self.fused = fused
        """torch's FlashAttention kernels, None without CUDA or without torch's ops."""
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
    if name == "torch_flash":
        from megatron_zeppelin.attention.backends.torch_flash import TorchFlashBackend
        return TorchFlashBackend()
    if name == "flash":
        from megatron_zeppelin.attention.backends.flash import FlashBackend
        return FlashBackend()
    if name == "te":
        from megatron_zeppelin.attention.backends.te import TeBackend
        return TeBackend()
    if name == "auto":
        try:
            return AutoBackend(get_backend("torch_flash"))
        except ZeppelinError:      # no CUDA, or a torch without the flash ops
            return AutoBackend(None)
    raise ConfigError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AutoBackend", "BACKENDS", "TorchBackend", "get_backend"]
