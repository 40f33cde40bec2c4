"""TransformerEngine fused attention (cuDNN, CUDA, fp16/bf16), THD layout.

Uses the same entry points TransformerEngine's own context-parallel ring uses
(``cpp_extensions.fused_attn_fwd/bwd`` with the ``F16_arbitrary_seqlen``
backend, ``thd_thd_thd`` layout, ``padding[_causal]`` masks): they return the
softmax statistics (LSE) and accept the final output and LSE in the backward,
which the ring needs.  Their keyword lists changed across releases, so every
argument is passed by name and filtered against the installed signature
(:func:`_call`, the one version shim).  The LSE comes back either packed
``[t, h, 1]`` (cuDNN >= 9.6) or padded ``[b, h, max_s, 1]``; both are converted
to and from the engine's ``[h, t]``.
"""

from __future__ import annotations

import inspect

import torch

from megatron_zeppelin.attention.backends.base import (BACKEND_FLAGS, check_block, check_fused_input,
                                                        contiguous)
from megatron_zeppelin.errors import ConfigError


def _import_te():
    try:
        from transformer_engine.pytorch.cpp_extensions import fused_attn
    except ImportError as exc:
        raise ConfigError(f"attention backend 'te' needs TransformerEngine ({exc}); install "
                          f"transformer-engine[pytorch] on a CUDA machine, or choose the torch or auto "
                          f"kernels ({BACKEND_FLAGS})") from None
    return fused_attn


def _call(fn, **kwargs):
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _lengths(cu: torch.Tensor) -> list[int]:
    # A device read: only the padded-stats layout of cuDNN < 9.6 needs every length.
    return (cu[1:] - cu[:-1]).tolist()


def _lse_to_engine(stats: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """TE softmax stats -> ``[h, t]`` fp32."""
    if stats.dim() == 3:                                    # packed [t, h, 1]
        return stats[..., 0].transpose(0, 1).float().contiguous()
    # padded [b, h, max_s, 1]: sequence i's rows are stats[i, :, :len_i]
    return torch.cat([stats[i, :, :n, 0] for i, n in enumerate(_lengths(cu))], dim=1).float()


def _lse_to_te(lse: torch.Tensor, packed: bool, cu: torch.Tensor) -> torch.Tensor:
    """``[h, t]`` -> TE's packed ``[t, h, 1]`` or padded ``[b, h, max_s, 1]`` stats."""
    if packed:
        return lse.transpose(0, 1).unsqueeze(-1).contiguous()
    lengths = _lengths(cu)
    out = lse.new_zeros(len(lengths), lse.shape[0], max(lengths), 1)
    start = 0
    for i, n in enumerate(lengths):
        out[i, :, :n, 0] = lse[:, start:start + n]
        start += n
    return out


class TeBackend:
    """TransformerEngine cuDNN fused attention over THD-packed blocks."""

    name = "te"

    def __init__(self) -> None:
        self._fa = _import_te()
        self._backend = self._fa.FusedAttnBackend["F16_arbitrary_seqlen"]
        try:  # cuDNN >= 9.6 returns THD softmax stats packed (what TE's own CP code checks)
            from transformer_engine.pytorch.utils import get_cudnn_version
            self._packed_stats = get_cudnn_version() >= (9, 6, 0)
        except ImportError:
            self._packed_stats = True

    def _check(self, q: torch.Tensor) -> None:
        check_fused_input(self.name, q)

    def _common(self, cu_q, cu_k, max_q, max_k, scale, causal) -> dict:
        return dict(max_seqlen_q=max_q, max_seqlen_kv=max_k,
                    cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=cu_q,
                    cu_seqlens_kv_padded=cu_k, fused_attention_backend=self._backend,
                    attn_scale=scale, dropout=0.0, fast_zero_fill=True, qkv_layout="thd_thd_thd",
                    attn_bias_type="no_bias", attn_mask_type="padding_causal" if causal else "padding",
                    window_size=(-1, 0) if causal else (-1, -1))

    def varlen_forward(self, q, k, v, *, cu_seqlens, max_seqlen, scale, cu_seqlens_k=None, max_seqlen_k=None,
                       causal=True):
        self._check(q)
        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
        q, k, v = contiguous(q, k, v)  # TE reads data_ptr() and the shape, never the strides
        out, aux = _call(self._fa.fused_attn_fwd, is_training=True, q=q, k=k, v=v, fake_dtype=q.dtype,
                         **self._common(cu_seqlens, cu_k, max_seqlen, max_k, scale, causal))
        return out, _lse_to_engine(aux[0], cu_seqlens)

    def varlen_backward(self, dout, q, k, v, out, lse, *, cu_seqlens, max_seqlen, scale, cu_seqlens_k=None,
                        max_seqlen_k=None, causal=True):
        self._check(q)
        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
        dout, q, k, v, out = contiguous(dout, q, k, v, out)
        stats = _lse_to_te(lse.float(), self._packed_stats, cu_seqlens)
        # dropout is 0, so the philox state is never read; TE still wants the tensor.
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        grads = _call(self._fa.fused_attn_bwd, q=q, k=k, v=v, o=out, d_o=dout,
                      fake_dtype=q.dtype, dqkv_dtype=q.dtype, aux_ctx_tensors=[stats, rng_state],
                      deterministic=False, **self._common(cu_seqlens, cu_k, max_seqlen, max_k, scale, causal))
        return grads[0], grads[1], grads[2]

    def forward(self, q, k, v, *, causal, scale):
        check_block(q, k, v, causal)
        cu_q, cu_k = _cu(q.shape[0], q.device), _cu(k.shape[0], q.device)
        return self.varlen_forward(q, k, v, cu_seqlens=cu_q, max_seqlen=q.shape[0], scale=scale, cu_seqlens_k=cu_k,
                                   max_seqlen_k=k.shape[0], causal=causal)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        check_block(q, k, v, causal)
        cu_q, cu_k = _cu(q.shape[0], q.device), _cu(k.shape[0], q.device)
        return self.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=cu_q, max_seqlen=q.shape[0], scale=scale,
                                    cu_seqlens_k=cu_k, max_seqlen_k=k.shape[0], causal=causal)


def _cu(n: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([0, n], dtype=torch.int32, device=device)
