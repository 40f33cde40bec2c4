"""PyTorch's own FlashAttention varlen kernels (CUDA, fp16/bf16): no flash-attn build needed.

The ring needs a backward fed the *final* output and LSE, which SDPA's autograd
cannot take; the aten ops underneath it can:

* ``aten::_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q,
  max_k, dropout_p, is_causal, return_debug_mask, *, scale=None, ...)`` ->
  ``(output, softmax_logsumexp, rng_state, unused, debug_attn_mask)``; with
  ``cum_seq_*`` given, ``q/k/v`` are THD ``[t, h, d]`` and the LSE is packed
  ``[hq, t]`` fp32 -- the engine's own layout, no conversion;
* ``aten::_flash_attention_backward(grad_out, query, key, value, out, logsumexp,
  cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
  scale=None, ...)`` -> ``(dq, dk, dv)``.

These ten / fourteen positional arguments and the ``scale`` keyword are the same
in every schema read (torch 2.5.1, 2.12 and the installed 2.13, see
``tests/attention/fixtures/torch_flash_schemas.py``); the H200 run of
2026-11-26 called them this way on torch 2.11.  Only the names of outputs 3-4
changed (``philox_seed/philox_offset`` -> ``rng_state/unused``), and they are
read by position.  GQA goes in directly (``hq`` a multiple of ``hk``, no repeat).

Dropout is always 0, so the backward never reads ``rng_state``/``unused``
(flash_api.cpp reads them only when ``p_dropout > 0``): the backend is
stateless -- the ring's backward runs against the merged output and LSE, not a
block's own -- and passes placeholders of one device, made once.

On Hopper, where torch offers ``activate_flash_attention_impl("FA3")`` (it needs
the ``flash_attn_interface`` package), the first CUDA call activates it unless
the user already chose an implementation; FA3 then serves these same aten ops
process-wide.  When activation raises, the kernels stay FA2 with one debug note.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from megatron_zeppelin.attention.backends.base import (BACKEND_FLAGS, FusedKernels, check_fused_input,
                                                        contiguous)
from megatron_zeppelin.errors import ConfigError

logger = logging.getLogger(__name__)


def aten_flash_ops() -> SimpleNamespace:
    """``forward`` / ``backward``: torch's FlashAttention aten ops, or a ConfigError
    naming what is missing."""
    try:
        return SimpleNamespace(forward=torch.ops.aten._flash_attention_forward,
                               backward=torch.ops.aten._flash_attention_backward)
    except (AttributeError, RuntimeError):
        raise ConfigError(f"attention backend 'torch_flash' needs torch's FlashAttention ops, which "
                          f"torch {torch.__version__} lacks; upgrade torch or choose the torch kernels "
                          f"({BACKEND_FLAGS})") from None


def activate_fa3(attention, device: torch.device) -> bool:
    """Switch torch's flash ops to FA3 on Hopper when torch can and the user chose
    nothing else; True when FA3 now serves them.  ``attention`` is
    :mod:`torch.nn.attention` (a parameter, so tests can stand in for it)."""
    activate = getattr(attention, "activate_flash_attention_impl", None)
    current = getattr(attention, "current_flash_attention_impl", lambda: None)
    if activate is None or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    if current() is not None:
        return current() == "FA3"
    try:
        activate("FA3")
    except Exception as exc:  # noqa: BLE001 -- any failure means: stay on FA2
        logger.debug("torch_flash: FA3 not available (%s: %s); using FlashAttention-2",
                     type(exc).__name__, exc)
        return False
    return True


class TorchFlashBackend(FusedKernels):
    """torch's FlashAttention varlen kernels; one block pair is a batch of one sequence."""

    name = "torch_flash"

    def __init__(self, ops: SimpleNamespace | None = None) -> None:
        """``ops``: stand-ins for the two aten ops (tests on CPU); None uses torch's
        own, which need CUDA."""
        if ops is None and not torch.cuda.is_available():
            raise ConfigError("attention backend 'torch_flash' needs CUDA fp16/bf16 tensors and CUDA is "
                              f"not available; choose the torch kernels, or auto ({BACKEND_FLAGS})")
        self._ops = ops if ops is not None else aten_flash_ops()
        self._try_fa3 = ops is None
        self._placeholders: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _check(self, q: torch.Tensor) -> None:
        check_fused_input(self.name, q)
        if self._try_fa3:
            self._try_fa3 = False
            activate_fa3(torch.nn.attention, q.device)

    def _no_dropout_rng(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Never read at dropout 0, so never written either (empty: no kernel, nothing for
        # another stream to wait on); cached and never freed, so no reuse can be raced.
        if device not in self._placeholders:
            self._placeholders[device] = (torch.empty(2, dtype=torch.int64, device=device),
                                          torch.empty((), dtype=torch.int64, device=device))
        return self._placeholders[device]

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        self._check(q)
        q, k, v = contiguous(q, k, v)
        out, lse, _rng, _unused, _debug = self._ops.forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                            False, scale=scale)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        self._check(q)
        dout, q, k, v, out, lse = contiguous(dout, q, k, v, out, lse.float())
        rng_state, unused = self._no_dropout_rng(q.device)
        dq, dk, dv = self._ops.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                        rng_state, unused, scale=scale)
        return dq, dk, dv
