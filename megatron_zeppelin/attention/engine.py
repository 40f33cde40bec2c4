"""The attention engine: one rank's share of a whole Plan's attention in one layer.

Zeppelin's three queues per rank -- inter-node rings, intra-node rings, local
sequences -- run in that order so the slowest transfers start first, and local
compute fills the rounds in which the rank has no ring work (see
:mod:`megatron_zeppelin.attention.schedule` for why the rounds are global).
Whatever local work is left after the rings runs as one packed varlen call.

:func:`plan_attention` is differentiable through one ``autograd.Function`` whose
backward replays the same schedule with the backward steps (dK/dV around the
rings, dO/dQKV through the Ulysses all-to-alls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_zeppelin.attention.backends import AttentionBackend, get_backend
from megatron_zeppelin.attention.layout import Piece, rank_pieces
from megatron_zeppelin.attention.ring import RingJob, ring_backward, ring_forward
from megatron_zeppelin.attention.schedule import Wave, build_waves, run_waves
from megatron_zeppelin.attention.ulysses import UlyssesJob, ulysses_backward, ulysses_forward
from megatron_zeppelin.comm.base import Communicator
from megatron_zeppelin.plan.plan import Mode, Plan
from megatron_zeppelin.plan.shards import causal_pairs

#: Queue order of the tiers (the slowest transfers start first).
TIER_ORDER = {"inter": 0, "intra": 1, "ulysses": 2}


@dataclass
class AttentionCounter:
    """Exact causal (query, key) pairs this rank computed (per head, summed over
    calls); a Ulysses rank is credited ``pairs / d`` as in ``Plan.attn_pairs_per_rank``."""

    forward_pairs: int = 0
    """Pairs of forward blocks."""
    backward_pairs: int = 0
    """Pairs of backward blocks."""

    def reset(self) -> None:
        self.forward_pairs = 0
        self.backward_pairs = 0


@dataclass(frozen=True)
class EngineSchedule:
    """What every rank derives from a Plan and the head shapes, once per plan."""

    jobs: tuple[RingJob | UlyssesJob, ...]
    """Distributed placements (rings and Ulysses groups)."""
    job_of_placement: dict[int, int]
    """``plan.attention`` index -> job id, for distributed placements."""
    waves: tuple[Wave, ...]
    """Waves in execution order (inter rings, intra rings, Ulysses)."""
    plan: Plan
    """The plan it was derived from."""
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    def rank_view(self, rank: int) -> "RankView":
        """This rank's pieces, computed once per rank."""
        view = self._views.get(rank)
        if view is None:
            local, dist = [], {}
            for piece in rank_pieces(self.plan, rank):
                job = self.job_of_placement.get(piece.index)
                if job is None:
                    local.append(piece)
                else:
                    dist[job] = piece
            tokens = sum(p.rows.stop - p.rows.start for p in (*local, *dist.values()))
            view = self._views[rank] = RankView(tuple(local), dist, tokens)
        return view


@dataclass(frozen=True)
class RankView:
    """One rank's part of a schedule."""

    local: tuple[Piece, ...]
    """Local sequences, in queue (plan) order."""
    dist: dict[int, Piece]
    """Job id -> the rank's rows of that ring / Ulysses placement."""
    tokens: int
    """Rows of the rank's q/k/v buffers."""


def build_schedule(plan: Plan, q_heads: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype = torch.float32, cache: dict | None = None) -> EngineSchedule:
    """The schedule of ``plan``'s attention.  ``cache``: a dict that lives as long as
    ``plan`` (the step context's), so a model's layers derive it once per head shape."""
    key = ("engine_schedule", q_heads, kv_heads, head_dim, dtype)
    if cache is not None and key in cache:
        return cache[key]
    jobs, tiers, job_of = [], [], {}
    for index, p in enumerate(plan.attention):
        if p.mode is Mode.LOCAL:
            continue
        job_of[index] = len(jobs)
        tiers.append(TIER_ORDER[plan.tier_of(p)])
        jobs.append(RingJob(p, kv_heads * head_dim, dtype) if p.mode is Mode.RING
                    else UlyssesJob(p, q_heads, kv_heads, head_dim, dtype))
    schedule = EngineSchedule(tuple(jobs), job_of, build_waves(jobs, tiers) if jobs else (), plan)
    if cache is not None:
        cache[key] = schedule
    return schedule


