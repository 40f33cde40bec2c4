"""Discrete-event replay of a schedule: the simulator times exactly what the engine runs.

The replay executes the ops of ``schedule/`` with the engine's lane rules
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
  serves one transfer at a time.  A transfer takes the earliest window, from
  its post on, in which both of its ports are free: a port waiting for a busy
  peer is not held idle meanwhile (packets of other transfers use it), which
  matters for all-to-alls, where a port-by-port queue would convoy.  Routed
  pieces are ops of their own (dispatch, NIC, combine), so their legs compete
  for NVLink and NICs like any other traffic.

A step is a chain of *segments*, one per engine call (a layer's attention, a
layout switch) plus the linear work between them.  As in the engine, a rank
enters a segment when its part of the previous one is done (every op on its
lanes), and a transfer starts only once both of its ends have entered (a
receive is posted when its call starts).  All segments of the step run in one
event loop, so ranks at different layers share links in time order.  A
segment is compiled once (durations, ports, dependency lists) and reused by
every layer.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO, LINEAR_BWD_RATIO, CostModel
from megatron_zeppelin.schedule.ops import COMM, Op, Schedule


@dataclass
class OpTiming:
    """When one op ran in the replay."""

    start_s: float
    end_s: float


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


class CompiledSegment:
    """A schedule's ops as flat arrays, for replaying it many times."""

    def __init__(self, schedule: Schedule, cost: CostModel, name: str = "") -> None:
        ops = schedule.ops
        world = schedule.world_size
        topo = cost.cluster.topology
        self.name = name
        self.n = len(ops)
        self.is_comm = [op.kind == COMM for op in ops]
        self.rank = [op.rank for op in ops]
        self.peer = [op.peer for op in ops]
        self.tier = [op.tier for op in ops]
        self.seconds = [op_seconds(op, cost) for op in ops]
        self.ndeps = [len(op.deps) for op in ops]
        self.users: list[list[int]] = [[] for _ in ops]
        for op in ops:
            for d in op.deps:
                self.users[d].append(op.id)
        self.ports: list[tuple[int, int]] = []
        for op in ops:
            if op.kind != COMM:
                self.ports.append((-1, -1))
            elif topo.same_node(op.rank, op.peer):
                self.ports.append((2 * op.rank, 2 * op.peer + 1))
            else:
                nic = op.nic if op.nic is not None else topo.nic_of(op.rank)
                out = topo.node_of(op.rank) * topo.nics_per_node + nic
                inn = topo.node_of(op.peer) * topo.nics_per_node + topo.nic_of(op.peer)
                self.ports.append((2 * world + 2 * out, 2 * world + 2 * inn + 1))
        lanes = [schedule.lanes(r) for r in range(world)]
        self.sends = [[o.id for o in lanes[r].comm if o.rank == r] for r in range(world)]
        self.lane_pos = [0] * self.n
        for r in range(world):
            for i, o in enumerate(lanes[r].compute):
                self.lane_pos[o.id] = i
        self.on_rank = [[o.id for o in (*lanes[r].compute, *lanes[r].comm)] for r in range(world)]
        self.touch = [len(ids) for ids in self.on_rank]


@dataclass
class ChainReplay:
    """A chain of segments replayed in one event loop."""

    finish_s: list[float]
    """Per rank: when it left the last segment."""
    busy_s: dict[tuple[int, str], float]
    """(rank, tier) -> compute seconds."""
    inside_s: list[list[float]]
    """``inside_s[k][r]``: time rank ``r`` spent in segment ``k`` (enter to leave)."""
    timings: list[list[OpTiming]] | None
    """Per segment, every op's start and end (when asked for)."""

    @property
    def step_s(self) -> float:
        return max(self.finish_s, default=0.0)


class _Ports:
    """Busy intervals of every port; a booking takes the earliest common free window.

    A port's intervals never overlap (it serves one transfer at a time), so
    sorted by start they are sorted by end too: the first interval that could
    collide with a window is found by bisecting the ends."""

    def __init__(self) -> None:
        self.starts: dict[int, list[float]] = {}
        self.ends: dict[int, list[float]] = {}

    def book(self, a: int, b: int, t: float, dur: float) -> float:
        ports = [self._prune(a, t), self._prune(b, t)]
        start = t
        clear = 0                      # ports in a row found free at ``start``
        p = 0
        while clear < 2:               # move past the interval of either port that overlaps
            starts, ends = ports[p]
            i = bisect.bisect_right(ends, start)
            if i < len(ends) and starts[i] < start + dur:
                start = ends[i]        # this port again from there, then the other
                clear = 0
            else:
                clear += 1
                p ^= 1
        end = start + dur
        for starts, ends in ports:
            i = bisect.bisect_right(ends, start)    # after every interval that ends by ``start``
            # Touching intervals merge, so a port busy back to back is one interval
            # and a later booking jumps it in one step.
            joins_before = i > 0 and ends[i - 1] == start
            joins_after = i < len(starts) and starts[i] == end
            if joins_before and joins_after:
                ends[i - 1] = ends[i]
                del starts[i], ends[i]
            elif joins_before:
                ends[i - 1] = end
            elif joins_after:
                starts[i] = start
            else:
                starts.insert(i, start)
                ends.insert(i, end)
        return start

    def _prune(self, port: int, t: float) -> tuple[list[float], list[float]]:
        starts = self.starts.setdefault(port, [])
        ends = self.ends.setdefault(port, [])
        cut = bisect.bisect_right(ends, t)          # nothing can be booked before now
        if cut:
            del starts[:cut], ends[:cut]
        return starts, ends


