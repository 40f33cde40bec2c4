"""TransformerEngine fused attention (cuDNN, CUDA, fp16/bf16), THD layout, each release line
called as it declares.

Uses the entry points TransformerEngine's own context-parallel ring uses
(``cpp_extensions.fused_attn_fwd/bwd`` with the ``F16_arbitrary_seqlen``
backend, ``thd_thd_thd`` layout, ``padding[_causal]`` masks): they return the
softmax statistics (LSE) and accept the final output and LSE in the backward,
which the ring needs.  What each release line declares (read from the source at
v1.12, v1.13, v2.0, v2.8, v2.14, v2.15 and v2.18; the signatures are in
``tests/attention/fixtures/te_signatures.py``), written by :func:`release_args`,
the one version shim:

* 1.12-1.13: ``fused_attn_fwd(..., q, k, v, qkv_dtype: tex.DType, backend)``,
  ``fused_attn_bwd(..., o, d_o, qkv_dtype: tex.DType, dqkv_dtype: tex.DType, aux, backend)``;
* 2.0-2.14: ``fake_dtype: torch.dtype`` in place of ``qkv_dtype``; the backward
  keeps ``dqkv_dtype: tex.DType``;
* 2.15 and later: the backward drops ``dqkv_dtype``; the output, its gradient and
  dQ/dK/dV get their own layouts (``o_format``, ``do_format``, ``dqkv_layout``),
  which default to sbhd and must be given for THD.

The softmax stats come back packed ``[t, h, 1]`` where cuDNN >= 9.6 packs
ragged stats (TE >= 1.13, not on sm120), else padded ``[b, h, max_s, 1]``; both
are converted to and from the engine's ``[h, t]`` on the device, without reading
lengths back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Mapping

import torch

from megatron_zeppelin.attention.backends.base import (BACKEND_FLAGS, FusedKernels, check_fused_input,
                                                        contiguous, release_line)
from megatron_zeppelin.errors import ConfigError

SUPPORTED_TEXT = "TransformerEngine 1.12-1.13, 2.0-2.14 or 2.15 and later"


@dataclass(frozen=True)
class TeInstall:
    """What the backend needs from an installed TransformerEngine."""

    version: str
    """``transformer_engine.__version__``."""
    fused_attn: ModuleType
    """``transformer_engine.pytorch.cpp_extensions.fused_attn`` (``fused_attn_fwd/bwd``, ``FusedAttnBackend``)."""
    te_dtype: Mapping[torch.dtype, object]
    """``transformer_engine.pytorch.constants.TE_DType``: torch dtype -> ``tex.DType``."""
    packed_stats: bool
    """Whether THD softmax stats come back packed ``[t, h, 1]`` (else padded ``[b, h, max_s, 1]``)."""


def _import_te() -> TeInstall:
    try:
        import transformer_engine
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.cpp_extensions import fused_attn
        from transformer_engine.pytorch.utils import get_cudnn_version
    except ImportError as exc:
        raise ConfigError(f"attention backend 'te' needs TransformerEngine ({exc}); install "
                          f"transformer-engine[pytorch] ({SUPPORTED_TEXT}) on a CUDA machine, or choose "
                          f"torch_flash, torch or auto ({BACKEND_FLAGS})") from None
    version = transformer_engine.__version__
    # TE's own CP code: packed from cuDNN 9.6 (the C++ side from TE 1.13), except sm120.
    packed = (release_line(version) >= (1, 13) and get_cudnn_version() >= (9, 6, 0)
              and torch.cuda.get_device_capability() != (12, 0))
    return TeInstall(version, fused_attn, TE_DType, packed)


def check_release(version: str) -> tuple[int, int]:
    """The release line of ``version``; one-line ConfigError below 1.12."""
    line = release_line(version)
    if line < (1, 12):
        raise ConfigError(f"TransformerEngine {version} is not supported; install {SUPPORTED_TEXT}, or "
                          f"choose torch_flash, which needs no TransformerEngine ({BACKEND_FLAGS})")
    return line


def release_args(line: tuple[int, int], te_dtype: Mapping[torch.dtype, object], dtype: torch.dtype,
                 backward: bool) -> tuple[tuple, dict]:
    """The dtype arguments (positional, after ``q, k, v`` in the forward and after
    ``o, d_o`` in the backward) and the layout keywords of release ``line``."""
    if line < (2, 0):
        dtypes = (te_dtype[dtype], te_dtype[dtype]) if backward else (te_dtype[dtype],)
        return dtypes, {}
    if line < (2, 15):
        return ((dtype, te_dtype[dtype]) if backward else (dtype,)), {}
    formats = dict(o_format="thd", do_format="thd", dqkv_layout="thd_thd_thd") if backward else dict(o_format="thd")
    return (dtype,), formats


def _token_positions(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence index and position within it of every packed row, on the device
    (``output_size`` spares repeat_interleave its host read of the total)."""
    starts = cu[:-1].long()
    seq = torch.repeat_interleave(torch.arange(starts.shape[0], device=cu.device), cu[1:] - cu[:-1],
                                  output_size=total)
    return seq, torch.arange(total, device=cu.device) - starts[seq]


