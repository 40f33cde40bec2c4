"""Ulysses (DeepSpeed sequence parallelism) for one sequence over a group of d ranks.

Position ``p`` holds contiguous rows ``[b_p, b_{p+1})`` of every head.  An
all-to-all over heads (one round: every position sends every other one its rows
of that position's heads) gives position ``p`` the *whole* sequence for heads
``p*h/d .. (p+1)*h/d``; it runs plain causal attention on them, and a second
all-to-all returns the output rows.  Query heads and key/value heads are split
the same way, so a query head's GQA key head lands on the same position.

Forward steps: 0 exchange Q/K/V, 1 compute, 2 exchange outputs.
Backward steps: 0 exchange dO, 1 compute, 2 exchange dQ/dK/dV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_zeppelin.attention.backends.base import AttentionBackend
from megatron_zeppelin.attention.schedule import COMPUTE_DONE, Exchange, JobSteps, Link
from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan.plan import SeqPlacement
from megatron_zeppelin.plan.shards import causal_pairs


@dataclass(frozen=True)
class UlyssesJob:
    """A Ulysses placement plus the model dims that size its messages."""

    placement: SeqPlacement
    """The sequence's Ulysses placement (contiguous shards)."""
    q_heads: int
    """Query heads ``hq`` (divisible by the group size)."""
    kv_heads: int
    """Key/value heads ``hk`` (divisible by the group size)."""
    head_dim: int
    """Elements per head."""
    dtype: torch.dtype = torch.float32
    """Dtype of q/k/v and of everything the all-to-alls move."""

    def __post_init__(self) -> None:
        d = self.placement.size
        if self.q_heads % d or self.kv_heads % d:
            raise PlanError(f"plan: sequence {self.placement.seq} runs Ulysses on {d} ranks but "
                            f"{self.q_heads} query / {self.kv_heads} key-value heads do not split "
                            f"{d} ways; use a group size dividing both head counts")

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.placement.ranks

    def rows(self, pos: int) -> tuple[int, int]:
        return self.placement.shards[pos][0]

    def num_steps(self, backward: bool) -> int:
        return 3

    def links(self, step: int, backward: bool) -> list[Link]:
        return [Link(self.ranks[a], self.ranks[b], numel, self.dtype.itemsize)
                for a, b, numel in _round(self, step, backward)]

    def pairs(self) -> int:
        """Pairs one position is credited with (``Plan.attn_pairs_per_rank``'s rule)."""
        L = self.rows(self.placement.size - 1)[1]
        return causal_pairs(0, L) // self.placement.size


def _round(job: UlyssesJob, step: int, backward: bool) -> list[tuple[int, int, int]]:
    """``(src pos, dst pos, numel)``: step 0 moves rows of ``src`` to the head
    owner ``dst`` (Q/K/V forward, dO backward), step 2 moves them back (O forward,
    dQ/dK/dV backward)."""
    if step == 1:
        return []
    d = job.placement.size
    hq, hk = job.q_heads // d, job.kv_heads // d
    to_heads = step == 0
    heads = hq if to_heads == backward else hq + 2 * hk
    msgs = []
    for a in range(d):
        for b in range(d):
            if a != b:
                s, e = job.rows(a if to_heads else b)
                msgs.append((a, b, (e - s) * heads * job.head_dim))
    return msgs


def _all_to_all(job: UlyssesJob, pos: int, step: int, backward: bool,
                pieces: list[torch.Tensor], recv_shape: list[tuple[int, ...]]) -> Exchange:
    """Send ``pieces[b]`` to position ``b``; receive position ``a``'s piece shaped ``recv_shape[a]``."""
    ex = Exchange(computes=False)
    like = pieces[0]
    for idx, (a, b, _) in enumerate(_round(job, step, backward)):
        if a == pos:
            ex.sends[idx] = pieces[b].contiguous()
        if b == pos:
            ex.recvs[idx] = torch.empty(recv_shape[a], dtype=like.dtype, device=like.device)
    return ex


