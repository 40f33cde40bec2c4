"""What every backend hands its kernels, checked on CPU with stand-in kernel modules.

flash-attn's and TransformerEngine's kernels read ``data_ptr()`` and the shape and
ignore strides, and size their launches from host ints.  The stand-ins record
what they receive: contiguous tensors only, and ``max_seqlen`` as the caller's
host int, never read back from the device (``cu_seqlens`` here refuses to be read
on the host at all).  ``auto`` must never send fp32 or CPU tensors to them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_zeppelin.attention.backends import AutoBackend, TorchBackend, get_backend
from megatron_zeppelin.attention.backends import flash as flash_module
from megatron_zeppelin.attention.backends import te as te_module


class DeviceOnly(torch.Tensor):
    """A ``cu_seqlens`` that fails any host read (what would stall a CUDA stream)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__index__", "max"):
            raise AssertionError(f"host read of cu_seqlens: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _cu(*bounds: int) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int32).as_subclass(DeviceOnly)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def record(self, kernel: str, **tensors_and_ints) -> None:
        self.calls.append((kernel, tensors_and_ints))

    def assert_clean(self) -> None:
        assert self.calls
        for kernel, values in self.calls:
            for name, value in values.items():
                if name.startswith("max_seqlen"):
                    assert type(value) is int, f"{kernel}: {name} is {type(value).__name__}, not a host int"
                elif isinstance(value, torch.Tensor) and not name.startswith("cu_"):
                    assert value.is_contiguous(), f"{kernel}: {name} is a strided view"


def fake_flash(rec: Recorder) -> SimpleNamespace:
    def varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, return_attn_probs):
        rec.record("flash_fwd", q=q, k=k, v=v, max_seqlen_q=max_q, max_seqlen_k=max_k)
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), None

    def varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                        softcap, alibi_slopes, deterministic, rng_state):
        rec.record("flash_bwd", dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)

    return SimpleNamespace(flash_attn_varlen_func=varlen_func, _flash_attn_varlen_backward=varlen_backward)


def fake_te(rec: Recorder) -> SimpleNamespace:
    def fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
            fused_attention_backend, **_):
        rec.record("te_fwd", q=q, k=k, v=v, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv)
        return torch.zeros_like(q), [torch.zeros(q.shape[0], q.shape[1], 1)]

    def bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, dqkv_dtype,
            aux_ctx_tensors, fused_attention_backend, **_):
        rec.record("te_bwd", q=q, k=k, v=v, o=o, d_o=d_o, max_seqlen_q=max_seqlen_q,
                   max_seqlen_kv=max_seqlen_kv)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    return SimpleNamespace(fused_attn_fwd=fwd, fused_attn_bwd=bwd,
                           FusedAttnBackend={"F16_arbitrary_seqlen": "arbitrary"})


@pytest.fixture(params=["flash", "te"])
def fused(request, monkeypatch):
    """A FlashBackend / TeBackend over recording stand-ins (dtype/device checks off:
    the stand-ins run on CPU)."""
    rec = Recorder()
    if request.param == "flash":
        monkeypatch.setattr(flash_module, "_import_flash", lambda: fake_flash(rec))
        monkeypatch.setattr(flash_module.FlashBackend, "_check", lambda self, q: None)
        return flash_module.FlashBackend(), rec
    monkeypatch.setattr(te_module, "_import_te", lambda: fake_te(rec))
    monkeypatch.setattr(te_module.TeBackend, "_check", lambda self, q: None)
    return te_module.TeBackend(), rec


def strided_qkv(t: int = 12, heads: int = 4, d: int = 8):
    """q, k, v as Megatron hands them over: views of one fused QKV projection."""
    qkv = torch.randn(t, 3, heads, d)
    return qkv.unbind(1)


def test_varlen_kernels_get_contiguous_tensors_and_host_lengths(fused):
    backend, rec = fused
    q, k, v = strided_qkv()
    assert not q.is_contiguous()
    backend.varlen_forward(q, k, v, cu_seqlens=_cu(0, 5, 12), max_seqlen=7, scale=0.3)
    out = torch.randn(12, 4, 16)[..., :8]                      # strided, as the engine's slices can be
    lse = torch.randn(12, 4).t()                               # [h, t] view of a [t, h] buffer
    backend.varlen_backward(out, q, k, v, out, lse, cu_seqlens=_cu(0, 5, 12), max_seqlen=7, scale=0.3)
    rec.assert_clean()
    assert {v for _, values in rec.calls for n, v in values.items() if n.startswith("max_seqlen")} == {7}


def test_block_kernels_get_contiguous_tensors(fused):
    """The ring's and Ulysses' per-block calls: a head split is a strided view."""
    backend, rec = fused
    x = torch.randn(6, 8, 8)
    q, k, v = x[:, 0:4], x[:, 4:6], x[:, 6:8]                  # heads split out of one buffer
    out, lse = backend.forward(q, k, v, causal=True, scale=0.3)
    backend.backward(q, q, k, v, out, lse, causal=True, scale=0.3)
    rec.assert_clean()


def test_torch_kernels_take_strided_views():
    q, k, v = strided_qkv()
    be = TorchBackend()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = be.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=7, scale=0.3)
    want = be.varlen_forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens=cu, max_seqlen=7,
                             scale=0.3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_auto_never_hands_fp32_to_a_fused_kernel(monkeypatch):
    """On a CUDA machine with flash-attn installed, ``auto`` used to return the
    flash backend itself, which refuses fp32; now fp32 runs on the torch kernels."""
    rec = Recorder()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash_module, "_import_flash", lambda: fake_flash(rec))
    auto = get_backend("auto")
    assert isinstance(auto, AutoBackend) and isinstance(auto.fused, flash_module.FlashBackend)
    q, k, v = (x.contiguous() for x in strided_qkv())
    out, lse = auto.varlen_forward(q, k, v, cu_seqlens=torch.tensor([0, 12], dtype=torch.int32), max_seqlen=12,
                                   scale=0.3)
    want, want_lse = TorchBackend().varlen_forward(q, k, v, cu_seqlens=torch.tensor([0, 12], dtype=torch.int32),
                                                   max_seqlen=12, scale=0.3)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert not rec.calls  # the fused kernels never saw the fp32 call
    half = torch.zeros(2, 1, 8, dtype=torch.bfloat16)
    assert auto.pick(half) is auto.torch  # CPU tensors stay on the torch kernels too
