"""The PyTorch backend and the LSE merge against plain autograd attention
(single process; random block shapes with GQA)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.attention.backends import TorchBackend, get_backend
from megatron_zeppelin.attention.merge import update_out_and_lse
from megatron_zeppelin.errors import ConfigError

TOL = dict(atol=1e-5, rtol=1e-5)


def naive(q, k, v, causal, scale):
    """Textbook attention with autograd: softmax(q k^T * scale + mask) v, GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


shapes = st.tuples(st.integers(1, 9), st.integers(1, 9), st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3)]),
                   st.sampled_from([1, 4, 8]), st.booleans(), st.integers(0, 2**16))


def _tensors(tq, tk, hq, hk, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g, dtype=dtype) for n, h in ((tq, hq), (tk, hk), (tk, hk), (tq, hq))]


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_block_forward_backward_match_autograd(shape):
    tq, tk, (hq, hk), d, causal, seed = shape
    if causal:
        tk = tq
    q, k, v, dout = _tensors(tq, tk, hq, hk, d, seed)
    scale = 1 / math.sqrt(d)
    out, lse = TorchBackend().forward(q, k, v, causal=causal, scale=scale)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = naive(qr, kr, vr, causal, scale)
    ref_out.backward(dout)
    torch.testing.assert_close(out, ref_out.detach(), **TOL)
    torch.testing.assert_close(lse, ref_lse.detach(), **TOL)
    assert lse.dtype == torch.float32 and lse.shape == (hq, tq)
    grads = TorchBackend().backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    for g, r in zip(grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(g, r, **TOL)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(1, 6), shapes)
def test_key_blocks_merge_to_the_whole(key_blocks, tq, shape):
    """Split the keys of a query block into pieces (the last one diagonal): the
    merged output/LSE equal attention over all keys, and per-piece backward with
    the final out/LSE sums to the whole gradient."""
    _, _, (hq, hk), d, _, seed = shape
    prefix = sum(key_blocks)
    q, k, v, dout = _tensors(tq, prefix + tq, hq, hk, d, seed)
    scale = 0.3
    be = TorchBackend()
    bounds = [0]
    for n in key_blocks:
        bounds.append(bounds[-1] + n)
    bounds.append(prefix + tq)
    out = lse = None
    for s, e in zip(bounds[:-1], bounds[1:]):
        causal = s == prefix
        bo, bl = be.forward(q, k[s:e], v[s:e], causal=causal, scale=scale)
        out, lse = update_out_and_lse(out, lse, bo, bl)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    # whole reference: query i (position prefix + i) sees keys 0 .. prefix + i
    group = hq // hk
    s_full = torch.einsum("qhd,khd->hqk", qr, kr.repeat_interleave(group, 1)) * scale
    mask = torch.arange(prefix + tq)[None, :] > (prefix + torch.arange(tq))[:, None]
    s_full = s_full.masked_fill(mask, float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s_full, -1), vr.repeat_interleave(group, 1))
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach(), **TOL)
    torch.testing.assert_close(lse, torch.logsumexp(s_full, -1).detach(), **TOL)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for s, e in zip(bounds[:-1], bounds[1:]):
        gq, gk, gv = be.backward(dout, q, k[s:e], v[s:e], out, lse, causal=s == prefix, scale=scale)
        dq += gq
        dk[s:e] += gk
        dv[s:e] += gv
    for g, r in zip((dq, dk, dv), (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(g, r, **TOL)


def test_varlen_packs_independent_sequences():
    lengths = [3, 1, 6, 2]
    cu = torch.tensor([0, 3, 4, 10, 12], dtype=torch.int32)
    q, k, v, dout = _tensors(12, 12, 4, 2, 8, seed=3)
    be = TorchBackend()
    out, lse = be.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=6, scale=0.5)
    grads = be.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=cu, max_seqlen=6, scale=0.5)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        qr, kr, vr = (x[rows].clone().requires_grad_() for x in (q, k, v))
        ref, ref_lse = naive(qr, kr, vr, True, 0.5)
        ref.backward(dout[rows])
        torch.testing.assert_close(out[rows], ref.detach(), **TOL)
        torch.testing.assert_close(lse[:, rows], ref_lse.detach(), **TOL)
        for g, r in zip(grads, (qr.grad, kr.grad, vr.grad)):
            torch.testing.assert_close(g[rows], r, **TOL)
        start += n


def test_bf16_inputs_compute_in_fp32():
    q, k, v, dout = _tensors(7, 7, 2, 1, 8, seed=1)
    out32, lse32 = TorchBackend().forward(q, k, v, causal=True, scale=0.35)
    out16, lse16 = TorchBackend().forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, scale=0.35)
    assert out16.dtype == torch.bfloat16 and lse16.dtype == torch.float32
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse16, lse32, atol=3e-2, rtol=3e-2)


def test_shape_errors_name_the_problem():
    q, k, v, _ = _tensors(4, 5, 3, 2, 8, seed=0)
    with pytest.raises(ConfigError, match="multiple of key/value heads"):
        TorchBackend().forward(q, k, v, causal=False, scale=1.0)
    q, k, v, _ = _tensors(4, 5, 2, 1, 8, seed=0)
    with pytest.raises(ValueError, match="causal block must be square"):
        TorchBackend().forward(q, k, v, causal=True, scale=1.0)


def test_get_backend():
    assert get_backend("torch").name == "torch"
    if not torch.cuda.is_available():
        assert isinstance(get_backend("auto").pick(torch.zeros(1, 1, 1, dtype=torch.bfloat16)), TorchBackend)
    with pytest.raises(ConfigError, match="unknown attention backend 'xla'"):
        get_backend("xla")
    for name, package in (("flash", "flash_attn"), ("te", "transformer_engine")):
        try:
            __import__(package)
        except ImportError:
            with pytest.raises(ConfigError, match=f"attention backend '{name}' needs"):
                get_backend(name)
