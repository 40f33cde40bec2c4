"""flash-attn and TransformerEngine called as each release declares, checked on CPU.

Stand-in modules bind every call to a release's signature, read from its source
(``tests/attention/fixtures``): ``inspect.Signature.bind`` refuses a missing,
extra or misplaced argument.  Then the bound values are checked: the dtypes a
release wants as ``tex.DType`` or ``torch.dtype``, the THD layouts it must be
told, the window shape, and that the LSE reaches the kernel in its layout.
"""

from __future__ import annotations

import enum
import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron_zeppelin.attention.backends import flash as flash_module
from megatron_zeppelin.attention.backends import te as te_module
from megatron_zeppelin.errors import ConfigError
from tests.attention.fixtures import signature
from tests.attention.fixtures.flash_attn_signatures import RELEASES as FLASH_RELEASES, WINDOW_TUPLE
from tests.attention.fixtures.te_signatures import RELEASES as TE_RELEASES, THD_FORMATS

SCALE = 0.3


def _bound(calls: dict, name: str, params: str):
    """A stand-in for ``name`` that binds its call to ``params`` and records the arguments by name."""
    sig = signature(params)

    def kernel(*args, **kwargs):     # what inspect shows for a torch.library.custom_op
        bound = sig.bind(*args, **kwargs)
        calls[name] = bound.arguments
        return bound.arguments
    return kernel


def _packed(hq=4, hk=2, d=8, lengths=(5, 7), dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k, v, dout = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hk, hk, hq))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    lse = torch.randn(hq, t, generator=g)
    return q, k, v, dout, cu, lse


# --- flash-attn -------------------------------------------------------------------------------------------

def fake_flash(version: str, calls: dict):
    spec = FLASH_RELEASES[version]
    forward = _bound(calls, "flash_attn_varlen_func", spec["flash_attn_varlen_func"])

    def varlen_func(*args, **kwargs):
        a = forward(*args, **kwargs)
        return torch.zeros_like(a["q"]), torch.zeros(a["q"].shape[1], a["q"].shape[0]), None

    backward = _bound(calls, "_flash_attn_varlen_backward", spec["_flash_attn_varlen_backward"])
    if not spec["custom_op"]:
        backward.__signature__ = signature(spec["_flash_attn_varlen_backward"])
    return version, SimpleNamespace(flash_attn_varlen_func=varlen_func, _flash_attn_varlen_backward=backward)


@pytest.mark.parametrize("version", [v for v in FLASH_RELEASES if v != "2.5.9"])
def test_flash_calls_bind_to_each_release(version, monkeypatch):
    calls: dict = {}
    monkeypatch.setattr(flash_module, "_import_flash", lambda: fake_flash(version, calls))
    monkeypatch.setattr(flash_module.FlashBackend, "_check", lambda self, q: None)
    backend = flash_module.FlashBackend()
    q, k, v, dout, cu, lse = _packed()
    out, got_lse = backend.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=7, scale=SCALE, lengths=(5, 7))
    fwd = calls["flash_attn_varlen_func"]
    assert fwd["cu_seqlens_q"] is cu and fwd["cu_seqlens_k"] is cu
    assert (fwd["max_seqlen_q"], fwd["max_seqlen_k"], fwd["dropout_p"]) == (7, 7, 0.0)
    assert fwd["softmax_scale"] == SCALE and fwd["causal"] is True and fwd["return_attn_probs"] is True
    assert got_lse.shape == (4, 12) and got_lse.dtype == torch.float32

    dq, dk, dv = backend.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=cu, max_seqlen=7, scale=SCALE)
    bwd = calls["_flash_attn_varlen_backward"]
    assert bwd["softmax_lse"] is lse and bwd["out"] is out and bwd["dout"] is dout
    assert bwd["dq"] is dq and bwd["dk"] is dk and bwd["dv"] is dv
    assert (bwd["dropout_p"], bwd["softmax_scale"], bwd["causal"]) == (0.0, SCALE, True)
    assert (bwd["softcap"], bwd["alibi_slopes"], bwd["deterministic"], bwd["rng_state"]) == (0.0, None, False, None)
    if version in WINDOW_TUPLE:
        assert bwd["window_size"] == (-1, -1)
    else:
        assert (bwd["window_size_left"], bwd["window_size_right"]) == (-1, -1)
        # a custom_op hides its parameters: a filter by inspect.signature would pass nothing
        assert list(inspect.signature(backend._fa._flash_attn_varlen_backward).parameters) == ["args", "kwargs"]

    backend.forward(q, k[:5], v[:5], causal=False, scale=SCALE)     # one block pair, tq != tk
    fwd = calls["flash_attn_varlen_func"]
    assert fwd["cu_seqlens_q"].tolist() == [0, 12] and fwd["cu_seqlens_k"].tolist() == [0, 5]
    assert (fwd["max_seqlen_q"], fwd["max_seqlen_k"], fwd["causal"]) == (12, 5, False)


@pytest.mark.parametrize("version", ["2.5.9", "2.3.6", "2.9.0", "3.0.0b1"])
def test_flash_release_outside_the_shim_is_refused_in_one_line(version, monkeypatch):
    monkeypatch.setattr(flash_module, "_import_flash", lambda: (version, SimpleNamespace()))
    with pytest.raises(ConfigError, match=r"2\.6\.x, 2\.7\.x or 2\.8\.x") as err:
        flash_module.FlashBackend()
    assert "\n" not in str(err.value) and version in str(err.value)


