"""Zigzag ring attention of one sequence over the ranks of a ring placement.

A ring of ``k`` ranks cuts the sequence into ``2k`` chunks; position ``i`` holds
chunks ``i`` and ``2k-1-i`` (``plan/shards.py``), its buffer rows being the two
chunks back to back.  Chunks may differ in length by one token, so block pairs
are classified by *chunk index*, never by buffer halves:

* query chunk after key chunk -> full block (no mask),
* same chunk                  -> diagonal causal block,
* query chunk before key chunk -> skipped (fully masked).

Forward (``k`` steps): at step ``s`` position ``i`` holds the K/V of owner
``i - s``; it sends them on to ``i + 1`` while computing its blocks against them
and merges with :func:`update_out_and_lse`.

Backward (``k + 1`` steps, ring-flash-attention's zigzag backward): the K/V travel
the same way and the dK/dV of each owner travel one step behind them,
accumulating every rank's contribution; the last step hands each owner its
complete dK/dV.  Sending the previous step's dK/dV while computing the current
step keeps every transfer overlapped with compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_zeppelin.attention.backends.base import AttentionBackend
from megatron_zeppelin.attention.merge import update_out_and_lse
from megatron_zeppelin.attention.schedule import COMPUTE_DONE, Exchange, JobSteps, Link
from megatron_zeppelin.plan.plan import SeqPlacement


@dataclass(frozen=True)
class RingJob:
    """A ring placement plus the model dims that size its messages."""

    placement: SeqPlacement
    """The sequence's ring placement (zigzag shards, ring order = ``ranks``)."""
    kv_numel_per_token: int
    """``hk * head_dim``: elements of one token's K (or V)."""
    dtype: torch.dtype = torch.float32
    """Dtype of q/k/v; K/V travel in it, dK/dV in the accumulation dtype."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.placement.ranks

    @property
    def size(self) -> int:
        return self.placement.size

    def tokens(self, pos: int) -> int:
        return sum(e - s for s, e in self.placement.shards[pos])

    def num_steps(self, backward: bool) -> int:
        return self.size + 1 if backward else self.size

    def links(self, step: int, backward: bool) -> list[Link]:
        sizes = {"kv": self.dtype.itemsize, "dkv": _acc_dtype_of(self.dtype).itemsize}
        return [Link(self.ranks[src], self.ranks[dst], numel, sizes[kind])
                for kind, src, dst, numel in _round(self, step, backward)]


def _round(job: RingJob, step: int, backward: bool) -> list[tuple[str, int, int, int]]:
    """``(kind, src pos, dst pos, numel)`` of a step: ``kv`` (K/V of owner
    ``src - step``, for the next step) and, in backward, ``dkv`` (the dK/dV of
    owner ``src - step + 1`` accumulated so far)."""
    k = job.size
    out = []
    if step < k - 1:                    # the last step's K/V need not move on
        out += [("kv", j, (j + 1) % k, 2 * job.tokens((j - step) % k) * job.kv_numel_per_token)
                for j in range(k)]
    if backward and step >= 1:
        out += [("dkv", j, (j + 1) % k, 2 * job.tokens((j - step + 1) % k) * job.kv_numel_per_token)
                for j in range(k)]
    return out


def _exchange(job: RingJob, pos: int, step: int, backward: bool, payload: dict[str, torch.Tensor],
              like: torch.Tensor) -> Exchange:
    """This position's sends (``payload[kind]``) and fresh receive buffers of a
    step; received K/V take ``like``'s dtype, dK/dV travel in the accumulation
    dtype (float32, float64 for float64 inputs)."""
    ex = Exchange()
    for idx, (kind, src, dst, numel) in enumerate(_round(job, step, backward)):
        if src == pos:
            ex.sends[idx] = payload[kind]
        if dst == pos:
            dtype = like.dtype if kind == "kv" else _acc_dtype(like)
            tail = like.shape[2:]                           # [2, tokens, hk, d]
            ex.recvs[idx] = torch.empty(2, numel // (2 * tail.numel()), *tail, dtype=dtype,
                                        device=like.device)
    return ex


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return _acc_dtype_of(x.dtype)


def _acc_dtype_of(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _block_pairs(job: RingJob, pos: int, owner: int) -> list[tuple[slice, slice, bool]]:
    """(query rows of ``pos``, key rows of ``owner``, causal) of every block to
    compute, with full blocks that share their key (or query) rows and touch
    fused into one kernel call: against an earlier owner both query chunks see
    its first chunk, against a later owner the second query chunk sees both of
    its chunks -- one call per step except on the rank's own K/V."""
    blocks = []
    for qa, (qs, qe), qoff in _chunks(job, pos):
        for kb, (ks, ke), koff in _chunks(job, owner):
            if qa >= kb:
                blocks.append((slice(qoff, qoff + qe - qs), slice(koff, koff + ke - ks), qa == kb))
    if len(blocks) == 2 and not blocks[0][2] and not blocks[1][2]:
        (q0, k0, _), (q1, k1, _) = blocks
        if k0 == k1 and q0.stop == q1.start:
            return [(slice(q0.start, q1.stop), k0, False)]
        if q0 == q1 and k0.stop == k1.start:
            return [(q0, slice(k0.start, k1.stop), False)]
    return blocks


