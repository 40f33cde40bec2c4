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
segment is compiled once (its durations, ``CompiledSegment``) and the distinct
segments of a step are laid out together (ports, dependants, lanes and batches
as flat arrays, ``SegmentSet``), which every layer reuses; the event loop
itself is compiled (``sim/event_loop.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numba import njit

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO, LINEAR_BWD_RATIO, CostModel
from megatron_zeppelin.plan.shards import causal_pairs
from megatron_zeppelin.schedule.ops import TIERS, OpArrays, Schedule
from megatron_zeppelin.sim.event_loop import run_chains


@dataclass
class OpTiming:
    """When one op ran in the replay."""

    start_s: float
    end_s: float


def work_seconds(cols: OpArrays, cost: CostModel) -> np.ndarray:
    """Cost-model duration (one layer, one pass) of each distinct compute work
    of ``cols`` (``OpArrays.work``), then a 0.0.

    Attention is priced in one ``CostModel.attn_s`` over arrays (elementwise the
    scalar's float operations, bit for bit): a work's pairs in its query block,
    or each of its whole local sequences (``lengths``), which it sums in order
    (as ``sum`` over the scalar answers)."""
    n = cost.model.num_layers
    linear, backward = cols.work_linear, cols.work_backward
    out = np.zeros(len(linear) + 1)
    priced = np.flatnonzero(linear).tolist()
    tokens, back = cols.work_tokens, backward.tolist()
    for i in priced:
        out[i] = cost.linear_s(tokens[i]) * (LINEAR_BWD_RATIO if back[i] else 1.0) / ((1 + LINEAR_BWD_RATIO) * n)
    if len(priced) < len(linear):
        attn = np.flatnonzero(~linear & (cols.work_nlengths == 0))     # priced by pairs
        whole = np.flatnonzero(~linear & (cols.work_nlengths > 0))     # by whole sequences
        length = cols.work_lengths
        seconds = cost.attn_s(np.concatenate((cols.work_pairs[attn], causal_pairs(0, length))),
                              np.concatenate((cols.work_block[attn], length)))
        out[attn] = seconds[:len(attn)]
        out[whole] = _sums_in_order(seconds[len(attn):], cols.work_nlengths[whole])
        priced = np.concatenate((attn, whole))
        share = np.where(backward[priced], ATTN_BWD_RATIO, 1.0)
        out[priced] = out[priced] * share / ((1 + ATTN_BWD_RATIO) * n)
    return out


@njit(cache=True)
def _sums_in_order(values, counts):
    """Each run of ``counts[j]`` consecutive ``values``, summed left to right from 0.0."""
    out = np.zeros(len(counts))
    at = 0
    for j in range(len(counts)):
        for x in range(at, at + counts[j]):
            out[j] += values[x]
        at += counts[j]
    return out


class CompiledSegment:
    """A schedule's ops as flat arrays, priced, for replaying it many times (ids
    are positions in ``schedule.ops``); :class:`SegmentSet` lays out what the
    event loop reads from them.  Read from the schedule's columns, without
    making its ops."""

    def __init__(self, schedule: Schedule, cost: CostModel, name: str = "") -> None:
        topo = cost.cluster.topology
        cols = schedule.arrays()
        self.name = name
        self.n = len(schedule)
        self.world = schedule.world_size
        self.topology = topo
        self.is_comm, self.rank, self.peer, self.ndeps = cols.is_comm, cols.rank, cols.peer, cols.ndeps
        self.dep, self.wave, self.nic = cols.dep, cols.wave, cols.nic
        self.tier = cols.tier                      # a compute op's: the replay sums busy time by it
        # Many compute ops share their fields (a ring's steps over equal shards,
        # equal linear shares): each distinct set of fields is priced once.
        self.seconds = work_seconds(cols, cost)[cols.work]   # a transfer's is set below
        # A transfer holds NVLink inside a node (unless it names a NIC: a routed leg), else a NIC.
        nbytes = cols.nbytes.astype(np.float64)
        nvlink = (cols.rank // topo.gpus_per_node == cols.peer // topo.gpus_per_node) & (cols.nic < 0)
        self.seconds = np.where(cols.is_comm, np.where(nvlink, cost.cluster.nvlink.transfer_s(nbytes),
                                                       cost.cluster.nic.transfer_s(nbytes)), self.seconds)


@njit(cache=True)
def _layout(world, seg_base, dep_base, is_comm, rank, peer, ndeps, dep, wave, named, gpn, nics, affinity):
    """The static arrays of segments laid end to end (``SegmentSet.arrays`` from
    ``users_ptr`` on, in its order): segment ``s``'s ops at ``seg_base[s]`` on,
    their dependencies at ``dep_base[s]`` on, ids inside a segment its own."""
    n_seg = len(seg_base) - 1
    total = seg_base[n_seg]
    n_comm = 0
    for i in range(total):
        n_comm += is_comm[i]
    users_ptr = np.zeros(total + 1, np.int64)
    users_idx = np.empty(len(dep), np.int64)
    lands = np.zeros(total, np.int64)
    port_out = np.full(total, -1, np.int64)
    port_in = np.full(total, -1, np.int64)
    lane_pos = np.zeros(total, np.int64)
    op_lane = np.zeros(total, np.int64)
    op_bsend = np.full(total, -1, np.int64)
    op_brecv = np.full(total, -1, np.int64)
    bat_base = np.zeros(n_seg + 1, np.int64)
    bat_ptr = np.zeros(2 * n_comm + 1, np.int64)
    bat_idx = np.empty(2 * n_comm, np.int64)
    bat_need = np.zeros(2 * n_comm, np.int64)
    sends = np.zeros(2 * n_comm, np.bool_)
    rl_ptr = np.zeros(2 * world * n_seg + 1, np.int64)
    onr_ptr = np.zeros(world * n_seg + 1, np.int64)
    onr_idx = np.empty(total + n_comm, np.int64)
    on_rank = np.zeros(world, np.int64)
    computes = np.zeros(world, np.int64)
    lane_width = 1
    n_ports = 1
    nb = 0                          # batches numbered over all segments
    bat_at = 0                      # where this segment's transfers' ends start in bat_idx
    for s in range(n_seg):
        o, n = seg_base[s], seg_base[s + 1] - seg_base[s]
        # Who depends on each op, in op order (the order the replay releases them),
        # and which ends of a transfer have a dependant on their rank (bit 0: its
        # sender, bit 1: its receiver): only those release anything when it lands.
        for x in range(dep_base[s], dep_base[s + 1]):
            users_ptr[o + dep[x] + 1] += 1
        for i in range(o, o + n):
            users_ptr[i + 1] += users_ptr[i]
        fill = users_ptr[o:o + n].copy()
        at = dep_base[s]
        for u in range(n):
            for x in range(at, at + ndeps[o + u]):
                d = dep[x]
                users_idx[fill[d]] = u
                fill[d] += 1
                lands[o + d] |= (1 if rank[o + u] == rank[o + d] else 0) | (2 if rank[o + u] == peer[o + d] else 0)
            at += ndeps[o + u]
        # A transfer goes out through its sender's NVLink port inside a node, else
        # the NIC it names (a routed leg) or its sender's, and in through its
        # receiver's NVLink port or NIC.  A compute op's place in its rank's lane
        # (lanes run in op order); how many ops each rank has on its lanes.
        on_rank[:] = 0
        computes[:] = 0
        seg_comm = 0
        for i in range(o, o + n):
            r = rank[i]
            if not is_comm[i]:
                lane_pos[i] = computes[r]
                computes[r] += 1
                on_rank[r] += 1
                continue
            seg_comm += 1
            q = peer[i]
            on_rank[r] += 1
            on_rank[q] += 1
            if r // gpn == q // gpn:
                port_out[i], port_in[i] = 2 * r, 2 * q + 1
            else:
                nic = named[i] if named[i] >= 0 else affinity[r % gpn]
                port_out[i] = 2 * world + 2 * ((r // gpn) * nics + nic)
                port_in[i] = 2 * world + 2 * ((q // gpn) * nics + affinity[q % gpn]) + 1
            n_ports = max(n_ports, port_out[i] + 1, port_in[i] + 1)
        lane_width = max(lane_width, computes.max())
        # Communication lanes, as the engine runs them (``comm/lanes.py``): per
        # rank, one lane per link class (0: intra-node, 1: through a NIC named:
        # ``schedule.ops.lane_of``), each a sequence of batches -- the rank's
        # transfers (sent or received) of one wave, posted together and done
        # together.  Batches are numbered by (segment, rank, lane, wave), so a
        # (rank, lane)'s batches are consecutive; a batch lists its transfers in op order.
        waves = 1
        for i in range(o, o + n):
            if is_comm[i]:
                op_lane[i] = 1 if named[i] >= 0 else 0
                waves = max(waves, wave[i] + 1)
        # A counting sort of the transfers' ends by (rank, lane, wave), each group in op order.
        groups = 2 * world * waves
        group_ptr = np.zeros(groups + 1, np.int64)
        for i in range(o, o + n):
            if is_comm[i]:
                for end in (rank[i], peer[i]):
                    group_ptr[(end * 2 + op_lane[i]) * waves + wave[i] + 1] += 1
        group_ptr = np.cumsum(group_ptr) + bat_at
        fill = group_ptr[:-1].copy()
        for i in range(o, o + n):
            if is_comm[i]:
                for end in (rank[i], peer[i]):
                    g = (end * 2 + op_lane[i]) * waves + wave[i]
                    bat_idx[fill[g]] = i - o
                    sends[fill[g]] = end == rank[i]
                    fill[g] += 1
        # The groups that hold any are the batches, numbered in that order.
        for g in range(groups):
            if group_ptr[g + 1] == group_ptr[g]:
                continue
            bat_ptr[nb] = group_ptr[g]
            rl_ptr[s * 2 * world + g // waves + 1] += 1
            for x in range(group_ptr[g], group_ptr[g + 1]):
                if sends[x]:
                    op_bsend[o + bat_idx[x]] = nb
                    bat_need[nb] += 1
                else:
                    op_brecv[o + bat_idx[x]] = nb
            nb += 1
        bat_base[s + 1] = nb
        bat_at += 2 * seg_comm
        # Every op on a rank's lanes: its compute lane, then its transfers (sent or received), in op order.
        for r in range(world):
            onr_ptr[s * world + r + 1] = onr_ptr[s * world + r] + on_rank[r]
        fill = onr_ptr[s * world:(s + 1) * world].copy()
        for i in range(o, o + n):
            if not is_comm[i]:
                onr_idx[fill[rank[i]]] = i - o
                fill[rank[i]] += 1
        for i in range(o, o + n):
            if is_comm[i]:
                for end in (rank[i], peer[i]):
                    onr_idx[fill[end]] = i - o
                    fill[end] += 1
    bat_ptr[nb] = 2 * n_comm
    return (users_ptr, users_idx, port_out, port_in, lane_pos, lane_width, onr_ptr, onr_idx, op_lane, lands,
            op_bsend, op_brecv, bat_base, bat_ptr[:nb + 1], bat_idx, bat_need[:nb], np.cumsum(rl_ptr), n_ports)


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
    chain of them (``replay_step`` replays two).  The segments span one world
    on one topology."""

    def __init__(self, segs: Sequence[CompiledSegment]) -> None:
        self.index = {id(seg): s for s, seg in enumerate(segs)}
        seg_base = np.zeros(len(segs) + 1, np.int64)
        seg_base[1:] = np.cumsum([seg.n for seg in segs])
        dep_base = np.zeros(len(segs) + 1, np.int64)
        dep_base[1:] = np.cumsum([len(seg.dep) for seg in segs])

        def joined(field: str) -> np.ndarray:
            return np.concatenate([getattr(seg, field) for seg in segs])

        is_comm, rank, peer, ndeps = joined("is_comm"), joined("rank"), joined("peer"), joined("ndeps")
        topo = segs[0].topology
        (users_ptr, users_idx, self.port_out, self.port_in, lane_pos, lane_width, onr_ptr, onr_idx, op_lane, lands,
         op_bsend, op_brecv, bat_base, bat_ptr, bat_idx, bat_need, rl_ptr, self.n_ports) = _layout(
            segs[0].world, seg_base, dep_base, is_comm, rank, peer, ndeps, joined("dep"), joined("wave"),
            joined("nic"), topo.gpus_per_node, topo.nics_per_node, np.array(topo.nic_affinity, np.int64))
        self.arrays = (
            seg_base, is_comm, rank, peer, joined("tier"), joined("seconds"), ndeps, users_ptr, users_idx,
            self.port_out, self.port_in, lane_pos, lane_width, onr_ptr, onr_idx, op_lane, lands, op_bsend, op_brecv,
            bat_base, bat_ptr, bat_idx, bat_need, rl_ptr, len(TIERS), self.n_ports)
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
    return [_chain_replay(len(chain), record, *out)
            for chain, out in zip(chains, _run_chains(chains, world, record, segments))]


def _run_chains(chains: Sequence[Sequence[CompiledSegment]], world: int, record: bool,
                segments: SegmentSet | None) -> list[tuple]:
    """``event_loop.run_chains`` of ``chains``, each checked to have run every op."""
    if segments is None:
        segments = SegmentSet(list({id(seg): seg for chain in chains for seg in chain}.values()))
    chain_segs = [np.array([segments.index[id(seg)] for seg in chain], np.int64) for chain in chains]
    out = run_chains(world, chain_segs, segments.arrays, record)
    for *_, remaining, created in out:
        if not created.all() or (remaining > 0).any():
            stuck = [(k, r) for k, r in zip(*np.nonzero(remaining > 0)) if created[k]]
            raise RuntimeError(f"replay: segment/rank pairs {stuck[:6]} never finished")
    return out


def _chain_replay(n_inst: int, record: bool, finish, busy, order, entered, left, start, end, base, remaining,
                  created) -> ChainReplay:
    timings = None
    if record:
        starts, ends = start.tolist(), end.tolist()
        timings = [[OpTiming(s, e) for s, e in zip(starts[base[k]:base[k + 1]], ends[base[k]:base[k + 1]])]
                   for k in range(n_inst)]
    return ChainReplay(finish.tolist(), _busy_sums(busy, order), left - entered, timings)


def _busy_sums(busy: np.ndarray, order: np.ndarray) -> dict[tuple[int, str], float]:
    """(rank, tier) -> ``busy[rank, tier]``, for each pair used (``order`` >= 0), in first-use order."""
    ranks, tiers = np.nonzero(order >= 0)
    first = np.argsort(order[ranks, tiers])            # each order is used once
    ranks, tiers = ranks[first], tiers[first]
    return dict(zip(zip(ranks.tolist(), [TIERS[t] for t in tiers.tolist()]), busy[ranks, tiers].tolist()))


@njit(cache=True)
def _part_sums(spent, part, n_parts):
    """``out[p, r]``: the sum of ``spent[k, r]`` over the instances ``k`` of part
    ``p`` (``part[k]``), in chain order from 0.0."""
    out = np.zeros((n_parts, spent.shape[1]))
    for k in range(len(part)):
        out[part[k]] += spent[k]
    return out


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
    names = list(dict.fromkeys(name for name, _, _ in parts))

    segments = SegmentSet(fwd + bwd)

    def run(*depths: int) -> list[tuple]:
        """Per depth: finish per rank, busy [rank, tier], their first-use order, time per part and rank."""
        chains = [fwd * layers + list(reversed(bwd)) * layers for layers in depths]
        out = []
        for chain, (finish, busy, order, entered, left, *_) in zip(chains, _run_chains(chains, world_size, False,
                                                                                        segments)):
            sums = _part_sums(left - entered, np.array([names.index(seg.name) for seg in chain]), len(names))
            inside = dict(zip(names, sums))
            out.append((finish, busy, order, inside))
        return out

    m = max(replayed_layers, 2)
    if exact or num_layers <= m:
        finish, busy, order, inside = run(num_layers)[0]
    else:
        small, big = run(m - 1, m)        # their first m - 1 forward layers replay once
        extra = num_layers - m

        def grow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return a + (a - b) * extra      # elementwise: the same float operations as on each number

        finish, busy, order = grow(big[0], small[0]), grow(big[1], small[1]), big[2]
        inside = {name: grow(big[3][name], small[3][name]) for name in names}
    finish_s = finish.tolist()
    return StepReplay(max(finish_s), finish_s, _busy_sums(busy, order),
                      {name: x.tolist() for name, x in inside.items()})