def plan_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: Plan, rank: int,
                   comm: Communicator, backend: AttentionBackend | str = "auto",
                   softmax_scale: float | None = None,
                   counter: AttentionCounter | None = None, cache: dict | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens under ``plan``; differentiable.

    ``q: [t, hq, d]``, ``k, v: [t, hk, d]``: the rank's tokens in attention-layout
    order (``plan.attention_spans(rank)``).  Returns ``[t, hq, d]``.  Collective:
    every rank of ``plan.world_size`` must call it (same plan, same head shapes),
    also ranks holding no tokens."""
    if isinstance(backend, str):
        backend = get_backend(backend)
    schedule = build_schedule(plan, q.shape[1], k.shape[1], q.shape[2], q.dtype, cache)
    expected = schedule.rank_view(rank).tokens
    if q.shape[0] != expected or k.shape[0] != expected or v.shape[0] != expected:
        raise ValueError(f"rank {rank} holds {expected} tokens in the plan's attention layout, "
                         f"got q/k/v with {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    run = _Run(rank, comm, backend, scale, counter if counter is not None else AttentionCounter(),
               schedule)
    return _PlanAttention.apply(q, k, v, run)


@dataclass
class _Run:
    """Everything one call needs besides the tensors."""

    rank: int
    comm: Communicator
    backend: AttentionBackend
    scale: float
    counter: AttentionCounter
    schedule: EngineSchedule

    def pieces(self) -> tuple[tuple[Piece, ...], dict[int, Piece]]:
        view = self.schedule.rank_view(self.rank)
        return view.local, view.dist


class _LocalQueue:
    """Local sequences: one at a time while filling rounds, the rest in one varlen call."""

    def __init__(self, pieces: tuple[Piece, ...], compute: Callable[[list[Piece]], None]) -> None:
        self._pending = list(pieces)
        self._compute = compute

    def fill(self) -> None:
        if self._pending:
            self._compute([self._pending.pop(0)])

    def drain(self) -> None:
        if self._pending:
            self._compute(self._pending)
            self._pending = []


def _packed(pieces: list[Piece], *tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Rows of ``pieces`` packed back to back, their int32 ``cu_seqlens`` and the
    longest piece (a host int from the plan: kernels need no device read)."""
    lengths = [p.rows.stop - p.rows.start for p in pieces]
    cu = torch.tensor([0, *lengths], dtype=torch.int32, device=tensors[0].device).cumsum(0, dtype=torch.int32)
    packed = [torch.cat([t[p.rows] for p in pieces]) if len(pieces) > 1 else t[pieces[0].rows]
              for t in tensors]
    return packed, cu, max(lengths)


def _unpack(pieces: list[Piece], packed: torch.Tensor, dest: torch.Tensor) -> None:
    row = 0
    for p in pieces:
        n = p.rows.stop - p.rows.start
        dest[p.rows] = packed[row:row + n]
        row += n


class _PlanAttention(torch.autograd.Function):
    """Forward and backward of every placement of one rank, in schedule order."""

    @staticmethod
    def forward(ctx, q, k, v, run: _Run):
        local, dist = run.pieces()
        out = torch.empty_like(q)
        local_lse: dict[int, torch.Tensor] = {}              # placement index -> lse [hq, n]

        def compute_local(pieces: list[Piece]) -> None:
            (pq, pk, pv), cu, longest = _packed(pieces, q, k, v)
            o, lse = run.backend.varlen_forward(pq, pk, pv, cu_seqlens=cu, max_seqlen=longest, scale=run.scale)
            _unpack(pieces, o, out)
            row = 0
            for p in pieces:
                n = p.rows.stop - p.rows.start
                local_lse[p.index] = lse[:, row:row + n]
                row += n
                run.counter.forward_pairs += causal_pairs(0, n)

        queue = _LocalQueue(local, compute_local)
        factories = {j: _forward_factory(run, j, piece, q, k, v) for j, piece in dist.items()}
        results = run_waves(run.schedule.waves, False, run.comm, factories, queue.fill)
        queue.drain()
        saved = {}
        for j, result in results.items():
            piece = dist[j]
            out[piece.rows] = result[0]
            saved[j] = result[1]
            run.counter.forward_pairs += result[2]
        ctx.run, ctx.local_lse, ctx.saved = run, local_lse, saved
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors
        run: _Run = ctx.run
        local, dist = run.pieces()
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def compute_local(pieces: list[Piece]) -> None:
            (pd, pq, pk, pv, po), cu, longest = _packed(pieces, dout, q, k, v, out)
            lse = torch.cat([ctx.local_lse[p.index] for p in pieces], dim=1)
            grads = run.backend.varlen_backward(pd, pq, pk, pv, po, lse, cu_seqlens=cu, max_seqlen=longest,
                                                scale=run.scale)
            for packed, dest in zip(grads, (dq, dk, dv)):
                _unpack(pieces, packed, dest)
            run.counter.backward_pairs += sum(causal_pairs(0, p.rows.stop - p.rows.start) for p in pieces)

        queue = _LocalQueue(local, compute_local)
        factories = {j: _backward_factory(run, j, piece, dout, q, k, v, out, ctx.saved[j])
                     for j, piece in dist.items()}
        results = run_waves(run.schedule.waves, True, run.comm, factories, queue.fill)
        queue.drain()
        for j, (gq, gk, gv, pairs) in results.items():
            rows = dist[j].rows
            dq[rows], dk[rows], dv[rows] = gq, gk, gv
            run.counter.backward_pairs += pairs
        return dq, dk, dv, None


def _forward_factory(run: _Run, j: int, piece: Piece, q, k, v):
    job, rows = run.schedule.jobs[j], piece.rows
    if isinstance(job, RingJob):
        return lambda: ring_forward(job, piece.pos, q[rows], k[rows], v[rows], run.backend, run.scale)

    def start():
        out, saved = yield from ulysses_forward(job, piece.pos, q[rows], k[rows], v[rows],
                                                run.backend, run.scale)
        return out, saved, job.pairs()
    return start


def _backward_factory(run: _Run, j: int, piece: Piece, dout, q, k, v, out, saved):
    job, rows = run.schedule.jobs[j], piece.rows
    if isinstance(job, RingJob):
        return lambda: ring_backward(job, piece.pos, dout[rows], q[rows], k[rows], v[rows], out[rows],
                                     saved, run.backend, run.scale)

    def start():
        dq, dk, dv = yield from ulysses_backward(job, piece.pos, dout[rows], saved, run.backend, run.scale)
        return dq, dk, dv, job.pairs()
    return start