def _chunks(job: RingJob, pos: int) -> list[tuple[int, tuple[int, int], int]]:
    # (chunk index, token range, row offset in the rank's buffer) of both chunks;
    # validate() guarantees every chunk holds at least one token.
    a, b = job.placement.shards[pos]
    return [(pos, a, 0), (2 * job.size - 1 - pos, b, a[1] - a[0])]


def _pairs_count(job: RingJob, pos: int, owner: int) -> int:
    """Exact causal (q, k) pairs of the blocks ``pos`` computes against ``owner``."""
    total = 0
    for qs, ks, causal in _block_pairs(job, pos, owner):
        tq = qs.stop - qs.start
        total += tq * (tq + 1) // 2 if causal else tq * (ks.stop - ks.start)
    return total


def ring_forward(job: RingJob, pos: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 backend: AttentionBackend, scale: float) -> JobSteps:
    """Position ``pos``'s forward; returns ``(out [n, hq, d], lse [hq, n] fp32, pairs)``."""
    size = job.size
    kv = torch.stack([k, v]).contiguous()                   # [2, n_owner, hk, d]
    # Running (out, lse) over all rows; lse = -inf makes the first merge of a
    # row take the block as is (sigmoid(+inf) = 1, logaddexp(-inf, x) = x).
    acc = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_acc_dtype(q), device=q.device)
    pairs = 0
    for step in range(size):
        owner = (pos - step) % size
        ex = _exchange(job, pos, step, False, {"kv": kv}, kv)
        yield ex
        for qs, ks, causal in _block_pairs(job, pos, owner):
            bo, bl = backend.forward(q[qs], kv[0, ks], kv[1, ks], causal=causal, scale=scale)
            acc[qs], lse[:, qs] = update_out_and_lse(acc[qs], lse[:, qs], bo, bl)
        pairs += _pairs_count(job, pos, owner)
        yield COMPUTE_DONE
        if ex.recvs:
            kv = next(iter(ex.recvs.values()))
    return acc.to(q.dtype), lse, pairs


def ring_backward(job: RingJob, pos: int, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, backend: AttentionBackend,
                  scale: float) -> JobSteps:
    """Position ``pos``'s backward; returns ``(dq, dk, dv, pairs)`` of its own rows."""
    size = job.size
    kv = torch.stack([k, v]).contiguous()
    dq = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    dkv = None                                              # accumulated dK/dV of the previous owner
    pairs = 0
    for step in range(size + 1):
        owner = (pos - step) % size
        ex = _exchange(job, pos, step, True, {"kv": kv, "dkv": dkv}, kv)
        yield ex
        contrib = None
        if step < size:
            contrib = torch.zeros(kv.shape, dtype=_acc_dtype(q), device=q.device)
            for qs, ks, causal in _block_pairs(job, pos, owner):
                bq, bk, bv = backend.backward(dout[qs], q[qs], kv[0, ks], kv[1, ks], out[qs],
                                              lse[:, qs], causal=causal, scale=scale)
                dq[qs] += bq
                contrib[0, ks] += bk
                contrib[1, ks] += bv
            pairs += _pairs_count(job, pos, owner)
        yield COMPUTE_DONE
        received = {kind: ex.recvs[i] for i, (kind, _, dst, _) in
                    enumerate(_round(job, step, True)) if dst == pos}
        if "kv" in received:
            kv = received["kv"]
        incoming = received.get("dkv")
        if step == size:
            dkv = incoming                                  # my own K/V's complete gradient
        else:
            dkv = contrib if incoming is None else contrib + incoming
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), pairs
