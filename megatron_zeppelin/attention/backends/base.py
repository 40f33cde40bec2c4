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
``causal=False`` means "every query sees every key".  On a square block the
top-left diagonal is also flash-attn's bottom-right one, so every kernel agrees.

Shapes: ``q: [tq, hq, d]``, ``k, v: [tk, hk, d]`` (GQA: ``hq`` a multiple of
``hk``; query head ``h`` uses key head ``h // (hq // hk)``), ``out: [tq, hq, d]``
in ``q.dtype``, ``lse: [hq, tq]`` float32 (the flash-attn varlen convention).

Inputs may be any strided views (a Ulysses head split, one piece of a larger
buffer, Megatron's ``value`` split out of the fused QKV): a backend whose kernel
reads raw pointers makes them contiguous first (:func:`contiguous`).

No call waits for the GPU (no host sync on CUDA): lengths that size a kernel
launch (``max_seqlen``) are host ints from the Plan; ``cu_seqlens`` is already
on the device (the engine uploads it once per step, pinned and non-blocking);
a backend that loops on the host reads the host copy ``lengths``, never
``cu_seqlens``; a fused backend builds the ``[0, n]`` offsets of one block with
a device kernel (:func:`single_sequence_offsets`), never from a host list.
"""

from __future__ import annotations

import re
from typing import Protocol, Sequence

import torch

from megatron_zeppelin.errors import ConfigError


class AttentionBackend(Protocol):
    """Block attention kernels with LSE."""

    name: str
    """``torch``, ``torch_flash``, ``flash`` or ``te`` (``auto`` picks one per call)."""

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
                       cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                       lengths: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of many whole sequences packed THD-style:
        sequence ``i`` is rows ``cu_seqlens[i]:cu_seqlens[i+1]`` of q, k and v.

        ``cu_seqlens``: int32, starts at 0, already on q's device; ``max_seqlen``:
        the longest, a host int; ``lengths``: the same sequence lengths as a host
        tuple, or None (then only a ``cu_seqlens`` on the CPU may be read on the
        host).  Returns ``(out, lse [hq, t])``."""

    def varlen_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, *, cu_seqlens: torch.Tensor,
                        max_seqlen: int, scale: float,
                        lengths: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of :meth:`varlen_forward` (same ``cu_seqlens``/``lengths`` rules)."""


#: The flags that choose the kernels, for error messages.
BACKEND_FLAGS = "--zeppelin-backend in Megatron-LM, --backend in python -m megatron_zeppelin.train"

#: Element types the fused kernels (torch's flash, flash-attn, TransformerEngine) compute in.
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


def host_bounds(cu_seqlens: torch.Tensor, lengths: Sequence[int] | None) -> list[int]:
    """Row bounds ``[0, l0, l0+l1, ...]`` of a packed batch, on the host, for a
    backend that loops over sequences: from ``lengths`` when the caller has them,
    else from a ``cu_seqlens`` that lives on the CPU (reading a device tensor
    would stall the stream until the GPU catches up)."""
    if lengths is not None:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + int(n))
        return bounds
    if cu_seqlens.device.type != "cpu":
        raise ConfigError(f"varlen attention with cu_seqlens on {cu_seqlens.device} needs the host "
                          "lengths too (lengths=...): reading cu_seqlens back would sync the GPU")
    return [int(b) for b in cu_seqlens.tolist()]


def _offsets(n: int, device: torch.device) -> torch.Tensor:
    # [0, n] by a device kernel: arange's step needs n > 0.
    if n == 0:
        return torch.zeros(2, dtype=torch.int32, device=device)
    return torch.arange(0, 2 * n, n, dtype=torch.int32, device=device)


def single_sequence_offsets(n_q: int, n_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_q, cu_k)`` = ``([0, n_q], [0, n_k])`` int32 on ``device``, built by a
    device kernel on the current stream (no host-to-device copy, so no sync).
    Built per call rather than cached: a cache shared by every stream would need
    its own events, and one tiny kernel costs less than that bookkeeping."""
    device = torch.device(device)
    cu_q = _offsets(n_q, device)
    return cu_q, (cu_q if n_k == n_q else _offsets(n_k, device))


def release_line(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a release string such as ``2.7.4.post1`` or ``2.8.0+cu12``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ConfigError(f"cannot read the release number {version!r}")
    return int(match.group(1)), int(match.group(2))


class FusedKernels:
    """The four entry points of a backend whose kernels take THD offsets, in terms of
    two methods the backend defines: ``_forward(q, k, v, cu_q, cu_k, max_q, max_k,
    causal, scale) -> (out, lse)`` and ``_backward(dout, q, k, v, out, lse, cu_q,
    cu_k, max_q, max_k, causal, scale) -> (dq, dk, dv)``.  A block pair is a batch
    of one sequence; a packed batch shares one set of offsets for q and k/v."""

    def varlen_forward(self, q, k, v, *, cu_seqlens, max_seqlen, scale, lengths=None):
        return self._forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, scale)

    def varlen_backward(self, dout, q, k, v, out, lse, *, cu_seqlens, max_seqlen, scale, lengths=None):
        return self._backward(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True,
                              scale)

    def forward(self, q, k, v, *, causal, scale):
        check_block(q, k, v, causal)
        cu_q, cu_k = single_sequence_offsets(q.shape[0], k.shape[0], q.device)
        return self._forward(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], causal, scale)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        check_block(q, k, v, causal)
        cu_q, cu_k = single_sequence_offsets(q.shape[0], k.shape[0], q.device)
        return self._backward(dout, q, k, v, out, lse, cu_q, cu_k, q.shape[0], k.shape[0], causal, scale)
