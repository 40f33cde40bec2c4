"""Discrete-event replay of a schedule: the simulator times exactly what the engine runs.

The replay executes the ops of ``schedule/`` with the engine's two lane rules
(``schedule/ops.py``) and cost-model durations:

* compute lane (one per rank): whenever free, the first op in lane order whose
  dependencies are done; attention ops last ``CostModel.attn_s`` of their pairs
  at their query-block efficiency, linear ops ``CostModel.linear_s`` of their
  tokens, per layer and pass;
* send lane (one per rank): transfers posted strictly in lane order, each once
  its data is there;
* links: every transfer holds its sender's egress port and its receiver's
  ingress port -- the GPU's NVLink inside a node, the NIC it leaves through and
  the NIC it enters across nodes -- for ``latency + bytes / bandwidth``; a port
  serves one transfer at a time, first posted first served.  Routed pieces are
  ops of their own (dispatch, NIC, combine), so their legs compete for NVLink
  and NICs like any other traffic.

A step is a chain of *segments* (a layer's attention, a layout switch, a
layer's linear work); a rank starts a segment when its own part of the
previous one is done.  :func:`replay_step` runs the layers one after another
and stops early once a layer repeats the previous one exactly (every rank's
start offset and duration equal), adding the remaining identical layers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO, LINEAR_BWD_RATIO, CostModel
from megatron_zeppelin.schedule.ops import COMM, Op, Schedule


@dataclass
class OpTiming:
    """When one op ran in the replay."""

    start_s: float
    end_s: float


@dataclass
class LaneState:
    """What carries over from one segment to the next."""

    world_size: int
    ready_s: list[float] = field(default_factory=list)
    """Per rank: when its previous segment was done (its next one may start)."""
    compute_free_s: list[float] = field(default_factory=list)
    """Per rank: when its compute lane is free."""
    last_post_s: list[float] = field(default_factory=list)
    """Per rank: when its last send was posted (sends are posted in order)."""
    ports: dict[tuple, float] = field(default_factory=dict)
    """Link port -> when it is free."""
    busy_s: dict[tuple[int, str], float] = field(default_factory=dict)
    """(rank, tier) -> compute seconds spent."""

    def __post_init__(self) -> None:
        for name in ("ready_s", "compute_free_s", "last_post_s"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * self.world_size)


def op_seconds(op: Op, cost: CostModel) -> float:
    """Cost-model duration of ``op`` (one layer, one pass)."""
    n = cost.model.num_layers
    if op.kind == COMM:
        topo = cost.cluster.topology
        link = cost.cluster.nic if op.nic is not None or not topo.same_node(op.rank, op.peer) \
            else cost.cluster.nvlink
        return link.transfer_s(op.nbytes)
    if op.tier == "linear":
        share = LINEAR_BWD_RATIO if op.backward else 1.0
        return cost.linear_s(op.tokens) * share / ((1 + LINEAR_BWD_RATIO) * n)
    share = ATTN_BWD_RATIO if op.backward else 1.0
    if op.lengths:
        seconds = sum(cost.local_attn_s(L) for L in op.lengths)
    else:
        seconds = cost.attn_s(op.pairs, op.block)
    return seconds * share / ((1 + ATTN_BWD_RATIO) * n)


def _ports(op: Op, cost: CostModel) -> tuple[tuple, tuple]:
    topo = cost.cluster.topology
    if topo.same_node(op.rank, op.peer):
        return ("nvl_out", op.rank), ("nvl_in", op.peer)
    src_nic = op.nic if op.nic is not None else topo.nic_of(op.rank)
    return (("nic_out", topo.node_of(op.rank), src_nic),
            ("nic_in", topo.node_of(op.peer), topo.nic_of(op.peer)))


def replay_segment(schedule: Schedule, cost: CostModel, state: LaneState,
                   timings: list[OpTiming] | None = None) -> None:
    """Run one segment from ``state`` and advance ``state`` past it.

    Ops with no dependency inside the segment start after their rank's
    ``ready_s`` (a transfer after its sender's).  ``timings``, when given,
    receives every op's start and end (index = op id)."""
    ops = schedule.ops
    n = len(ops)
    world = schedule.world_size
    if timings is not None:
        timings.extend(OpTiming(0.0, 0.0) for _ in range(n))
    waiting = [len(op.deps) for op in ops]
    ready_at = [0.0] * n
    done_at = [0.0] * n
    users: list[list[int]] = [[] for _ in range(n)]
    for op in ops:
        for d in op.deps:
            users[d].append(op.id)
    lanes = [schedule.lanes(r) for r in range(world)]
    sends = [[o.id for o in lanes[r].comm if o.rank == r] for r in range(world)]
    send_next = [0] * world
    compute_pos = {o.id: i for r in range(world) for i, o in enumerate(lanes[r].compute)}
    ready_compute: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # heap of (lane pos, op)
    data_ready = [False] * n
    events: list[tuple[float, int, int, int]] = []   # (time, order, kind, op or rank)
    seq = 0
    # event kinds: 0 op done, 1 op ready (deps met at a future time), 2 compute lane free
    DONE, READY, FREE = 0, 1, 2

    def push(t: float, kind: int, what: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, what))
        seq += 1

    for op in ops:
        if not op.deps:
            push(state.ready_s[op.rank], READY, op.id)
    compute_busy = [False] * world
    touched_end = list(state.ready_s)
    touched = [False] * world

    def start_compute(rank: int, t: float) -> None:
        if compute_busy[rank] or not ready_compute[rank]:
            return
        t = max(t, state.compute_free_s[rank])
        _, oid = heapq.heappop(ready_compute[rank])
        dur = op_seconds(ops[oid], cost)
        compute_busy[rank] = True
        end = t + dur
        state.compute_free_s[rank] = end
        key = (rank, ops[oid].tier)
        state.busy_s[key] = state.busy_s.get(key, 0.0) + dur
        if timings is not None:
            timings[oid] = OpTiming(t, end)
        push(end, DONE, oid)
        push(end, FREE, rank)

    def post_sends(rank: int, t: float) -> None:
        lane = sends[rank]
        while send_next[rank] < len(lane) and data_ready[lane[send_next[rank]]]:
            oid = lane[send_next[rank]]
            send_next[rank] += 1
            op = ops[oid]
            post = max(t, ready_at[oid], state.last_post_s[rank])
            state.last_post_s[rank] = post
            out, inn = _ports(op, cost)
            start = max(post, state.ports.get(out, 0.0), state.ports.get(inn, 0.0))
            end = start + op_seconds(op, cost)
            state.ports[out] = state.ports[inn] = end
            if timings is not None:
                timings[oid] = OpTiming(start, end)
            push(end, DONE, oid)

    while events:
        t, _, kind, what = heapq.heappop(events)
        if kind == FREE:
            compute_busy[what] = False
            start_compute(what, t)
            continue
        if kind == DONE:
            done_at[what] = t
            op = ops[what]
            for rank in ((op.peer,) if op.kind == COMM else (op.rank,)):
                touched[rank] = True
                touched_end[rank] = max(touched_end[rank], t) if touched[rank] else t
            for u in users[what]:
                waiting[u] -= 1
                ready_at[u] = max(ready_at[u], t)
                if waiting[u] == 0:
                    push(ready_at[u], READY, u)
            continue
        op = ops[what]                                  # READY
        ready_at[what] = max(ready_at[what], t)
        if op.kind == COMM:
            data_ready[what] = True
            post_sends(op.rank, t)
        else:
            heapq.heappush(ready_compute[op.rank], (compute_pos[what], what))
            start_compute(op.rank, t)
    unfinished = [o.id for o in ops if waiting[o.id] > 0]
    if unfinished:
        raise RuntimeError(f"replay: ops {unfinished[:8]} never became ready")
    for r in range(world):
        if touched[r]:
            state.ready_s[r] = max(touched_end[r], state.ready_s[r])


