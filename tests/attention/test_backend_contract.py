"""What every backend hands its kernels, checked on CPU with stand-in kernel modules.

Fused kernels read ``data_ptr()`` and the shape and ignore strides, and size their
launches from host ints.  The stand-ins record what they receive: contiguous
tensors only, and ``max_seqlen`` as the caller's host int.  Nothing in a backend
may read a tensor back to the host or copy a host list to the device (each is a
stream sync on CUDA): :class:`NoHostSync` fails any such call.  ``auto`` must
never send fp32 or CPU tensors to a fused kernel.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_zeppelin.attention.backends import AutoBackend, TorchBackend, get_backend
from megatron_zeppelin.attention.backends import flash as flash_module
from megatron_zeppelin.attention.backends import te as te_module
from megatron_zeppelin.attention.backends import torch_flash as torch_flash_module
from megatron_zeppelin.errors import ConfigError

#: Tensor calls that wait for the device, or copy host data to it.
SYNCING = {"tolist", "item", "cpu", "numpy", "tensor", "nonzero", "__bool__", "__int__", "__index__",
           "__float__"}


class NoHostSync(TorchFunctionMode):
    """Fails a call that would stall a CUDA stream (on CPU tensors too, so CPU CI sees it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        tensor_repeats = name == "repeat_interleave" and isinstance(repeats, torch.Tensor)
        if name in SYNCING or (tensor_repeats and kwargs.get("output_size") is None):
            raise AssertionError(f"host sync in a backend: {name}")
        return func(*args, **kwargs)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def record(self, kernel: str, **tensors_and_ints) -> None:
        self.calls.append((kernel, tensors_and_ints))

    def assert_clean(self) -> None:
        assert self.calls
        for kernel, values in self.calls:
            for name, value in values.items():
                if name.startswith("max_"):
                    assert type(value) is int, f"{kernel}: {name} is {type(value).__name__}, not a host int"
                elif isinstance(value, torch.Tensor) and not name.startswith("cu_"):
                    assert value.is_contiguous(), f"{kernel}: {name} is a strided view"


def fake_flash(rec: Recorder) -> tuple[str, SimpleNamespace]:
    def varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, return_attn_probs):
        rec.record("flash_fwd", q=q, k=k, v=v, max_q=max_q, max_k=max_k)
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), None

    def varlen_backward(*args):
        dout, q, k, v, out, lse = args[:6]
        rec.record("flash_bwd", dout=dout, q=q, k=k, v=v, out=out, lse=lse, max_q=args[11], max_k=args[12])

    return "2.8.3", SimpleNamespace(flash_attn_varlen_func=varlen_func, _flash_attn_varlen_backward=varlen_backward)


def fake_te(rec: Recorder) -> te_module.TeInstall:
    def fwd(is_training, max_q, max_k, cu_q, cu_k, q, k, v, fake_dtype, backend, **_):
        rec.record("te_fwd", q=q, k=k, v=v, max_q=max_q, max_k=max_k)
        return torch.zeros_like(q), [torch.zeros(q.shape[0], q.shape[1], 1), torch.zeros(2)]

    def bwd(max_q, max_k, cu_q, cu_k, q, k, v, o, d_o, fake_dtype, aux, backend, **_):
        rec.record("te_bwd", q=q, k=k, v=v, o=o, d_o=d_o, stats=aux[0], max_q=max_q, max_k=max_k)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    fused_attn = SimpleNamespace(fused_attn_fwd=fwd, fused_attn_bwd=bwd,
                                 FusedAttnBackend={"F16_arbitrary_seqlen": "arbitrary"})
    return te_module.TeInstall("2.18.0", fused_attn, {}, packed_stats=True)


def fake_aten(rec: Recorder) -> SimpleNamespace:
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale):
        rec.record("aten_fwd", q=q, k=k, v=v, max_q=max_q, max_k=max_k)
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), None, None, None

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *, scale):
        rec.record("aten_bwd", dout=dout, q=q, k=k, v=v, out=out, lse=lse, max_q=max_q, max_k=max_k)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    return SimpleNamespace(forward=forward, backward=backward)