class _Instance:
    """One segment of the chain in flight."""

    __slots__ = ("seg", "waiting", "ready_at", "entered", "left", "remaining", "data_ready", "next_send",
                 "released", "timings")

    def __init__(self, seg: CompiledSegment, world: int, record: bool) -> None:
        self.seg = seg
        self.waiting = list(seg.ndeps)
        self.ready_at = [0.0] * seg.n
        self.entered = [-1.0] * world
        self.left = [0.0] * world
        self.remaining = list(seg.touch)
        self.data_ready = [False] * seg.n
        self.next_send = [0] * world
        self.released = [False] * seg.n
        self.timings = [OpTiming(0.0, 0.0) for _ in range(seg.n)] if record else None


def replay_chain(chain: Sequence[CompiledSegment], world: int, *, record: bool = False) -> ChainReplay:
    """Replay ``chain`` from time 0 (every rank enters segment 0 at once)."""
    READY, DONE, FREE, ENTER = 0, 1, 2, 3
    events: list[tuple[float, int, int, int, int]] = []    # (time, order, kind, segment, op or rank)
    counter = [0]

    def push(t: float, kind: int, k: int, what: int) -> None:
        counter[0] += 1
        heapq.heappush(events, (t, counter[0], kind, k, what))

    insts: list[_Instance | None] = [None] * len(chain)
    ports = _Ports()
    compute_free = [0.0] * world
    compute_busy = [False] * world
    compute_heap: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]  # (segment, lane pos, op)
    send_queue: list[list[int]] = [[] for _ in range(world)]   # segments with unposted sends, in order
    last_post = [0.0] * world
    busy: dict[tuple[int, str], float] = {}
    finish = [0.0] * world

    def inst(k: int) -> _Instance:
        if insts[k] is None:
            insts[k] = _Instance(chain[k], world, record)
        return insts[k]

    def entered(i: _Instance, op: int) -> bool:
        seg = i.seg
        if seg.is_comm[op]:
            return i.entered[seg.rank[op]] >= 0 and i.entered[seg.peer[op]] >= 0
        return i.entered[seg.rank[op]] >= 0

    def release(k: int, i: _Instance, op: int, t: float) -> None:
        if not i.released[op] and i.waiting[op] == 0 and entered(i, op):
            i.released[op] = True
            push(max(t, i.ready_at[op]), READY, k, op)

    def enter(k: int, r: int, t: float) -> None:
        while k < len(chain):
            i = inst(k)
            i.entered[r] = t
            if i.seg.touch[r]:
                if i.seg.sends[r]:
                    send_queue[r].append(k)
                for op in i.seg.on_rank[r]:         # a transfer needs both ends entered
                    release(k, i, op, t)
                return
            i.left[r] = t                            # nothing of ours here: pass straight through
            k += 1
        finish[r] = t

    def start_compute(r: int, t: float) -> None:
        if compute_busy[r] or not compute_heap[r]:
            return
        k, _, op = heapq.heappop(compute_heap[r])
        i = insts[k]
        t = max(t, compute_free[r])
        dur = i.seg.seconds[op]
        compute_busy[r] = True
        compute_free[r] = t + dur
        key = (r, i.seg.tier[op])
        busy[key] = busy.get(key, 0.0) + dur
        if i.timings is not None:
            i.timings[op] = OpTiming(t, t + dur)
        push(t + dur, DONE, k, op)
        push(t + dur, FREE, -1, r)

    def post_sends(r: int, t: float) -> None:
        queue = send_queue[r]
        while queue:
            k = queue[0]
            i = insts[k]
            lane = i.seg.sends[r]
            while i.next_send[r] < len(lane) and i.data_ready[lane[i.next_send[r]]]:
                op = lane[i.next_send[r]]
                i.next_send[r] += 1
                post = max(t, last_post[r])
                last_post[r] = post
                out, inn = i.seg.ports[op]
                start = ports.book(out, inn, post, i.seg.seconds[op])
                end = start + i.seg.seconds[op]
                if i.timings is not None:
                    i.timings[op] = OpTiming(start, end)
                push(end, DONE, k, op)
            if i.next_send[r] < len(lane):
                return
            queue.pop(0)

    def leave_if_done(k: int, i: _Instance, r: int, t: float) -> None:
        i.remaining[r] -= 1
        if i.remaining[r] == 0:
            i.left[r] = t
            push(t, ENTER, k + 1, r)

    for r in range(world):
        enter(0, r, 0.0)
    while events:
        t, _, kind, k, what = heapq.heappop(events)
        if kind == FREE:
            compute_busy[what] = False
            start_compute(what, t)
        elif kind == ENTER:
            enter(k, what, t)
        elif kind == READY:
            i = insts[k]
            seg = i.seg
            if seg.is_comm[what]:
                i.data_ready[what] = True
                post_sends(seg.rank[what], t)
            else:
                r = seg.rank[what]
                heapq.heappush(compute_heap[r], (k, seg.lane_pos[what], what))
                start_compute(r, t)
        else:                                                    # DONE
            i = insts[k]
            seg = i.seg
            for u in seg.users[what]:
                i.waiting[u] -= 1
                if i.ready_at[u] < t:
                    i.ready_at[u] = t
                release(k, i, u, t)
            leave_if_done(k, i, seg.rank[what], t)
            if seg.is_comm[what]:
                leave_if_done(k, i, seg.peer[what], t)
    stuck = [(k, r) for k, i in enumerate(insts) if i is not None for r in range(world) if i.remaining[r] > 0]
    if stuck or any(i is None for i in insts):
        raise RuntimeError(f"replay: segment/rank pairs {stuck[:6]} never finished")
    inside = [[i.left[r] - i.entered[r] for r in range(world)] for i in insts]
    timings = [i.timings for i in insts] if record else None
    return ChainReplay(finish, busy, inside, timings)