@dataclass
class StepReplay:
    """A step replayed segment by segment."""

    step_s: float
    """When the slowest rank finished its last segment."""
    finish_s: list[float]
    """Per rank: when it finished."""
    busy_s: dict[tuple[int, str], float]
    """(rank, tier) -> compute seconds."""
    segment_s: dict[str, list[float]]
    """Part name (``attn``, ``to_linear``, ...) -> per-rank seconds spent in it."""
    layers_replayed: int
    """Layers run event by event (the rest repeated the last one exactly)."""


def replay_step(parts: Sequence[tuple[str, Schedule, Schedule]], num_layers: int, cost: CostModel,
                world_size: int, *, extrapolate: bool = True) -> StepReplay:
    """Replay ``num_layers`` layers of ``parts`` forward, then backward in reverse.

    ``parts``: ``(name, forward segment, backward segment)`` in forward order.
    With ``extrapolate``, once a layer took every rank the same time, equal to
    the previous layer's (the step is in lockstep and periodic), the remaining
    layers of that pass are added instead of replayed: each would start every
    rank, lane and port exactly one period later and repeat the same events."""
    state = LaneState(world_size)
    segment_s: dict[str, list[float]] = {name: [0.0] * world_size for name, _, _ in parts}
    replayed = 0
    for backward in (False, True):
        order = list(reversed(parts)) if backward else list(parts)
        previous: list[float] | None = None
        layer = 0
        while layer < num_layers:
            start, busy_before = list(state.ready_s), dict(state.busy_s)
            shares: dict[str, list[float]] = {}
            for name, fwd, bwd in order:
                before = list(state.ready_s)
                replay_segment(bwd if backward else fwd, cost, state)
                shares[name] = [state.ready_s[r] - before[r] for r in range(world_size)]
                for r in range(world_size):
                    segment_s[name][r] += shares[name][r]
            replayed += 1
            layer += 1
            took = [e - s for s, e in zip(start, state.ready_s)]
            if extrapolate and previous is not None and layer < num_layers and _periodic(took, previous):
                _repeat(state, segment_s, shares, busy_before, took[0], num_layers - layer)
                layer = num_layers
            previous = took
    return StepReplay(max(state.ready_s), list(state.ready_s), dict(state.busy_s), segment_s, replayed)


def _periodic(took: list[float], previous: list[float]) -> bool:
    period = took[0]
    tol = 1e-12 + 1e-9 * abs(period)
    return all(abs(x - period) <= tol for x in took) and all(abs(x - period) <= tol for x in previous)


def _repeat(state: LaneState, segment_s: dict[str, list[float]], shares: dict[str, list[float]],
            busy_before: dict[tuple[int, str], float], period: float, times: int) -> None:
    """Add ``times`` more layers identical to the last one: every clock moves on by
    ``times`` periods, and every share of time is counted ``times`` more."""
    shift = period * times
    for clocks in (state.ready_s, state.compute_free_s, state.last_post_s):
        for r in range(state.world_size):
            clocks[r] += shift
    for port in state.ports:
        state.ports[port] += shift
    for key, total in list(state.busy_s.items()):
        state.busy_s[key] = total + (total - busy_before.get(key, 0.0)) * times
    for name, per_rank in shares.items():
        for r, x in enumerate(per_rank):
            segment_s[name][r] += x * times
