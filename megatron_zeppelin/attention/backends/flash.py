"""flash-attn 2.6 / 2.7 / 2.8 varlen kernels (CUDA, fp16/bf16), each called as it declares.

Forward: the public ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, ...,
return_attn_probs)`` -> ``(out, softmax_lse [hq, t] fp32, S_dmask)``: the same
signature in 2.6.3, 2.7.x and 2.8.x.

Backward: the ring feeds the *final* output and LSE, which only the private
``_flash_attn_varlen_backward`` accepts, and its signature is the one that moved:

* 2.6: ``(..., dropout_p, softmax_scale, causal, window_size, softcap,
  alibi_slopes, deterministic, rng_state=None)``, ``window_size`` a tuple;
* 2.7 and 2.8: ``window_size_left, window_size_right`` in place of the tuple
  (2.7.4 appends ``zero_tensors=False``).  From 2.7 the function is a
  ``torch.library.custom_op``, whose ``inspect.signature`` is
  ``(*args, **kwargs)`` -- so the arguments are written from the installed
  ``flash_attn.__version__`` (:func:`backward_args`, the one version shim), all
  positionally, never filtered by introspection.

Below 2.6 the varlen LSE of some code paths is padded (``[b, h, max_s]``), and
releases after 2.8 are unread: both are refused in one line.  The signatures
the shim is checked against are in ``tests/attention/fixtures/flash_attn_signatures.py``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from megatron_zeppelin.attention.backends.base import (BACKEND_FLAGS, FusedKernels, check_fused_input,
                                                        contiguous, release_line)
from megatron_zeppelin.errors import ConfigError

#: The release lines whose signatures the shim writes.
SUPPORTED_LINES = ((2, 6), (2, 7), (2, 8))
SUPPORTED_TEXT = "flash-attn 2.6.x, 2.7.x or 2.8.x"


def _import_flash() -> tuple[str, ModuleType]:
    """``(flash_attn.__version__, flash_attn.flash_attn_interface)``."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError as exc:
        raise ConfigError(f"attention backend 'flash' needs flash-attn ({exc}); install {SUPPORTED_TEXT} "
                          f"with `pip install flash-attn --no-build-isolation` on a CUDA machine, or choose "
                          f"torch_flash, torch or auto ({BACKEND_FLAGS})") from None
    return flash_attn.__version__, flash_attn_interface


def check_release(version: str) -> tuple[int, int]:
    """The release line of ``version``; one-line ConfigError when the shim does not cover it."""
    line = release_line(version)
    if line not in SUPPORTED_LINES:
        why = "its varlen LSE can be padded" if line < SUPPORTED_LINES[0] else "its signatures are not checked"
        raise ConfigError(f"flash-attn {version} is not supported ({why}); install {SUPPORTED_TEXT}, or "
                          f"choose torch_flash, which needs no flash-attn ({BACKEND_FLAGS})")
    return line


def backward_args(line: tuple[int, int], dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
                  scale: float, causal: bool) -> tuple:
    """The positional arguments of ``_flash_attn_varlen_backward`` in release ``line``:
    no dropout, no sliding window, no softcap, no ALiBi, non-deterministic."""
    window = ((-1, -1),) if line == (2, 6) else (-1, -1)
    return (dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, *window,
            0.0, None, False, None)


class FlashBackend(FusedKernels):
    """flash-attn varlen kernels; one block pair is a batch of one sequence."""

    name = "flash"

    def __init__(self) -> None:
        version, self._fa = _import_flash()
        self._line = check_release(version)

    def _check(self, q: torch.Tensor) -> None:
        check_fused_input(self.name, q)

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        self._check(q)
        q, k, v = contiguous(q, k, v)
        out, lse, _ = self._fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
                                                      softmax_scale=scale, causal=causal,
                                                      return_attn_probs=True)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        self._check(q)
        dout, q, k, v, out, lse = contiguous(dout, q, k, v, out, lse.float())
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_varlen_backward(*backward_args(self._line, dout, q, k, v, out, lse, dq, dk, dv,
                                                            cu_q, cu_k, max_q, max_k, scale, causal))
        return dq, dk, dv
