"""flash-attn and TransformerEngine backends against the PyTorch backend on CUDA
(bf16 in, fp32 reference on the same bf16 values).  Skipped without CUDA or
without the package."""

from __future__ import annotations

import pytest
import torch

from megatron_zeppelin.attention import get_backend, plan_attention
from megatron_zeppelin.attention.backends import TorchBackend
from megatron_zeppelin.attention.merge import update_out_and_lse
from megatron_zeppelin.plan import Mode, placement
from tests.attention.helpers import make_plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(params=["flash", "te"])
def backend(request):
    pytest.importorskip({"flash": "flash_attn", "te": "transformer_engine"}[request.param])
    return get_backend(request.param)


def _tensors(tq, tk, hq, hk, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(n, h, d, generator=g, device="cuda").bfloat16()
            for n, h in ((tq, hq), (tk, hk), (tk, hk), (tq, hq))]


@pytest.mark.parametrize("causal,tq,tk", [(True, 129, 129), (False, 64, 200), (False, 200, 31)])
@pytest.mark.parametrize("hq,hk", [(8, 8), (8, 2)])
def test_block_matches_torch(backend, causal, tq, tk, hq, hk):
    q, k, v, dout = _tensors(tq, tk, hq, hk, 64, seed=tq + tk + hk)
    ref = TorchBackend()
    out, lse = backend.forward(q, k, v, causal=causal, scale=0.125)
    ref_out, ref_lse = ref.forward(q, k, v, causal=causal, scale=0.125)
    assert lse.shape == (hq, tq) and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), **BF16_TOL)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    grads = backend.backward(dout, q, k, v, out, lse, causal=causal, scale=0.125)
    ref_grads = ref.backward(dout, q, k, v, out, lse, causal=causal, scale=0.125)
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        torch.testing.assert_close(g.float(), r.float(), **BF16_TOL)


def test_merged_blocks_backward_with_final_lse(backend):
    """Two key blocks merged by LSE, backward per block against the final out/LSE
    (the ring's use): gradients match the torch backend's."""
    q, k, v, dout = _tensors(96, 192, 8, 4, 64, seed=11)
    blocks = [(slice(0, 96), False), (slice(96, 192), True)]
    results = []
    for be in (backend, TorchBackend()):
        out = lse = None
        for ks, causal in blocks:
            bo, bl = be.forward(q, k[ks], v[ks], causal=causal, scale=0.125)
            out, lse = update_out_and_lse(out, lse, bo, bl)
        out = out.bfloat16()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros(k.shape, device="cuda")
        dv = torch.zeros(v.shape, device="cuda")
        for ks, causal in blocks:
            gq, gk, gv = be.backward(dout, q, k[ks], v[ks], out, lse, causal=causal, scale=0.125)
            dq += gq.float()
            dk[ks] += gk.float()
            dv[ks] += gv.float()
        results.append((out.float(), dq, dk, dv))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **BF16_TOL)


def test_varlen_matches_torch(backend):
    cu = torch.tensor([0, 17, 18, 150, 200], dtype=torch.int32, device="cuda")
    q, k, v, dout = _tensors(200, 200, 8, 2, 64, seed=5)
    lens = dict(cu_seqlens=cu, max_seqlen=132, scale=0.125)
    out, lse = backend.varlen_forward(q, k, v, **lens)
    ref_out, ref_lse = TorchBackend().varlen_forward(q, k, v, **lens)
    torch.testing.assert_close(out.float(), ref_out.float(), **BF16_TOL)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    grads = backend.varlen_backward(dout, q, k, v, out, lse, **lens)
    ref_grads = TorchBackend().varlen_backward(dout, q, k, v, out, lse, **lens)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), **BF16_TOL)


def test_strided_views_give_the_contiguous_result(backend):
    """Megatron's q/k/v are views of one fused QKV projection, and a Ulysses head
    split or a lone local piece is a strided view too: a kernel reading raw
    pointers would compute on the wrong rows."""
    cu = torch.tensor([0, 40, 100], dtype=torch.int32, device="cuda")
    qkv = torch.randn(100, 3, 4, 64, device="cuda").bfloat16()
    q, k, v = qkv.unbind(1)                                    # [t, 4, 64] each, strided
    assert not q.is_contiguous()
    lens = dict(cu_seqlens=cu, max_seqlen=60, scale=0.125)
    out, lse = backend.varlen_forward(q, k, v, **lens)
    want, want_lse = backend.varlen_forward(q.contiguous(), k.contiguous(), v.contiguous(), **lens)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_auto_runs_fp32_on_the_torch_kernels():
    q, k, v, _ = (x.float() for x in _tensors(50, 50, 4, 4, 32, seed=9))
    auto = get_backend("auto")
    out, lse = auto.forward(q, k, v, causal=True, scale=0.2)   # flash-attn would refuse fp32
    want, want_lse = TorchBackend().forward(q, k, v, causal=True, scale=0.2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


class _NoComm:
    """A one-rank plan of local sequences never starts a round."""

    counters = None

    def start_round(self, messages, sends, recvs, *, routed=True):
        raise AssertionError("a local-only plan must not communicate")


def test_engine_local_plan_on_gpu(backend):
    lens = [37, 5, 120]
    plan = make_plan(1, 1, lens, [placement(i, L, Mode.LOCAL, [0]) for i, L in enumerate(lens)])
    q, k, v, dout = _tensors(sum(lens), sum(lens), 8, 4, 64, seed=2)
    results = []
    for be in (backend, TorchBackend()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = plan_attention(*leaves, plan=plan, rank=0, comm=_NoComm(), backend=be)
        out.backward(dout)
        results.append([out.detach().float()] + [x.grad.float() for x in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **BF16_TOL)
