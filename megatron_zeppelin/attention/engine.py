"""The attention engine: one rank's share of a whole Plan's attention in one layer.

Every rank derives the same schedule of the layer from the Plan
(``schedule/attention.py``) and executes its own lanes of it
(``comm/lanes.py``): inter-node transfers are posted first, and the compute
lane runs whichever op is ready first, so intra-node rings, Ulysses work and
local sequences run while transfers are in flight.  The simulator replays the
same schedule (``sim/replay.py``).

This module binds the schedule's ops to tensors: a compute op runs its ring
step (a packed ring's: all its members' blocks, ``attention/packed_ring.py``),
Ulysses head block (a packed group's: all its members' heads in one varlen
call, ``attention/packed_ulysses.py``) or packed local sequences; a message's send tensor and
receive buffer come from the ring or Ulysses position that owns it.
:func:`plan_attention` is differentiable through one ``autograd.Function``
whose backward executes the backward schedule of the same layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_zeppelin.attention.backends import AttentionBackend, get_backend
from megatron_zeppelin.attention.layout import Piece, rank_pieces
from megatron_zeppelin.attention.packed_ring import PackedRing, PackedRingBackward, PackedRingForward
from megatron_zeppelin.attention.packed_ulysses import PackedUlysses, PackedUlyssesBackward, PackedUlyssesForward
from megatron_zeppelin.attention.ring import RingBackward, RingForward, ring_grad_wire_dtype
from megatron_zeppelin.attention.ulysses import UlyssesBackward, UlyssesForward, check_heads
from megatron_zeppelin.comm.lanes import run_without_transfers
from megatron_zeppelin.comm.rounds import LaneCommunicator
from megatron_zeppelin.comm.streams import StreamOps, streams_for
from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE
from megatron_zeppelin.plan.plan import Mode, Plan
from megatron_zeppelin.schedule.attention import AttnShape, Transport, attention_schedule
from megatron_zeppelin.schedule.ops import Op, Schedule
from megatron_zeppelin.topology import Topology


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


@dataclass
class LayerSchedules:
    """What every rank derives once per plan, head shape and transport."""

    plan: Plan
    forward: Schedule
    backward: Schedule
    _pieces: dict[int, dict[int, Piece]] = field(default_factory=dict, repr=False)
    _mids: dict[bool, dict[tuple, int]] = field(default_factory=dict, repr=False)
    _cu: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def pieces(self, rank: int) -> dict[int, Piece]:
        """Placement index -> the rank's rows of it."""
        if rank not in self._pieces:
            self._pieces[rank] = {p.index: p for p in rank_pieces(self.plan, rank)}
        return self._pieces[rank]

    def cu_seqlens(self, lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """int32 ``cu_seqlens`` of ``lengths`` on ``device``, uploaded once per plan
        (pinned and non-blocking on CUDA: building it never waits for the GPU)."""
        key = (lengths, device)
        if key not in self._cu:
            host = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
            self._cu[key] = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        return self._cu[key]

    def message_ids(self, backward: bool) -> dict[tuple, int]:
        if backward not in self._mids:
            sched = self.backward if backward else self.forward
            self._mids[backward] = {binding: mid for mid, binding in sched.messages.items()}
        return self._mids[backward]


def build_schedule(plan: Plan, shape: AttnShape, comm: LaneCommunicator | None,
                   cache: dict | None = None, rank: int | None = None) -> LayerSchedules:
    """Forward and backward schedules of ``plan``'s attention layer.  ``cache``: a
    dict that lives as long as ``plan`` (the step context's), so a model's layers
    derive them once.  Without a communicator the transport is direct (the plan
    must then move nothing).  ``rank``: that rank's projection of each (what it
    executes, built from the rings and groups that reach it: per-step host work
    on the training thread that does not grow with the world); None: every rank's."""
    transport = comm.transport_for(plan.routed) if isinstance(comm, LaneCommunicator) else Transport(
        Topology(nodes=1, gpus_per_node=plan.world_size, nics_per_node=1))
    key = ("layer_schedules", shape, transport, rank)
    if cache is not None and key in cache:
        return cache[key]
    for index in plan.shared_indices():     # before any geometry: a clear PlanError, not a shape error later
        p = plan.attention[index]
        if p.mode is Mode.ULYSSES:
            check_heads(p, shape.q_heads, shape.kv_heads)
    entry = LayerSchedules(plan, attention_schedule(plan, shape, transport, False, rank),
                           attention_schedule(plan, shape, transport, True, rank))
    if cache is not None:
        cache[key] = entry
    return entry


def attn_shape(q: torch.Tensor, k: torch.Tensor, ring_grad_dtype: str = DEFAULT_RING_GRAD_DTYPE) -> AttnShape:
    """The schedule's shape of this call's tensors (``q: [t, hq, d]``, ``k: [t, hk, d]``;
    dK/dV messages in ``ring_grad_dtype``'s wire dtype)."""
    return AttnShape(q.shape[1], k.shape[1], q.shape[2], q.element_size(),
                     ring_grad_wire_dtype(q.dtype, ring_grad_dtype).itemsize)


def plan_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: Plan, rank: int,
                   comm: LaneCommunicator | None, backend: AttentionBackend | str = "auto",
                   softmax_scale: float | None = None, counter: AttentionCounter | None = None,
                   cache: dict | None = None, ring_grad_dtype: str = DEFAULT_RING_GRAD_DTYPE) -> torch.Tensor:
    """Causal attention of this rank's tokens under ``plan``; differentiable.

    ``q: [t, hq, d]``, ``k, v: [t, hk, d]``: the rank's tokens in attention-layout
    order (``plan.attention_spans(rank)``).  Returns ``[t, hq, d]``.  Collective:
    every rank of ``plan.world_size`` must call it (same plan, same head shapes,
    same ``ring_grad_dtype``), also ranks holding no tokens.  ``ring_grad_dtype``:
    what the backward ring's dK/dV messages travel in (``model``: the K/V dtype,
    as TransformerEngine sends them; ``fp32``: exact accumulation; see docs/engine.md)."""
    run = _prepare(q, k, v, plan, rank, comm, backend, softmax_scale, counter, cache, ring_grad_dtype)
    return _PlanAttention.apply(q, k, v, run)


