"""Discrete-event replay of a schedule: the simulator times exactly what the engine runs.

The replay executes the ops of ``schedule/`` with the engine's lane rules
(``schedule/ops.py``) and cost-model durations:

* compute lane (one per rank): whenever free, the first op in lane order whose
  dependencies are done; attention ops last ``CostModel.attn_s`` of their pairs
  at their query-block efficiency, linear ops ``CostModel.linear_s`` of their
  tokens, per layer and pass;
* communication lanes (two per rank, one per link class: NVLink inside a
  node, a NIC across nodes): each posts the rank's transfers a wave at a time
  (``Schedule.waves``), a wave's sends and receives as one batch, once every
  send of the batch has its data; a transfer starts once the batches of both
  its ends are posted; a batch is done when all its transfers are, and only
  then does what it received count as landed (what a compute op or a
  forwarding hop waits for) and does its lane post the next batch -- as NCCL
  runs the engine's batches (``comm/lanes.py``: one grouped kernel per batch
  on the lane's stream, one completion for all of it);
* links: every transfer goes out through its sender's egress port and in
  through its receiver's ingress port -- the GPU's NVLink inside a node, the
  NIC it leaves through and the NIC it enters across nodes -- for ``latency +
  bytes / bandwidth`` on each.  NCCL runs a batch's sends and receives together
  (one grouped kernel, ``comm/p2p.py``), so the transfers on a port share its
  bandwidth and the port is never idle while one of them has bytes left: each
  port carries the transfers charged to it back to back, in the order they
  start (both ends posted), from when each starts, and a transfer has moved
  once both of its ports have carried it.  So an all-to-all (a Ulysses group's,
  overlapping groups on shared ranks) is done when its busiest port has moved
  its bytes, whatever its message sizes; booking each transfer into a window
  where both ports were exclusively free fragmented the windows when messages
  differed by as little as one token (1.1-1.7x the busiest port's load).  A
  ring's wave puts one transfer on each port and starts it at once, as before.
  Routed pieces are ops of their own (dispatch, NIC, combine), so their legs
  compete for NVLink and NICs like any other traffic.

A step is a chain of *segments*, one per engine call (a layer's attention, a
layout switch) plus the linear work between them.  As in the engine, a rank
enters a segment when its part of the previous one is done (every op on its
lanes), and a transfer starts only once both of its ends have entered (a
receive is posted when its call starts).  All segments of the step run in one
event loop, so ranks at different layers share links in time order.  A
segment is compiled once (durations, ports, dependency lists, as flat arrays)
and reused by every layer; the event loop itself is compiled
(``sim/event_loop.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO, LINEAR_BWD_RATIO, CostModel
from megatron_zeppelin.plan.shards import causal_pairs
from megatron_zeppelin.schedule.ops import TIERS, Schedule
from megatron_zeppelin.sim.event_loop import run_chains


@dataclass
class OpTiming:
    """When one op ran in the replay."""

    start_s: float
    end_s: float


def work_seconds(works: Sequence[tuple], cost: CostModel) -> np.ndarray:
    """Cost-model duration (one layer, one pass) of each compute op's fields
    ``(tier, backward, tokens, pairs, block, lengths)`` in ``works``, then a 0.0.

    Attention is priced in one ``CostModel.attn_s`` over arrays (elementwise the
    scalar's float operations, bit for bit); a work of whole local sequences
    (``lengths``) sums theirs in order, as ``sum`` over the scalar answers."""
    n = cost.model.num_layers
    out = np.zeros(len(works) + 1)
    attn, whole = [], []                     # attention by pairs; by whole sequences
    for i, (tier, backward, tokens, _, _, lengths) in enumerate(works):
        if tier == "linear":
            share = LINEAR_BWD_RATIO if backward else 1.0
            out[i] = cost.linear_s(tokens) * share / ((1 + LINEAR_BWD_RATIO) * n)
        else:
            (whole if lengths else attn).append(i)
    if attn:
        out[attn] = cost.attn_s(np.array([works[i][3] for i in attn]), np.array([works[i][4] for i in attn]))
    if whole:
        length = np.array([L for i in whole for L in works[i][5]])
        each = cost.attn_s(causal_pairs(0, length), length).tolist()
        at = 0
        for i in whole:
            out[i] = sum(each[at:at + len(works[i][5])])
            at += len(works[i][5])
    if attn or whole:
        priced = attn + whole
        share = np.where([works[i][1] for i in priced], ATTN_BWD_RATIO, 1.0)
        out[priced] = out[priced] * share / ((1 + ATTN_BWD_RATIO) * n)
    return out


class CompiledSegment:
    """A schedule's ops as flat arrays, for replaying it many times
    (``sim/event_loop.py`` reads them; ids are positions in ``schedule.ops``).
    Read from the schedule's columns, without making its ops."""

    def __init__(self, schedule: Schedule, cost: CostModel, name: str = "") -> None:
        world = schedule.world_size
        topo = cost.cluster.topology
        cols = schedule.arrays()
        self.name = name
        self.n = n = len(schedule)
        self.is_comm, self.rank, self.peer, self.ndeps = cols.is_comm, cols.rank, cols.peer, cols.ndeps
        dep = cols.dep
        # Who depends on each op, in op order (the order the replay releases them).
        user = np.repeat(np.arange(n, dtype=np.int64), self.ndeps)
        by_dep = np.argsort(dep, kind="stable")
        self.users_idx = user[by_dep]
        self.users_ptr = _offsets(dep, n)
        # Which ends of a transfer have a dependant on their rank (bit 0: its
        # sender, bit 1: its receiver): only those release anything when it lands.
        needed = dep[by_dep]
        self.lands = np.zeros(n, np.int64)
        np.bitwise_or.at(self.lands, needed, np.where(self.rank[self.users_idx] == self.rank[needed], 1, 0)
                         | np.where(self.rank[self.users_idx] == self.peer[needed], 2, 0))
        ids = np.arange(n, dtype=np.int64)
        compute = ids[~self.is_comm]
        comm = ids[self.is_comm]
        self.tier = cols.tier                      # a compute op's: the replay sums busy time by it
        # Many compute ops share their fields (a ring's steps over equal shards,
        # equal linear shares): each distinct set of fields is priced once.
        self.seconds = work_seconds(cols.works, cost)[cols.work]   # a transfer's (-1: the 0.0) is set below
        # A transfer holds NVLink inside a node, else a NIC: the one the op names
        # (a routed leg), or its sender's.  Durations and ports for all at once.
        gpn, nics = topo.gpus_per_node, topo.nics_per_node
        affinity = np.array(topo.nic_affinity, np.int64)
        src, dst = self.rank[comm], self.peer[comm]
        named = cols.nic[comm]                                            # -1: no NIC named
        nbytes = cols.nbytes[comm].astype(np.float64)
        inside = src // gpn == dst // gpn
        nvlink = inside & (named < 0)
        self.seconds[comm] = np.where(nvlink, cost.cluster.nvlink.transfer_s(nbytes),
                                      cost.cluster.nic.transfer_s(nbytes))
        nic_out = np.where(named >= 0, named, affinity[src % gpn])
        out = np.full(n, -1, np.int64)
        inn = np.full(n, -1, np.int64)
        out[comm] = np.where(inside, 2 * src, 2 * world + 2 * ((src // gpn) * nics + nic_out))
        inn[comm] = np.where(inside, 2 * dst + 1, 2 * world + 2 * ((dst // gpn) * nics + affinity[dst % gpn]) + 1)
        self.port_out, self.port_in = out, inn
        # A compute op's place in its rank's lane (lanes run in op order).
        self.lane_pos = np.zeros(n, np.int64)
        crank = self.rank[compute]
        order = np.argsort(crank, kind="stable")
        first = _offsets(crank, world)
        self.lane_pos[compute[order]] = np.arange(len(compute)) - np.repeat(first[:-1], np.diff(first))
        # Communication lanes, as the engine runs them (``comm/lanes.py``): per
        # rank, one lane per link class (0: intra-node, 1: through a NIC), each
        # a sequence of batches -- the rank's transfers (sent or received) of
        # one wave, posted together and done together.  Batches are numbered
        # by (rank, lane, wave), so a (rank, lane)'s batches are consecutive.
        link = (named >= 0).astype(np.int64)           # ``schedule.ops.lane_of``: a NIC named
        wave = cols.wave[comm]
        side_rank = np.concatenate([src, dst])
        side_lane = np.concatenate([link, link])
        side_wave = np.concatenate([wave, wave])
        side_op = np.concatenate([comm, comm])
        side_sends = np.concatenate([np.ones(len(comm), np.int64), np.zeros(len(comm), np.int64)])
        waves = int(wave.max(initial=0)) + 1
        key = (side_rank * 2 + side_lane) * waves + side_wave        # (rank, lane, wave), then op: unique
        order = np.argsort(key * n + side_op)
        key = key[order]
        first = np.ones(len(order), np.bool_)
        first[1:] = key[1:] != key[:-1]
        batch_of = np.cumsum(first) - 1                     # each sorted side's batch
        self.n_batches = nb = int(first.sum())
        self.bat_idx = side_op[order]
        self.bat_ptr = np.concatenate([np.flatnonzero(first), [len(order)]]).astype(np.int64)
        self.bat_need = np.bincount(batch_of, weights=side_sends[order], minlength=nb).astype(np.int64)
        self.rl_ptr = _offsets(key[first] // waves, 2 * world)
        side_batch = np.empty(len(order), np.int64)
        side_batch[order] = batch_of
        self.op_lane = np.zeros(n, np.int64)
        self.op_lane[comm] = link
        self.op_bsend = np.full(n, -1, np.int64)
        self.op_brecv = np.full(n, -1, np.int64)
        self.op_bsend[comm] = side_batch[:len(comm)]
        self.op_brecv[comm] = side_batch[len(comm):]
        # Every op on a rank's lanes: its compute lane, then its transfers (sent or received).
        who = np.concatenate([crank, src, dst])
        lane = np.concatenate([np.zeros(len(compute), np.int64), np.ones(2 * len(comm), np.int64)])
        what = np.concatenate([compute, comm, comm])
        order = np.argsort((who * 2 + lane) * n + what)            # unique: a transfer's ends differ
        self.onr_idx = what[order]
        self.onr_ptr = _offsets(who, world)
        self.lane_width = int(np.bincount(crank, minlength=1).max()) if len(compute) else 1
        self.n_ports = int(max(out.max(initial=-1), inn.max(initial=-1))) + 1


def _offsets(keys: np.ndarray, n: int) -> np.ndarray:
    """CSR offsets of ``keys`` grouped into ``0 .. n - 1``."""
    return np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=n))]).astype(np.int64)


@dataclass
class ChainReplay:
    """A chain of segments replayed in one event loop."""

    finish_s: list[float]
    """Per rank: when it left the last segment."""
    busy_s: dict[tuple[int, str], float]
    """(rank, tier) -> compute seconds, in the order each was first used."""
    inside_s: np.ndarray
    """``inside_s[k, r]``: time rank ``r`` spent in segment ``k`` (enter to leave)."""
    timings: list[list[OpTiming]] | None
    """Per segment, every op's start and end (when asked for)."""

    @property
    def step_s(self) -> float:
        return max(self.finish_s, default=0.0)


class SegmentSet:
    """Distinct segments laid end to end: the static arrays ``run_chains`` reads
    (op ``i`` of segment ``s`` at ``seg_base[s] + i``), built once for every
    chain of them (``replay_step`` replays two)."""

    def __init__(self, segs: Sequence[CompiledSegment]) -> None:
        self.index = {id(seg): s for s, seg in enumerate(segs)}
        seg_base = np.concatenate([[0], np.cumsum([seg.n for seg in segs])]).astype(np.int64)

        def joined(field: str) -> np.ndarray:
            return np.concatenate([getattr(seg, field) for seg in segs])

        def csr(ptr: str, size) -> np.ndarray:
            """Segments' CSR offsets joined: each shifted by the ``size`` of the ones before."""
            ptrs, shift = [np.zeros(1, np.int64)], 0
            for seg in segs:
                ptrs.append(getattr(seg, ptr)[1:] + shift)
                shift += size(seg)
            return np.concatenate(ptrs)

        def rows(idx: str) -> tuple[np.ndarray, np.ndarray]:
            return csr(f"{idx[:-4]}_ptr", lambda seg: len(getattr(seg, idx))), joined(idx)

        # Batch ids made global over the distinct segments (``bat_base[s]`` is segment s's first).
        bat_base = np.concatenate([[0], np.cumsum([seg.n_batches for seg in segs])]).astype(np.int64)

        def batch_ids(field: str) -> np.ndarray:
            return np.concatenate([np.where(getattr(seg, field) >= 0, getattr(seg, field) + bat_base[s], -1)
                                   for s, seg in enumerate(segs)])

        users_ptr, users_idx = rows("users_idx")
        onr_ptr, onr_idx = rows("onr_idx")
        bat_ptr, bat_idx = rows("bat_idx")
        rl_ptr = csr("rl_ptr", lambda seg: seg.n_batches)
        self.arrays = (
            seg_base, joined("is_comm"), joined("rank"), joined("peer"), joined("tier"), joined("seconds"),
            joined("ndeps"), users_ptr, users_idx, joined("port_out"), joined("port_in"), joined("lane_pos"),
            max(seg.lane_width for seg in segs), onr_ptr, onr_idx, joined("op_lane"), joined("lands"),
            batch_ids("op_bsend"), batch_ids("op_brecv"), bat_base, bat_ptr, bat_idx, joined("bat_need"), rl_ptr,
            len(TIERS), max(max(seg.n_ports for seg in segs), 1))
        """The static arrays ``run_chains`` reads, in ``event_loop._start``'s order."""


def replay_chain(chain: Sequence[CompiledSegment], world: int, *, record: bool = False,
                 segments: SegmentSet | None = None) -> ChainReplay:
    """Replay ``chain`` from time 0 (every rank enters segment 0 at once);
    ``segments``: its distinct segments, laid out already."""
    return replay_chains([chain], world, record=record, segments=segments)[0]


def replay_chains(chains: Sequence[Sequence[CompiledSegment]], world: int, *, record: bool = False,
                  segments: SegmentSet | None = None) -> list[ChainReplay]:
    """Replay each of ``chains`` from time 0, as :func:`replay_chain` does; the
    instances they begin with alike are replayed once (``event_loop.run_chains``).
    ``segments``: their distinct segments, laid out already."""
    if segments is None:
        segments = SegmentSet(list({id(seg): seg for chain in chains for seg in chain}.values()))
    chain_segs = [np.array([segments.index[id(seg)] for seg in chain], np.int64) for chain in chains]
    return [_chain_replay(len(chain), record, *out)
            for chain, out in zip(chains, run_chains(world, chain_segs, segments.arrays, record))]


def _chain_replay(n_inst: int, record: bool, finish, busy, order, entered, left, start, end, base, remaining,
                  created) -> ChainReplay:
    if not created.all() or (remaining > 0).any():
        stuck = [(k, r) for k, r in zip(*np.nonzero(remaining > 0)) if created[k]]
        raise RuntimeError(f"replay: segment/rank pairs {stuck[:6]} never finished")
    ranks, tiers = np.nonzero(order >= 0)
    first = np.argsort(order[ranks, tiers])            # in first-use order (each order is used once)
    ranks, tiers = ranks[first], tiers[first]
    busy_s = dict(zip(zip(ranks.tolist(), [TIERS[t] for t in tiers.tolist()]), busy[ranks, tiers].tolist()))
    inside = left - entered
    timings = None
    if record:
        starts, ends = start.tolist(), end.tolist()
        timings = [[OpTiming(s, e) for s, e in zip(starts[base[k]:base[k + 1]], ends[base[k]:base[k + 1]])]
                   for k in range(n_inst)]
    return ChainReplay(finish.tolist(), busy_s, inside, timings)


def replay_schedule(schedule: Schedule, cost: CostModel) -> ChainReplay:
    """Replay one schedule (every op's timing recorded, by its id in ``schedule``).
    A whole step's schedule (``Schedule.calls``) replays as the chain of its
    engine calls, as the engine runs them: each call's waves on their own."""
    if schedule.calls is None:
        return replay_chain([CompiledSegment(schedule, cost)], schedule.world_size, record=True)
    calls = schedule.calls_apart()
    chain = replay_chain([CompiledSegment(part, cost) for part, _ in calls], schedule.world_size, record=True)
    timings: list[OpTiming] = [OpTiming(0.0, 0.0)] * len(schedule)
    for (_, ids), timed in zip(calls, chain.timings):
        for i, t in zip(ids, timed):
            timings[i] = t
    return ChainReplay(chain.finish_s, chain.busy_s, chain.inside_s, [timings])


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

    segments = SegmentSet(fwd + bwd)

    def run(*depths: int) -> list[StepReplay]:
        chains = [fwd * layers + list(reversed(bwd)) * layers for layers in depths]
        out = []
        for chain, result in zip(chains, replay_chains(chains, world_size, segments=segments)):
            inside = {name: np.zeros(world_size) for name in names}
            for seg, row in zip(chain, result.inside_s):      # per rank, a sum in chain order
                inside[seg.name] += row
            segment_s = {name: x.tolist() for name, x in inside.items()}
            out.append(StepReplay(result.step_s, result.finish_s, result.busy_s, segment_s))
        return out

    m = max(replayed_layers, 2)
    if exact or num_layers <= m:
        return run(num_layers)[0]
    small, big = run(m - 1, m)        # their first m - 1 forward layers replay once
    extra = num_layers - m

    def grow(a: float, b: float) -> float:
        return a + (a - b) * extra

    finish = [grow(a, b) for a, b in zip(big.finish_s, small.finish_s)]
    busy = {key: grow(v, small.busy_s.get(key, 0.0)) for key, v in big.busy_s.items()}
    segment_s = {name: [grow(a, b) for a, b in zip(big.segment_s[name], small.segment_s[name])]
                 for name in names}
    return StepReplay(max(finish), finish, busy, segment_s)
