"""Attention kernels behind one interface (:class:`AttentionBackend`).

``get_backend("torch" | "flash" | "te" | "auto")``: ``torch`` always works (CPU
and GPU); ``flash`` needs flash-attn, ``te`` TransformerEngine (both CUDA,
fp16/bf16); ``auto`` takes flash-attn, then TransformerEngine when CUDA is
present and they import, else ``torch``.
"""

from __future__ import annotations

import torch

from megatron_zeppelin.attention.backends.base import AttentionBackend
from megatron_zeppelin.attention.backends.torch_backend import TorchBackend
from megatron_zeppelin.errors import ConfigError, ZeppelinError

BACKENDS = ("torch", "flash", "te", "auto")


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
        if torch.cuda.is_available():
            for candidate in ("flash", "te"):
                try:
                    return get_backend(candidate)
                except ZeppelinError:
                    continue
        return TorchBackend()
    raise ConfigError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "BACKENDS", "TorchBackend", "get_backend"]