def lse_from_te(stats: torch.Tensor, cu: torch.Tensor, total: int) -> torch.Tensor:
    """TE softmax stats -> ``[h, t]`` fp32."""
    if stats.dim() == 3:                                    # packed [t, h, 1]
        return stats[..., 0].transpose(0, 1).float().contiguous()
    seq, pos = _token_positions(cu, total)                  # padded [b, h, max_s, 1]
    return stats[seq, :, pos, 0].transpose(0, 1).float().contiguous()


def lse_to_te(lse: torch.Tensor, packed: bool, cu: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """``[h, t]`` -> TE's packed ``[t, h, 1]`` or padded ``[b, h, max_s, 1]`` stats."""
    if packed:
        return lse.transpose(0, 1).unsqueeze(-1).contiguous()
    seq, pos = _token_positions(cu, lse.shape[1])
    stats = lse.new_zeros(cu.shape[0] - 1, lse.shape[0], max_seqlen, 1)
    stats[seq, :, pos, 0] = lse.transpose(0, 1)
    return stats


class TeBackend(FusedKernels):
    """TransformerEngine cuDNN fused attention over THD-packed blocks."""

    name = "te"

    def __init__(self) -> None:
        self._te = _import_te()
        self._line = check_release(self._te.version)
        self._backend = self._te.fused_attn.FusedAttnBackend["F16_arbitrary_seqlen"]

    def _check(self, q: torch.Tensor) -> None:
        check_fused_input(self.name, q)

    def _common(self, cu_q, cu_k, scale, causal) -> dict:
        return dict(cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k, attn_scale=scale, dropout=0.0,
                    fast_zero_fill=True, qkv_layout="thd_thd_thd", attn_bias_type="no_bias",
                    attn_mask_type="padding_causal" if causal else "padding",
                    window_size=(-1, 0) if causal else (-1, -1))

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        self._check(q)
        q, k, v = contiguous(q, k, v)  # TE reads data_ptr() and the shape, never the strides
        dtypes, formats = release_args(self._line, self._te.te_dtype, q.dtype, backward=False)
        out, aux, *_ = self._te.fused_attn.fused_attn_fwd(
            True, max_q, max_k, cu_q, cu_k, q, k, v, *dtypes, self._backend,
            **self._common(cu_q, cu_k, scale, causal), **formats)
        return out, lse_from_te(aux[0], cu_q, q.shape[0])

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        self._check(q)
        dout, q, k, v, out = contiguous(dout, q, k, v, out)
        stats = lse_to_te(lse.float(), self._te.packed_stats, cu_q, max_q)
        # dropout is 0, so the philox state is never read; TE still wants the tensor.
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        dtypes, formats = release_args(self._line, self._te.te_dtype, q.dtype, backward=True)
        grads = self._te.fused_attn.fused_attn_bwd(
            max_q, max_k, cu_q, cu_k, q, k, v, out, dout, *dtypes, [stats, rng_state], self._backend,
            deterministic=False, **self._common(cu_q, cu_k, scale, causal), **formats)
        return grads[0], grads[1], grads[2]