def _gather(job: UlyssesJob, pos: int, ex: Exchange, own: torch.Tensor, step: int, backward: bool,
            dim: int) -> torch.Tensor:
    """Concatenate the received pieces and ``own`` in position order along ``dim``."""
    by_src = {a: ex.recvs[idx] for idx, (a, b, _) in enumerate(_round(job, step, backward)) if b == pos}
    by_src[pos] = own
    return torch.cat([by_src[a] for a in range(job.placement.size)], dim=dim)


def _split_heads(x: torch.Tensor, d: int) -> list[torch.Tensor]:
    return list(x.chunk(d, dim=1))


def ulysses_forward(job: UlyssesJob, pos: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    backend: AttentionBackend, scale: float) -> JobSteps:
    """Returns ``(out [n, hq, d], saved)``; ``saved`` feeds :func:`ulysses_backward`."""
    d = job.placement.size
    hq = job.q_heads // d
    # [n, hq + 2hk, d] -> piece b: rows of mine, heads of b (q heads, k heads, v heads)
    pieces = [torch.cat(parts, dim=1) for parts in
              zip(_split_heads(q, d), _split_heads(k, d), _split_heads(v, d))]
    shapes = [(job.rows(a)[1] - job.rows(a)[0], *pieces[pos].shape[1:]) for a in range(d)]
    ex = _all_to_all(job, pos, 0, False, pieces, shapes)
    yield ex
    yield COMPUTE_DONE
    qkv = _gather(job, pos, ex, pieces[pos], 0, False, dim=0)   # [L, hq/d + 2hk/d, d]
    hk = (qkv.shape[1] - hq) // 2
    qh, kh, vh = qkv.split([hq, hk, hk], dim=1)
    yield Exchange()
    out_h, lse_h = backend.forward(qh, kh, vh, causal=True, scale=scale)
    yield COMPUTE_DONE
    bounds = [job.rows(b) for b in range(d)]
    ex = _all_to_all(job, pos, 2, False, [out_h[s:e] for s, e in bounds],
                     [(bounds[pos][1] - bounds[pos][0], hq, q.shape[2])] * d)
    yield ex
    yield COMPUTE_DONE
    out = _gather(job, pos, ex, out_h[slice(*bounds[pos])], 2, False, dim=1)
    return out, (qh, kh, vh, out_h, lse_h)


def ulysses_backward(job: UlyssesJob, pos: int, dout: torch.Tensor, saved: tuple,
                     backend: AttentionBackend, scale: float) -> JobSteps:
    """Returns ``(dq, dk, dv)`` of this position's rows."""
    d = job.placement.size
    qh, kh, vh, out_h, lse_h = saved
    pieces = _split_heads(dout, d)
    shapes = [(job.rows(a)[1] - job.rows(a)[0], *pieces[pos].shape[1:]) for a in range(d)]
    ex = _all_to_all(job, pos, 0, True, pieces, shapes)
    yield ex
    yield COMPUTE_DONE
    dout_h = _gather(job, pos, ex, pieces[pos], 0, True, dim=0)  # [L, hq/d, d]
    yield Exchange()
    grads = backend.backward(dout_h, qh, kh, vh, out_h, lse_h, causal=True, scale=scale)
    dqkv_h = torch.cat(grads, dim=1)                             # [L, hq/d + 2hk/d, d]
    yield COMPUTE_DONE
    bounds = [job.rows(b) for b in range(d)]
    n = bounds[pos][1] - bounds[pos][0]
    ex = _all_to_all(job, pos, 2, True, [dqkv_h[s:e] for s, e in bounds],
                     [(n, *dqkv_h.shape[1:])] * d)
    yield ex
    yield COMPUTE_DONE
    dqkv = _gather(job, pos, ex, dqkv_h[slice(*bounds[pos])], 2, True, dim=1)
    # [n, d * (hq/d + 2hk/d), d]: per source position its (dq, dk, dv) heads
    hq, hk = qh.shape[1], kh.shape[1]
    per_pos = dqkv.split([hq + 2 * hk] * d, dim=1)
    dq = torch.cat([x[:, :hq] for x in per_pos], dim=1)
    dk = torch.cat([x[:, hq:hq + hk] for x in per_pos], dim=1)
    dv = torch.cat([x[:, hq + hk:] for x in per_pos], dim=1)
    return dq, dk, dv