@pytest.fixture(params=["torch_flash", "flash", "te"])
def fused(request, monkeypatch):
    """A fused backend over recording stand-ins (dtype/device checks off: the
    stand-ins run on CPU)."""
    rec = Recorder()
    if request.param == "torch_flash":
        monkeypatch.setattr(torch_flash_module.TorchFlashBackend, "_check", lambda self, q: None)
        return torch_flash_module.TorchFlashBackend(ops=fake_aten(rec)), rec
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
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = torch.randn(12, 4, 16)[..., :8]                      # strided, as the engine's slices can be
    lse = torch.randn(12, 4).t()                               # [h, t] view of a [t, h] buffer
    with NoHostSync():
        backend.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=7, scale=0.3, lengths=(5, 7))
        backend.varlen_backward(out, q, k, v, out, lse, cu_seqlens=cu, max_seqlen=7, scale=0.3, lengths=(5, 7))
    rec.assert_clean()
    assert {v for _, values in rec.calls for n, v in values.items() if n.startswith("max_")} == {7}


def test_block_kernels_get_contiguous_tensors(fused):
    """The ring's and Ulysses' per-block calls: a head split is a strided view."""
    backend, rec = fused
    x = torch.randn(6, 8, 8)
    q, k, v = x[:, 0:4], x[:, 4:6], x[:, 6:8]                  # heads split out of one buffer
    with NoHostSync():
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


def test_torch_kernels_loop_on_host_lengths_without_reading_cu_seqlens():
    """With ``lengths`` the loop never touches ``cu_seqlens`` (a device tensor on a
    GPU; here one on the meta device, which cannot be read at all), and gives
    exactly what bounds read from a CPU ``cu_seqlens`` give."""
    q, k, v = (x.contiguous() for x in strided_qkv())
    dout = torch.randn_like(q)
    be = TorchBackend()
    device_cu = torch.empty(3, dtype=torch.int32, device="meta")
    host_cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with NoHostSync():
        out, lse = be.varlen_forward(q, k, v, cu_seqlens=device_cu, max_seqlen=7, scale=0.3, lengths=(5, 7))
        grads = be.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=device_cu, max_seqlen=7, scale=0.3,
                                   lengths=(5, 7))
    want_out, want_lse = be.varlen_forward(q, k, v, cu_seqlens=host_cu, max_seqlen=7, scale=0.3)
    want_grads = be.varlen_backward(dout, q, k, v, want_out, want_lse, cu_seqlens=host_cu, max_seqlen=7,
                                    scale=0.3)
    for g, w in zip((out, lse, *grads), (want_out, want_lse, *want_grads)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="needs the host lengths too"):
        be.varlen_forward(q, k, v, cu_seqlens=device_cu, max_seqlen=7, scale=0.3)


def test_auto_picks_torch_flash_for_half_cuda_and_torch_otherwise(monkeypatch):
    """On a CUDA machine ``auto`` holds torch's flash kernels (never flash-attn or
    TE, which run only when named) and still runs fp32 / CPU calls on the torch
    kernels, which the fused ones would refuse."""
    rec = Recorder()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch_flash_module, "aten_flash_ops", lambda: fake_aten(rec))
    monkeypatch.setattr(flash_module, "_import_flash", lambda: pytest.fail("auto imported flash-attn"))
    monkeypatch.setattr(te_module, "_import_te", lambda: pytest.fail("auto imported TransformerEngine"))
    auto = get_backend("auto")
    assert isinstance(auto, AutoBackend) and isinstance(auto.fused, torch_flash_module.TorchFlashBackend)
    q, k, v = (x.contiguous() for x in strided_qkv())
    cu = torch.tensor([0, 12], dtype=torch.int32)
    out, lse = auto.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=12, scale=0.3)
    want, want_lse = TorchBackend().varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=12, scale=0.3)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert not rec.calls  # the fused kernels never saw the fp32 call
    assert auto.pick(torch.zeros(2, 1, 8, dtype=torch.bfloat16)) is auto.torch  # nor a CPU one
    half_cuda = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert auto.pick(half_cuda) is auto.fused


def test_every_flag_offers_every_backend():
    from megatron_zeppelin.attention.backends import BACKENDS
    from megatron_zeppelin.integration.args import BACKENDS as MEGATRON_FLAG
    from megatron_zeppelin.train.cli import build_parser
    trainer_flag = next(a for a in build_parser()._actions if a.dest == "backend")
    assert MEGATRON_FLAG == BACKENDS == tuple(trainer_flag.choices)
    assert "torch_flash" in trainer_flag.help
