"""torch_flash, flash-attn and TransformerEngine backends against the PyTorch backend
on CUDA (bf16 in, fp32 reference on the same bf16 values).  Skipped without CUDA
or without the package (torch_flash needs none).

Tolerances: bf16 keeps 8 significant bits (a rounding step of 2**-8 = 0.4 % of
the value), the fused kernels round P to bf16 before P @ V and sum in another
order, so errors grow with the magnitude of the tensor compared: ``BF16_TOL``
(2e-2 absolute and relative) on unit-scale values, and :func:`assert_bf16_close`
-- max abs error <= 2e-2 x max(1, max |reference|) -- where gradients summed over
many rows or a GQA group grow past 1 (the H200 run of 2026-11-26 measured 0.009
on out and 0.013 / 0.023 / 0.038 on dq / dk / dv against fp32 at 4K+ tokens)."""

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


@pytest.fixture(params=["torch_flash", "flash", "te"])
def backend(request):
    if request.param != "torch_flash":
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
    lens = dict(cu_seqlens=cu, max_seqlen=132, scale=0.125, lengths=(17, 1, 132, 50))
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


# --- torch_flash (PyTorch's own FlashAttention) at model sizes: d = 128, GQA 32/8 and MHA ---------------

def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Max abs error <= 2e-2 x max(1, max |want|) (see the module docstring)."""
    bound = 2e-2 * max(1.0, want.float().abs().max().item())
    err = (got.float() - want.float()).abs().max().item()
    assert err <= bound, f"{what}: max abs error {err:.4g} > {bound:.4g}"


@pytest.fixture
def torch_flash():
    """torch's own kernels, which ``auto`` picks for bf16 CUDA tensors."""
    backend = get_backend("torch_flash")
    auto = get_backend("auto")
    assert type(auto.pick(torch.zeros(1, 1, 8, device="cuda", dtype=torch.bfloat16))) is type(backend)
    return backend


@pytest.mark.parametrize("hq,hk", [(32, 8), (8, 8)])
def test_torch_flash_varlen_pack_matches_torch(torch_flash, hq, hk):
    """A mixed pack (a 1-token document, lengths off every tile size), forward and
    backward, against the torch kernels on the same bf16 values and the same final
    out / LSE."""
    lengths = (1, 17, 128, 300, 63)
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    q, k, v, dout = _tensors(bounds[-1], bounds[-1], hq, hk, 128, seed=hq + hk)
    lens = dict(cu_seqlens=cu, max_seqlen=max(lengths), scale=128 ** -0.5, lengths=lengths)
    out, lse = torch_flash.varlen_forward(q, k, v, **lens)
    ref_out, ref_lse = TorchBackend().varlen_forward(q, k, v, **lens)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (hq, bounds[-1])
    assert_bf16_close(out, ref_out, "out")
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    grads = torch_flash.varlen_backward(dout, q, k, v, out, lse, **lens)
    ref_grads = TorchBackend().varlen_backward(dout, q, k, v, out, lse, **lens)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == torch.bfloat16
        assert_bf16_close(g, r, name)


@pytest.mark.parametrize("causal,tq,tk", [(True, 257, 257), (False, 100, 300), (False, 300, 77)])
@pytest.mark.parametrize("hq,hk", [(32, 8), (8, 8)])
def test_torch_flash_blocks_match_torch(torch_flash, causal, tq, tk, hq, hk):
    """One ring block pair: the diagonal (causal, square) and earlier key chunks
    (no mask, tq != tk both ways), forward and backward."""
    q, k, v, dout = _tensors(tq, tk, hq, hk, 128, seed=tq * tk + hk)
    out, lse = torch_flash.forward(q, k, v, causal=causal, scale=128 ** -0.5)
    ref_out, ref_lse = TorchBackend().forward(q, k, v, causal=causal, scale=128 ** -0.5)
    assert lse.shape == (hq, tq) and lse.dtype == torch.float32
    assert_bf16_close(out, ref_out, "out")
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    grads = torch_flash.backward(dout, q, k, v, out, lse, causal=causal, scale=128 ** -0.5)
    ref_grads = TorchBackend().backward(dout, q, k, v, out, lse, causal=causal, scale=128 ** -0.5)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.shape
        assert_bf16_close(g, r, name)


def test_backends_never_sync_the_host(torch_flash):
    """``torch.cuda.set_sync_debug_mode("error")`` turns any host sync into an error:
    torch_flash's varlen and block calls, and the torch kernels' varlen loop over
    host ``lengths``, must run without one."""
    lengths = (40, 1, 87)
    cu = torch.tensor([0, 40, 41, 128], dtype=torch.int32, device="cuda")
    q, k, v, dout = _tensors(128, 128, 8, 2, 64, seed=3)
    lens = dict(cu_seqlens=cu, max_seqlen=87, scale=0.125, lengths=lengths)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for be in (torch_flash, TorchBackend()):
            out, lse = be.varlen_forward(q, k, v, **lens)
            be.varlen_backward(dout, q, k, v, out, lse, **lens)
        out, lse = torch_flash.forward(q[:50], k[:70], v[:70], causal=False, scale=0.125)
        torch_flash.backward(dout[:50], q[:50], k[:70], v[:70], out, lse, causal=False, scale=0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_block_offsets_are_built_on_the_callers_stream():
    """A block's ``[0, n]`` offsets come from a kernel on the caller's stream, so a
    late stream still reads its own write (no cache shared between streams)."""
    from megatron_zeppelin.attention.backends.base import single_sequence_offsets
    late, other = torch.cuda.Stream(), torch.cuda.Stream()
    n = 987_653
    with torch.cuda.stream(late):
        torch.cuda._sleep(100_000_000)                             # this stream runs late
        cu_q, cu_k = single_sequence_offsets(n, n, torch.device("cuda", torch.cuda.current_device()))
        seen = cu_q.clone()
    with torch.cuda.stream(other):
        again, _ = single_sequence_offsets(n, n, torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.synchronize()
    assert seen.tolist() == [0, n] and cu_k is cu_q and again is not cu_q
