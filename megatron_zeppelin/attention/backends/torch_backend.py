"""Pure-PyTorch attention kernels (CPU and GPU): the always-available backend
and the numerical reference of the others.  Computes in float32 whatever the
input dtype (float64 stays float64, for tight tests), materialising the ``[h, tq, tk]`` score matrix of one block --
fine for tests and CPU training, not for long blocks on a GPU."""

from __future__ import annotations

import torch

from megatron_zeppelin.attention.backends.base import check_block, host_bounds


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, group: int, causal: bool, scale: float) -> torch.Tensor:
    # q: [tq, hq, d], k: [tk, hk, d] -> s: [hq, tq, tk] (fp32, masked entries -inf)
    kf = _acc(k).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", _acc(q), kf) * scale
    if causal:
        tq = q.shape[0]
        mask = torch.ones(tq, tq, dtype=torch.bool, device=q.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _sum_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    # [tk, hq, d] -> [tk, hk, d]: query heads h*group .. h*group+group-1 share key head h.
    tk, hq, d = x.shape
    return x.view(tk, hq // group, group, d).sum(dim=2)


class TorchBackend:
    """Reference kernels in plain PyTorch."""

    name = "torch"

    def forward(self, q, k, v, *, causal, scale):
        group = check_block(q, k, v, causal)
        s = _scores(q, k, group, causal, scale)
        lse = torch.logsumexp(s, dim=-1)                      # [hq, tq]
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("hqk,khd->qhd", p, _acc(v).repeat_interleave(group, dim=1))
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        group = check_block(q, k, v, causal)
        p = torch.exp(_scores(q, k, group, causal, scale) - _acc(lse).unsqueeze(-1))  # [hq, tq, tk]
        do = _acc(dout)
        vf = _acc(v).repeat_interleave(group, dim=1)
        dv = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vf)
        # Softmax backward with the final output: D_i = sum_d dout_i * out_i.
        delta = (do * _acc(out)).sum(-1).transpose(0, 1)    # [hq, tq]
        ds = p * (dp - delta.unsqueeze(-1)) * scale
        dq = torch.einsum("hqk,khd->qhd", ds, _acc(k).repeat_interleave(group, dim=1))
        dk = torch.einsum("hqk,qhd->khd", ds, _acc(q))
        return (dq.to(q.dtype), _sum_groups(dk, group).to(k.dtype), _sum_groups(dv, group).to(v.dtype))

    def varlen_forward(self, q, k, v, *, cu_seqlens, max_seqlen, scale, lengths=None):
        # max_seqlen sizes fused kernels' launches; this loop needs every bound, on the host.
        bounds = host_bounds(cu_seqlens, lengths)
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.promote_types(q.dtype, torch.float32))
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:
                out[s:e], lse[:, s:e] = self.forward(q[s:e], k[s:e], v[s:e], causal=True, scale=scale)
        return out, lse

    def varlen_backward(self, dout, q, k, v, out, lse, *, cu_seqlens, max_seqlen, scale, lengths=None):
        bounds = host_bounds(cu_seqlens, lengths)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:
                dq[s:e], dk[s:e], dv[s:e] = self.backward(
                    dout[s:e], q[s:e], k[s:e], v[s:e], out[s:e], lse[:, s:e], causal=True, scale=scale)
        return dq, dk, dv