def attention_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: Plan, rank: int,
                     comm: LaneCommunicator | None, backend: AttentionBackend | str = "auto",
                     softmax_scale: float | None = None, counter: AttentionCounter | None = None,
                     cache: dict | None = None, ring_grad_dtype: str = DEFAULT_RING_GRAD_DTYPE,
                     ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple]]:
    """:func:`plan_attention` without autograd: ``(out, backward)`` where
    ``backward(dout)`` returns ``(dq, dk, dv)``.  For callers that run several
    ranks in one process (autograd runs every CUDA backward of a process on one
    device thread, where one rank's backward would wait on another's)."""
    run = _prepare(q, k, v, plan, rank, comm, backend, softmax_scale, counter, cache, ring_grad_dtype)
    out, state = _forward(run, q, k, v)
    return out, lambda dout: _backward(run, dout.contiguous(), q, k, v, out, state)


def _prepare(q, k, v, plan, rank, comm, backend, softmax_scale, counter, cache, ring_grad_dtype) -> "_Run":
    if isinstance(backend, str):
        backend = get_backend(backend)
    layer = build_schedule(plan, attn_shape(q, k, ring_grad_dtype), comm, cache, rank)
    expected = sum(p.rows.stop - p.rows.start for p in layer.pieces(rank).values())
    if q.shape[0] != expected or k.shape[0] != expected or v.shape[0] != expected:
        raise ValueError(f"rank {rank} holds {expected} tokens in the plan's attention layout, "
                         f"got q/k/v with {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    streams = comm.runner.streams if isinstance(comm, LaneCommunicator) else streams_for(q.device)
    return _Run(rank, comm, backend, scale, counter if counter is not None else AttentionCounter(), layer, streams,
                ring_grad_wire_dtype(q.dtype, ring_grad_dtype))


@dataclass
class _Run:
    """Everything one call needs besides the tensors."""

    rank: int
    comm: LaneCommunicator | None
    backend: AttentionBackend
    scale: float
    counter: AttentionCounter
    layer: LayerSchedules
    streams: StreamOps
    """How the lanes reach streams (a send tensor read on a lane is kept alive for it)."""
    grad_wire: torch.dtype
    """What the backward ring's dK/dV messages travel in (``ring_grad_dtype``)."""


class _Binding:
    """Ops of one rank and one pass bound to tensors (shared by both passes; each
    pass's subclass runs its packed local sequences in ``_local``)."""

    def __init__(self, run: _Run, backward: bool) -> None:
        self.run, self.backward = run, backward
        self.plan = run.layer.plan
        self.pieces = run.layer.pieces(run.rank)
        self.mids = run.layer.message_ids(backward)
        self.bindings = (run.layer.backward if backward else run.layer.forward).messages
        self.landed: dict[int, torch.Tensor] = {}     # message id -> its receive tensor
        self.rings: dict[int, RingForward | RingBackward | PackedRing] = {}
        self.groups: dict[int, UlyssesForward | UlyssesBackward | PackedUlysses] = {}

    def compute(self, op: Op) -> None:
        kind = op.key[0]
        run = self.run
        if kind == "local":
            self._local(list(op.key[1:]))
        elif kind == "ring":
            _, index, pos, step = op.key
            self.rings[index].compute(step, run.backend, run.scale)
        else:
            self.groups[op.key[1]].compute(run.backend, run.scale)
        if self.backward:
            run.counter.backward_pairs += op.pairs
        else:
            run.counter.forward_pairs += op.pairs

    def _pack(self, parts: dict[int, object], packed: type[PackedRing] | type[PackedUlysses]) -> None:
        """Members of the plan's packed rings and Ulysses groups (``Plan.packed_rings``,
        ``Plan.packed_ulysses``) in ``parts`` run as one ring or group each, under
        their first member's index, as the schedule names it."""
        leads = self.plan.packed_leads()
        packs: dict[int, list] = {}
        for index in [i for i in parts if i in leads]:      # plan order (the buffer's)
            packs.setdefault(leads[index], []).append(parts.pop(index))
        cu = self.run.layer.cu_seqlens
        for lead, members in packs.items():
            parts[lead] = packed(lead, members, self.received, cu)

    def received(self, binding: tuple) -> torch.Tensor:
        return self.landed[self.mids[binding]]

    def recv_buffer(self, message: int) -> torch.Tensor:
        buf = self.landed[message] = self._new_buffer(self.bindings[message])
        return buf

    def send_tensor(self, message: int) -> torch.Tensor:
        kind, index, step, src = self.bindings[message][:4]
        if kind == "kv":
            return self.rings[index].kv(step)
        if kind == "dkv":
            own, arrived = self.rings[index].dkv_parts(step)
            # The lane's add reads a block the compute stream allocated and the
            # ring drops now: it must not be reused before the lane is past it.
            self.run.streams.record_stream(own, self.run.streams.current_stream())
            # The sum is fp32 (what arrived is added into the fp32 contribution);
            # it is rounded once, to the wire dtype, for the next hop.
            total = own if arrived is None else own + arrived
            return total.to(self.run.grad_wire)
        group = self.groups[index]
        dst = self.bindings[message][3]
        return group.pieces[dst] if kind == "a2a_in" else group.out_piece(dst)

    def _new_buffer(self, binding: tuple) -> torch.Tensor:
        kind, index = binding[0], binding[1]
        if kind == "kv":
            return self.rings[index].kv_buffer(binding[2], binding[3])
        if kind == "dkv":
            return self.rings[index].dkv_buffer(binding[2], binding[3])
        return self.groups[index].buffer(kind, binding[2])


class _ForwardBinding(_Binding):
    def __init__(self, run: _Run, q, k, v) -> None:
        super().__init__(run, backward=False)
        self.q, self.k, self.v = q, k, v
        self.out = torch.empty_like(q)
        self.local_lse: dict[int, torch.Tensor] = {}
        for index, piece in self.pieces.items():
            p = self.plan.attention[index]
            rows = piece.rows
            if p.mode is Mode.RING:
                self.rings[index] = RingForward(index, p, piece.pos, q[rows], k[rows], v[rows], self.received)
            elif p.mode is Mode.ULYSSES:
                self.groups[index] = UlyssesForward(index, p, piece.pos, self.received, q[rows], k[rows], v[rows])
        self._pack(self.rings, PackedRingForward)
        self._pack(self.groups, PackedUlyssesForward)

    def _local(self, indices: list[int]) -> None:
        pieces = [self.pieces[i] for i in indices]
        (pq, pk, pv), lengths = _packed(pieces, self.q, self.k, self.v)
        o, lse = self.run.backend.varlen_forward(pq, pk, pv, cu_seqlens=self.run.layer.cu_seqlens(lengths, pq.device),
                                                 max_seqlen=max(lengths), scale=self.run.scale, lengths=lengths)
        _unpack(pieces, o, self.out)
        row = 0
        for p in pieces:
            n = p.rows.stop - p.rows.start
            self.local_lse[p.index] = lse[:, row:row + n]
            row += n

    def finish(self) -> dict[int, tuple]:
        """Write ring and Ulysses outputs; return what backward needs per placement."""
        saved = {}
        for ring in self.rings.values():
            for m in ring.members:
                self.out[self.pieces[m.index].rows] = m.acc.to(self.q.dtype)
                saved[m.index] = m.lse
        for group in self.groups.values():
            for m in group.members:
                self.out[self.pieces[m.index].rows] = m.output()
                saved[m.index] = m.saved
        return saved


class _BackwardBinding(_Binding):
    def __init__(self, run: _Run, dout, q, k, v, out, saved, local_lse) -> None:
        super().__init__(run, backward=True)
        self.dout, self.q, self.k, self.v, self.out = dout, q, k, v, out
        self.local_lse = local_lse
        self.dq, self.dk, self.dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for index, piece in self.pieces.items():
            p = self.plan.attention[index]
            rows = piece.rows
            if p.mode is Mode.RING:
                self.rings[index] = RingBackward(index, p, piece.pos, q[rows], k[rows], v[rows], self.received,
                                                 dout[rows], out[rows], saved[index], run.grad_wire)
            elif p.mode is Mode.ULYSSES:
                self.groups[index] = UlyssesBackward(index, p, piece.pos, self.received, dout[rows], saved[index])
        self._pack(self.rings, PackedRingBackward)
        self._pack(self.groups, PackedUlyssesBackward)

    def _local(self, indices: list[int]) -> None:
        pieces = [self.pieces[i] for i in indices]
        (pd, pq, pk, pv, po), lengths = _packed(pieces, self.dout, self.q, self.k, self.v, self.out)
        lse = torch.cat([self.local_lse[p.index] for p in pieces], dim=1)
        grads = self.run.backend.varlen_backward(pd, pq, pk, pv, po, lse,
                                                 cu_seqlens=self.run.layer.cu_seqlens(lengths, pq.device),
                                                 max_seqlen=max(lengths), scale=self.run.scale, lengths=lengths)
        for packed, dest in zip(grads, (self.dq, self.dk, self.dv)):
            _unpack(pieces, packed, dest)

    def finish(self) -> None:
        for index, part in [(m.index, m) for part in (*self.rings.values(), *self.groups.values())
                            for m in part.members]:
            rows = self.pieces[index].rows
            self.dq[rows], self.dk[rows], self.dv[rows] = part.grads()


def _packed(pieces: list[Piece], *tensors: torch.Tensor) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """Rows of ``pieces`` packed back to back, and their lengths (host ints from
    the plan: kernels need no device read)."""
    lengths = tuple(p.rows.stop - p.rows.start for p in pieces)
    packed = [torch.cat([t[p.rows] for p in pieces]) if len(pieces) > 1 else t[pieces[0].rows]
              for t in tensors]
    return packed, lengths


def _unpack(pieces: list[Piece], packed: torch.Tensor, dest: torch.Tensor) -> None:
    row = 0
    for p in pieces:
        n = p.rows.stop - p.rows.start
        dest[p.rows] = packed[row:row + n]
        row += n


def _forward(run: "_Run", q, k, v) -> tuple[torch.Tensor, tuple]:
    binding = _ForwardBinding(run, q, k, v)
    _execute(run, run.layer.forward, binding)
    saved = binding.finish()
    return binding.out, (binding.local_lse, saved)


def _backward(run: "_Run", dout, q, k, v, out, state: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    local_lse, saved = state
    binding = _BackwardBinding(run, dout, q, k, v, out, saved, local_lse)
    _execute(run, run.layer.backward, binding)
    binding.finish()
    return binding.dq, binding.dk, binding.dv


class _PlanAttention(torch.autograd.Function):
    """Forward and backward schedules of one rank, executed by the communicator's lanes."""

    @staticmethod
    def forward(ctx, q, k, v, run: _Run):
        out, ctx.state = _forward(run, q, k, v)
        ctx.run = run
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors
        return (*_backward(ctx.run, dout.contiguous(), q, k, v, out, ctx.state), None)


def _execute(run: _Run, schedule: Schedule, binding: _Binding) -> None:
    if isinstance(run.comm, LaneCommunicator):     # every rank starts every call (tags count calls)
        run.comm.runner.run(schedule, binding, run.comm.recorder)
    else:                                          # no lanes to run transfers on: the plan must need none
        run_without_transfers(schedule, run.rank, binding)
