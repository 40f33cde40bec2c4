"""The kernel interface every attention backend implements.

A backend computes softmax attention of ONE query block against ONE key block
of the same sequence and returns the log-sum-exp (LSE) of every query row, so
that partial results over several key blocks can be merged exactly
(:mod:`megatron_zeppelin.attention.merge`) and the backward pass can be run
per block against the *final* output and LSE (as ring-flash-attention does).

Masking is the simplest exact API the engine needs: the zigzag ring only ever
meets three kinds of (query chunk, key chunk) pairs -- earlier key chunk (no
mask), the same chunk (diagonal causal mask, ``tq == tk``) and later key chunk
(skipped by the caller) -- and local / Ulysses sequences are whole diagonal
blocks.  So ``causal=True`` means "query i sees keys j <= i" on a square block,
``causal=False`` means "every query sees every key".

Shapes: ``q: [tq, hq, d]``, ``k, v: [tk, hk, d]`` (GQA: ``hq`` a multiple of
``hk``; query head ``h`` uses key head ``h // (hq // hk)``), ``out: [tq, hq, d]``
in ``q.dtype``, ``lse: [hq, tq]`` float32 (the flash-attn varlen convention).

Inputs may be any strided views (a Ulysses head split, one piece of a larger
buffer, Megatron's ``value`` split out of the fused QKV): a backend whose kernel
reads raw pointers makes them contiguous first (:func:`contiguous`).  Lengths
that size a kernel launch (``max_seqlen``) come from the caller as host ints,
known from the Plan, so no call waits for the GPU to read them back.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_zeppelin.errors import ConfigError


class AttentionBackend(Protocol):
    """Block attention kernels with LSE."""

    name: str
    """``torch``, ``flash`` or ``te``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [tq, hq, d], lse [hq, tq] fp32)`` of one block pair."""

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of one block pair, shaped like ``q, k, v``.

        ``out`` and ``lse`` are the *final* output and LSE of the query rows
        (after merging every key block), so the block's softmax probabilities are
        ``exp(q k^T * scale - lse)`` and the per-row correction term is
        ``sum(dout * out)`` -- which makes per-block gradients add up exactly."""

    def varlen_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       cu_seqlens: torch.Tensor, max_seqlen: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of many whole sequences packed THD-style:
        sequence ``i`` is rows ``cu_seqlens[i]:cu_seqlens[i+1]`` of q, k and v
        (``cu_seqlens``: int32, starts at 0; ``max_seqlen``: the longest, a host
        int).  Returns ``(out, lse [hq, t])``."""

    def varlen_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, *, cu_seqlens: torch.Tensor,
                        max_seqlen: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of :meth:`varlen_forward`."""


#: The flags that choose the kernels, for error messages.
BACKEND_FLAGS = "--zeppelin-backend in Megatron-LM, --backend in python -m megatron_zeppelin.train"

#: Element types the fused kernels (flash-attn, TransformerEngine) compute in.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors as dense row-major storage (a copy only where a view is strided):
    fused kernels read ``data_ptr()`` and the shape and ignore strides."""
    return [t.contiguous() for t in tensors]


def check_fused_input(name: str, q: torch.Tensor) -> None:
    """A fused kernel's input must be an fp16/bf16 CUDA tensor; the error names the
    flags that pick the PyTorch kernels instead."""
    if not q.is_cuda or q.dtype not in HALF_DTYPES:
        raise ConfigError(f"attention backend {name!r} needs fp16/bf16 CUDA tensors, got {q.dtype} on "
                          f"{q.device}; choose the torch kernels, or auto, which uses them for fp32 and "
                          f"CPU tensors ({BACKEND_FLAGS})")


def check_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> int:
    """Validate block shapes; return the GQA group size ``hq // hk``."""
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[2] != k.shape[2]:
        raise ValueError(f"attention block shapes must be q [tq, hq, d], k/v [tk, hk, d]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk:
        raise ConfigError(f"query heads ({hq}) must be a multiple of key/value heads ({hk}) "
                          "(grouped-query attention); fix num_query_groups")
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(f"a causal block must be square (diagonal), got tq={q.shape[0]}, "
                         f"tk={k.shape[0]}")
    return hq // hk
