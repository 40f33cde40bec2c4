"""The torch_flash backend's calls into torch's FlashAttention aten ops, checked on CPU.

CPU torch cannot run the flash kernels, so a fake op table stands in for
``aten::_flash_attention_forward/_backward``: it binds each call to the op's
schema -- the installed torch's own and the releases in
``tests/attention/fixtures/torch_flash_schemas.py`` -- and records it.  The
numbers are checked against the torch kernels on a GPU (test_gpu_backends.py).
"""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

import pytest
import torch

from megatron_zeppelin.attention.backends import get_backend
from megatron_zeppelin.attention.backends import torch_flash as torch_flash_module
from megatron_zeppelin.attention.backends.torch_flash import TorchFlashBackend, activate_fa3
from megatron_zeppelin.errors import ConfigError
from tests.attention.fixtures.torch_flash_schemas import BACKWARD, FORWARD

SCALE = 0.25


def _signature(schema) -> inspect.Signature:
    """An aten schema as an ``inspect.Signature`` (keyword-only after ``*``)."""
    kind = inspect.Parameter
    return inspect.Signature([
        kind(a.name, kind.KEYWORD_ONLY if a.kwarg_only else kind.POSITIONAL_OR_KEYWORD,
             default=None if a.has_default_value() else kind.empty) for a in schema.arguments])


FORWARD_SCHEMAS = [torch.ops.aten._flash_attention_forward.default._schema,
                   *(torch._C.parse_schema(text) for text in FORWARD.values())]
BACKWARD_SCHEMAS = [torch.ops.aten._flash_attention_backward.default._schema,
                    *(torch._C.parse_schema(text) for text in BACKWARD.values())]


class FakeAten:
    """Records every call after binding it to every known schema of the op."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.returned: list[tuple] = []

    def forward(self, *args, **kwargs):
        for schema in FORWARD_SCHEMAS:
            _signature(schema).bind(*args, **kwargs)
        self.calls.append(("forward", args, kwargs))
        q = args[0]
        result = (torch.randn_like(q), torch.randn(q.shape[1], q.shape[0]), torch.zeros(2), torch.zeros(()), None)
        self.returned.append(result)
        return result

    def backward(self, *args, **kwargs):
        for schema in BACKWARD_SCHEMAS:
            _signature(schema).bind(*args, **kwargs)
        self.calls.append(("backward", args, kwargs))
        return tuple(torch.zeros_like(t) for t in args[1:4])


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(TorchFlashBackend, "_check", lambda self, q: None)   # CPU stand-in tensors
    fake = FakeAten()
    return TorchFlashBackend(ops=SimpleNamespace(forward=fake.forward, backward=fake.backward)), fake


def _qkv(t=12, tk=None, hq=8, hk=2, d=16):
    g = torch.Generator().manual_seed(1)
    tk = t if tk is None else tk
    return [torch.randn(n, h, d, generator=g).bfloat16() for n, h in ((t, hq), (tk, hk), (tk, hk), (t, hq))]


def test_varlen_call_is_the_aten_schema_with_the_callers_offsets(backend):
    be, fake = backend
    q, k, v, dout = _qkv()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out, lse = be.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=7, scale=SCALE, lengths=(5, 7))
    kind, args, kwargs = fake.calls[-1]
    assert kind == "forward" and len(args) == 10 and kwargs == {"scale": SCALE}
    assert args[0] is q and args[1] is k and args[2] is v                 # GQA 8/2 goes in unrepeated
    assert args[3] is cu and args[4] is cu                                  # the device offsets, no copy
    assert args[5:] == (7, 7, 0.0, True, False)                             # max_q, max_k, dropout, causal, debug
    assert out is fake.returned[-1][0] and lse is fake.returned[-1][1]      # [hq, t] fp32, no conversion

    dq, dk, dv = be.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=cu, max_seqlen=7, scale=SCALE)
    kind, args, kwargs = fake.calls[-1]
    assert kind == "backward" and len(args) == 14 and kwargs == {"scale": SCALE}
    assert args[0] is dout and args[1] is q and args[2] is k and args[3] is v
    assert args[4] is out and args[5] is lse                                # the forward's out and logsumexp
    assert args[6] is cu and args[7] is cu and args[8:12] == (7, 7, 0.0, True)
    rng_state, unused = args[12:14]
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,) and unused.shape == ()
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    be.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=cu, max_seqlen=7, scale=SCALE)
    assert fake.calls[-1][1][12] is rng_state                               # made once per device


def test_block_call_builds_its_offsets_on_the_device(backend):
    """tq != tk non-causal (an earlier key chunk of the ring), then the square diagonal."""
    be, fake = backend
    q, k, v, dout = _qkv(t=6, tk=10)
    out, lse = be.forward(q, k, v, causal=False, scale=SCALE)
    args = fake.calls[-1][1]
    cu_q, cu_k = args[3], args[4]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.tolist() == [0, 6] and cu_k.tolist() == [0, 10]
    assert args[5:] == (6, 10, 0.0, False, False)
    be.backward(dout, q, k, v, out, lse.t().contiguous().t(), causal=False, scale=SCALE)   # a strided LSE view
    args = fake.calls[-1][1]
    assert args[6].tolist() == [0, 6] and args[7].tolist() == [0, 10]       # rebuilt on the current stream
    assert args[5].is_contiguous() and args[5].dtype == torch.float32 and args[8:12] == (6, 10, 0.0, False)
    be.forward(q, q[:, :2], q[:, 2:4], causal=True, scale=SCALE)
    args = fake.calls[-1][1]
    assert args[3] is args[4] and args[3].tolist() == [0, 6] and args[8] is True


def test_on_cpu_torch_flash_refuses_in_one_clear_line():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(ConfigError, match="'torch_flash' needs CUDA fp16/bf16"):
        get_backend("torch_flash")
    q, k, v, _ = _qkv()
    be = TorchFlashBackend(ops=SimpleNamespace(forward=None, backward=None))
    with pytest.raises(ConfigError, match="'torch_flash' needs fp16/bf16 CUDA tensors"):
        be.forward(q, k, v, causal=False, scale=SCALE)


def _attention(current=None, raises=None):
    calls = []

    def activate(impl):
        calls.append(impl)
        if raises is not None:
            raise raises
    return SimpleNamespace(activate_flash_attention_impl=activate, current_flash_attention_impl=lambda: current), calls


def test_fa3_is_activated_on_hopper_only_when_it_can_be(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    attention, calls = _attention(raises=ModuleNotFoundError("No module named 'flash_attn_interface'"))
    with caplog.at_level(logging.DEBUG, logger=torch_flash_module.__name__):
        assert activate_fa3(attention, torch.device("cpu")) is False       # stays on FA2
    assert calls == ["FA3"]
    assert [r.levelno for r in caplog.records] == [logging.DEBUG] and "flash_attn_interface" in caplog.text
    attention, calls = _attention()
    assert activate_fa3(attention, torch.device("cpu")) is True and calls == ["FA3"]
    attention, calls = _attention(current="FA4")                            # the user's choice stands
    assert activate_fa3(attention, torch.device("cpu")) is False and calls == []
    assert activate_fa3(SimpleNamespace(), torch.device("cpu")) is False   # a torch without the registry
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    attention, calls = _attention()
    assert activate_fa3(attention, torch.device("cpu")) is False and calls == []