def replay_schedule(schedule: Schedule, cost: CostModel) -> ChainReplay:
    """Replay one schedule (every op's timing recorded)."""
    return replay_chain([CompiledSegment(schedule, cost)], schedule.world_size, record=True)


@dataclass
class StepReplay:
    """A step replayed as its chain of segments."""

    step_s: float
    """When the slowest rank finished its last segment."""
    finish_s: list[float]
    """Per rank: when it finished."""
    busy_s: dict[tuple[int, str], float]
    """(rank, tier) -> compute seconds."""
    segment_s: dict[str, list[float]]
    """Part name (``attn``, ``to_linear``, ...) -> per-rank seconds spent in it."""


#: Layers a step replays event by event before it extrapolates (``replay_step``).
REPLAYED_LAYERS = 4


def replay_step(parts: Sequence[tuple[str, Schedule, Schedule]], num_layers: int, cost: CostModel,
                world_size: int, *, exact: bool = False, replayed_layers: int = REPLAYED_LAYERS) -> StepReplay:
    """Replay ``num_layers`` layers of ``parts`` forward, then backward in reverse.

    ``parts``: ``(name, forward segment, backward segment)`` in forward order.
    Every layer runs the same ops, so after a few layers a step settles into a
    period: unless ``exact``, a deeper model replays steps of ``m`` and ``m - 1``
    layers (``m`` = ``replayed_layers``, at least 2) and adds the difference -- one
    layer's forward and backward in steady state -- for each layer beyond ``m``.
    That is exact once the pattern repeats within ``m - 1`` layers; ``exact``
    replays every layer (what ``sim --plan`` and trace replays do)."""
    fwd = [CompiledSegment(f, cost, name) for name, f, _ in parts]
    bwd = [CompiledSegment(b, cost, name) for name, _, b in parts]
    names = [name for name, _, _ in parts]

    def run(layers: int) -> StepReplay:
        chain = fwd * layers + list(reversed(bwd)) * layers
        result = replay_chain(chain, world_size)
        segment_s = {name: [0.0] * world_size for name in names}
        for seg, inside in zip(chain, result.inside_s):
            for r, x in enumerate(inside):
                segment_s[seg.name][r] += x
        return StepReplay(result.step_s, result.finish_s, result.busy_s, segment_s)

    m = max(replayed_layers, 2)
    if exact or num_layers <= m:
        return run(num_layers)
    big, small = run(m), run(m - 1)
    extra = num_layers - m

    def grow(a: float, b: float) -> float:
        return a + (a - b) * extra

    finish = [grow(a, b) for a, b in zip(big.finish_s, small.finish_s)]
    busy = {key: grow(v, small.busy_s.get(key, 0.0)) for key, v in big.busy_s.items()}
    segment_s = {name: [grow(a, b) for a, b in zip(big.segment_s[name], small.segment_s[name])]
                 for name in names}
    return StepReplay(max(finish), finish, busy, segment_s)