# --- TransformerEngine ------------------------------------------------------------------------------------

class TexDType(enum.Enum):
    """Stands in for ``transformer_engine_torch.DType``."""
    kFloat16 = 2
    kBFloat16 = 3
    kFloat32 = 4


TE_DTYPE = {torch.float16: TexDType.kFloat16, torch.bfloat16: TexDType.kBFloat16, torch.float32: TexDType.kFloat32}


def _te_stats(lse: torch.Tensor, cu: torch.Tensor, packed: bool) -> torch.Tensor:
    """What cuDNN writes for ``lse [h, t]``, built by a plain loop (independent of the backend's indexing)."""
    if packed:
        return lse.t().unsqueeze(-1).clone()
    bounds = cu.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    stats = torch.full((len(lengths), lse.shape[0], max(lengths), 1), float("nan"))
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        stats[i, :, :e - s, 0] = lse[:, s:e]
    return stats


def fake_te(version: str, calls: dict, packed: bool, fwd_lse: torch.Tensor) -> te_module.TeInstall:
    spec = TE_RELEASES[version]
    fwd = _bound(calls, "fused_attn_fwd", spec["fused_attn_fwd"])
    bwd = _bound(calls, "fused_attn_bwd", spec["fused_attn_bwd"])

    def fused_attn_fwd(*args, **kwargs):
        a = fwd(*args, **kwargs)
        return torch.zeros_like(a["q"]), [_te_stats(fwd_lse, a["cu_seqlens_q"], packed), torch.zeros(2)]

    def fused_attn_bwd(*args, **kwargs):
        a = bwd(*args, **kwargs)
        return torch.zeros_like(a["q"]), torch.zeros_like(a["k"]), torch.zeros_like(a["v"]), None

    module = SimpleNamespace(fused_attn_fwd=fused_attn_fwd, fused_attn_bwd=fused_attn_bwd,
                             FusedAttnBackend={"F16_arbitrary_seqlen": "F16_arbitrary_seqlen"})
    return te_module.TeInstall(version + ".0", module, TE_DTYPE, packed)


def _te_cases():
    for version, spec in TE_RELEASES.items():
        yield version, False                               # cuDNN < 9.6: padded stats on every release
        if spec["packed_stats_possible"]:
            yield version, True


@pytest.mark.parametrize("version,packed", list(_te_cases()))
def test_te_calls_bind_to_each_release(version, packed, monkeypatch):
    calls: dict = {}
    q, k, v, dout, cu, lse = _packed(lengths=(5, 1, 6))
    monkeypatch.setattr(te_module, "_import_te", lambda: fake_te(version, calls, packed, lse))
    monkeypatch.setattr(te_module.TeBackend, "_check", lambda self, q: None)
    backend = te_module.TeBackend()
    spec = TE_RELEASES[version]
    formats = THD_FORMATS.get(version, {"fwd": {}, "bwd": {}})

    out, got_lse = backend.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=6, scale=SCALE, lengths=(5, 1, 6))
    torch.testing.assert_close(got_lse, lse, rtol=0, atol=0)   # both stats layouts back to [h, t]
    backend.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=cu, max_seqlen=6, scale=SCALE)

    for name, direction in (("fused_attn_fwd", "fwd"), ("fused_attn_bwd", "bwd")):
        a = calls[name]
        assert a["cu_seqlens_q"] is cu and a["cu_seqlens_q_padded"] is cu and a["cu_seqlens_kv_padded"] is cu
        assert (a["max_seqlen_q"], a["max_seqlen_kv"], a["attn_scale"], a["dropout"]) == (6, 6, SCALE, 0.0)
        assert (a["qkv_layout"], a["attn_mask_type"], a["window_size"]) == ("thd_thd_thd", "padding_causal", (-1, 0))
        assert a["fused_attention_backend"] == "F16_arbitrary_seqlen"
        for param in spec["tex_dtype"] & set(a):
            assert a[param] is TexDType.kBFloat16, f"{version} {name}: {param} must be a tex.DType"
        for param in spec["torch_dtype"] & set(a):
            assert a[param] is torch.bfloat16, f"{version} {name}: {param} must be a torch.dtype"
        for param, value in formats[direction].items():
            assert a[param] == value, f"{version} {name}: {param} must be {value!r} for THD"
    stats, rng_state = calls["fused_attn_bwd"]["aux_ctx_tensors"]
    want = _te_stats(lse, cu, packed)
    assert stats.shape == want.shape and rng_state.shape == (2,)
    rows = ~want.isnan()                                       # padded slots carry nothing
    torch.testing.assert_close(stats[rows], want[rows], rtol=0, atol=0)


@pytest.mark.parametrize("version", ["1.11.0", "0.9.0"])
def test_te_release_below_1_12_is_refused_in_one_line(version, monkeypatch):
    install = te_module.TeInstall(version, SimpleNamespace(FusedAttnBackend={}), TE_DTYPE, False)
    monkeypatch.setattr(te_module, "_import_te", lambda: install)
    with pytest.raises(ConfigError, match="1.12-1.13, 2.0-2.14 or 2.15 and later") as err:
        te_module.TeBackend()
    assert "\n" not in str(err.value) and version in str(err.value)
