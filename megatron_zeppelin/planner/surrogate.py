"""A closed-form stand-in for the replay's step time, certified against it.

The replay (``sim/replay.py``) runs every op of the step's schedule; building
that schedule costs far more than a planner may spend per candidate.  This
module computes, from a :class:`~megatron_zeppelin.plan.Plan` alone and in
numpy over its rings, groups and ranks, what the replay executes:

* per rank and pass the compute lane's work: local sequences, every ring
  step's kernel (zigzag chunk rows, ``CostModel.attn_s`` at the step's block
  length) and Ulysses shares, the linear work (``CostModel.linear_s``);
* a ring as its chain of steps: step ``s``'s kernel on position ``j`` waits for
  the K/V that travelled ``s`` links (backward: K/V and the dK/dV one step
  behind share the sender's port), each link priced on the port it uses
  (NVLink, the sender's NIC, or the routing layer's dispatch / NIC / combine
  legs), slowed by the other traffic of the segment on the same ports (a port
  serves one transfer at a time);
* Ulysses groups as all-to-all in, kernel, all-to-all out
  (``planner/surrogate_ulysses.py``), and layout switches as all-to-alls: a
  rank leaves once its busiest port drained;
* the segments chained per rank as the replay chains them (a rank enters a
  segment when its part of the previous one is done; a ring or group starts
  once all its ranks entered), for ``m`` and ``m - 1`` layers extrapolated as
  ``replay_step`` extrapolates, plus the gradient sync tail
  (``cost/step_sync.py``).

The plan is read once into flat arrays (``planner/plan_arrays.py``); Python
loops run per ring size, ring step and distinct token count, not per
sequence, rank or message.

Every constant is the cost model's; nothing is fitted.  ``benchmarks/surrogate_error.py``
measures how far it is from the replay (``docs/results/surrogate.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO, LINEAR_BWD_RATIO, CostModel
from megatron_zeppelin.cost.step_sync import forward_backward_split, grad_sync_s, optimizer_s, step_sync
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.plan.shards import chunk_sizes
from megatron_zeppelin.planner.plan_arrays import PlanArrays, layout_arrays, plan_arrays
from megatron_zeppelin.planner.surrogate_packed import packed_floor_pairs, packed_ring_batches
from megatron_zeppelin.planner.surrogate_ulysses import UlyssesGroups
from megatron_zeppelin.schedule.routing import min_routed_bytes

#: The ring step at whose transfers' level of the schedule's order a Ulysses
#: group's outputs are sent (``schedule/attention.py``: all-to-all in at step 0,
#: kernel at 1, all-to-all out at 2).
ULYSSES_OUT_STEP = 2
#: Layers the replay runs before it extrapolates (``sim/replay.py: REPLAYED_LAYERS``;
#: planning never imports the simulator).
REPLAYED_LAYERS = 4
#: A segment's pass: forward, then backward.
PASSES = (False, True)


@dataclass
class _Segment:
    """One engine call of one pass, per rank: what it costs once every rank has entered."""

    work: np.ndarray
    """Seconds of compute-lane work per rank."""
    chains: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Coupled groups: (member ranks flat, group id per member, seconds from the
    group's start to the member's exit)."""
    alltoall: np.ndarray | None = None
    """Per rank the seconds its busiest port needs (a layout switch), else None."""


@dataclass
class _RingBatch:
    """The rings of one size ``k`` of a segment, one row per ring."""

    ranks: np.ndarray
    """(rings, k) ranks by position."""
    comp: np.ndarray
    """(rings, position, step) kernel seconds."""
    k: int
    legs: list = field(default_factory=list)
    """(ring, step, port, seconds held) arrays of every message leg."""
    via: np.ndarray = None
    """(rings, step) seconds of one NIC piece summed over the routed messages."""
    fill: np.ndarray = None
    """(rings, step) the largest routed pipeline fill."""

    def __post_init__(self) -> None:
        shape = (len(self.ranks), self.k + 1)
        self.via, self.fill = np.zeros(shape), np.zeros(shape)


def _pad(v: np.ndarray, width: int) -> np.ndarray:
    return np.pad(v, ((0, 0), (0, width - v.shape[1])))


def _components(group_of_slot: np.ndarray, rank_of_slot: np.ndarray, groups: int, w: int) -> np.ndarray:
    """Connected families of groups that share ranks: a label per group (0..F-1)."""
    label = np.arange(groups)
    while True:
        by_rank = np.full(w, groups)
        np.minimum.at(by_rank, rank_of_slot, label[group_of_slot])
        new = label.copy()
        np.minimum.at(new, group_of_slot, by_rank[rank_of_slot])
        if (new == label).all():
            break
        label = new
    return np.unique(label, return_inverse=True)[1].reshape(-1)


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(distinct rows in lexicographic order, index of each row's, first row of
    each, rows of each): ``np.unique(rows, axis=0)`` without its row-as-bytes sort."""
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    new = np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)]
    starts = np.flatnonzero(new)
    of = np.empty(len(rows), np.int64)
    of[order] = np.cumsum(new) - 1
    return ordered[starts], of, order[starts], np.diff(np.r_[starts, len(rows)])


class StepSurrogate:
    """The step time of plans under one cost model (see the module docstring)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        c, m = cost.cluster, cost.model
        topo = c.topology
        self.gpn, self.nics = topo.gpus_per_node, topo.nics_per_node
        self.affinity = np.asarray(topo.nic_affinity, np.int64)
        self.layers = m.num_layers
        g = c.gpu
        # attn_s(pairs, block) = pairs * per_pair * (block + half) / block, per layer and pass below.
        self.per_pair = m.attn_flops_per_pair * (1 + ATTN_BWD_RATIO) / (g.peak_tflops * 1e12 * g.attn_efficiency)
        self.half = g.attn_half_block
        self.attn_share = {False: 1.0 / ((1 + ATTN_BWD_RATIO) * m.num_layers),
                           True: ATTN_BWD_RATIO / ((1 + ATTN_BWD_RATIO) * m.num_layers)}
        self.lin_share = {False: 1.0 / ((1 + LINEAR_BWD_RATIO) * m.num_layers),
                          True: LINEAR_BWD_RATIO / ((1 + LINEAR_BWD_RATIO) * m.num_layers)}
        self.kv_numel = m.num_query_groups * m.head_dim
        self.isz, self.acc = m.dtype_bytes, cost.ring_grad_bytes
        self.q_heads, self.kv_heads, self.head_dim = m.num_attention_heads, m.num_query_groups, m.head_dim
        self.row_bytes = m.hidden_size * m.dtype_bytes
        self.nvl_lat, self.nvl_bw = c.nvlink.latency_us * 1e-6, c.nvlink.bandwidth_GBps * 1e9
        self.nic_lat, self.nic_bw = c.nic.latency_us * 1e-6, c.nic.bandwidth_GBps * 1e9
        self.threshold = min_routed_bytes(cost) if cost.routing else math.inf
        self.linear_memo: dict[float, float] = {}

    # ----------------------------------------------------------------- links
    def _n_ports(self, w: int) -> int:
        """Ports of ``w`` ranks: each GPU's NVLink out and in, each NIC's out and in."""
        return 2 * w + 2 * (w // self.gpn + 1) * self.nics

    def _attn_s(self, pairs: np.ndarray, block: np.ndarray) -> np.ndarray:
        block = np.maximum(block, 1)
        return np.where(pairs > 0, pairs * self.per_pair * (block + self.half) / block, 0.0)

    def _ports(self, src: np.ndarray, dst: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(same node, egress port, ingress port) of direct transfers, numbered as the replay numbers them."""
        g = self.gpn
        inside = src // g == dst // g
        out = np.where(inside, 2 * src, 2 * world + 2 * ((src // g) * self.nics + self.affinity[src % g]))
        inn = np.where(inside, 2 * dst + 1, 2 * world + 2 * ((dst // g) * self.nics + self.affinity[dst % g]) + 1)
        return inside, out, inn

    def _transfers(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, w: int,
                   routed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Messages from ``src`` to ``dst``: (seconds of each alone; when it is
        routed, the seconds of one piece's NIC leg and what its pipeline adds to
        its busiest port's seconds (else 0); its legs as message index, port,
        seconds the leg holds the port).  Routed messages
        (across nodes, at least the break-even) go in ``P`` pieces: dispatched over
        the sender's NVLink one after another, each over NIC ``j``, combined into
        the receiver; proxies and peers forward them (spread over the node's GPUs)."""
        inside, out, inn = self._ports(src, dst, w)
        nvl = self.nvl_lat + nbytes / self.nvl_bw
        nic = self.nic_lat + nbytes / self.nic_bw
        seconds = np.where(inside, nvl, nic)
        ids = np.arange(len(src))
        route = ~inside & (nbytes >= self.threshold) if routed and self.nics > 1 else np.zeros(len(src), bool)
        direct = ~route
        legs = [(ids[direct], out[direct], seconds[direct]), (ids[direct], inn[direct], seconds[direct])]
        if route.any():
            P, g = self.nics, self.gpn
            piece = nbytes[route] / P
            d = self.nvl_lat + piece / self.nvl_bw
            n = self.nic_lat + piece / self.nic_bw
            seconds[route] = P * d + n
            i, s, t = ids[route], src[route], dst[route]
            legs += [(i, 2 * s, (P - 1) * d), (i, 2 * t + 1, (P - 1) * d)]
            for j in range(P):
                legs += [(i, 2 * w + 2 * ((s // g) * P + j), n), (i, 2 * w + 2 * ((t // g) * P + j) + 1, n)]
            spread = d * (P - 1) / g
            for local in range(g):
                legs += [(i, 2 * ((s // g) * g + local) + 1, spread), (i, 2 * ((t // g) * g + local), spread)]
        msg, port, sec = (np.concatenate(x) for x in zip(*legs))
        piece_s, fill = np.zeros(len(src)), np.zeros(len(src))
        if route.any():
            piece_s[route] = n
            fill[route] = seconds[route] - np.maximum((P - 1) * d, n)
        return seconds, piece_s, fill, msg, port, sec

    # ----------------------------------------------------------- attention
    def _attention(self, w: int, layout: PlanArrays, groups: UlyssesGroups | None, backward: bool,
                   routed: bool) -> _Segment:
        share = self.attn_share[backward]
        work = np.zeros(w)
        load = np.zeros(self._n_ports(w))
        L = layout.local_len
        if len(L):
            np.add.at(work, layout.local_rank, self._attn_s(L * (L + 1) / 2, L) * share)
        # A rank posts its Ulysses outputs in its send lane's order, before its
        # rings' transfers of step ULYSSES_OUT_STEP + 1 on: those wait for its
        # Ulysses kernels (``gate``).
        gate = np.zeros(w)
        pending = [groups.price(backward, work, load, gate)] if groups is not None else []
        pending += [self._rings([self._ring_batch(k, ranks, lens, backward, routed, w)
                                 for k, (ranks, lens) in layout.rings.items()]
                                + packed_ring_batches(self, layout, backward, routed, w),
                                backward, work, load, w, gate)] if layout.rings or layout.packed else []
        chains = [finish(load) for finish in pending]
        return _Segment(work, chains)

    def _ring_batch(self, k: int, ranks: np.ndarray, L: np.ndarray, backward: bool, routed: bool,
                    w: int) -> "_RingBatch":
        """Kernels and messages of the rings of ``k`` ranks (``ranks``: one row per ring)."""
        share = self.attn_share[backward]
        n = len(L)
        # Zigzag chunk rows: position i holds chunks i and 2k-1-i.
        sizes = chunk_sizes(L, 2 * k)
        a, b = sizes[:, :k].astype(np.float64), sizes[:, ::-1][:, :k].astype(np.float64)
        # Step t's kernel on position p: the K/V of owner p - t, whose chunks all
        # come before p's (p >= t) or after p's first chunk (p < t, owner p - t + k).
        comp = np.empty((n, k, k))
        for t in range(k):
            if t == 0:
                pairs, block = a * (a + 1) / 2 + b * a + b * (b + 1) / 2, np.floor((a + 2 * b) / 3)
                comp[:, :, 0] = self._attn_s(pairs, block) * share
                continue
            ap, bp, ao = a[:, t:], b[:, t:], a[:, :k - t]
            comp[:, t:, t] = self._attn_s((ap + bp) * ao, ap + bp) * share
            ap, bp, ao, bo = a[:, :t], b[:, :t], a[:, k - t:], b[:, k - t:]
            comp[:, :t, t] = self._attn_s(bp * (ao + bo), bp) * share
        batch = _RingBatch(ranks, comp, k)
        if k == 1:
            return batch
        # Step s sends on link j -> j+1 the K/V of owner (j - s) % k (not at the
        # last step), and backward the dK/dV of owner (j - s + 1) % k (steps 1..k).
        shard = a + b

        # Rings inside one node never route: their messages over one rank tuple
        # load the same ports, so they are priced per tuple (bytes summed, one
        # latency per message) -- a uniform layout has many rings per tuple.
        nodes = ranks // self.gpn
        inside = bool((nodes.min(axis=1) == nodes.max(axis=1)).all())
        if inside:
            tuples, of, first, count = _unique_rows(ranks)
            # bytes are whole numbers: summed per tuple in any order they are exact
            shard = np.stack([np.bincount(of, weights=shard[:, j], minlength=len(tuples)) for j in range(k)], axis=1)
            extra = count - 1
        routed_cells, routed_pieces = [], []

        def send(steps: np.ndarray, owners: np.ndarray, itemsize: int) -> None:
            nbytes = 2 * shard[:, owners] * self.kv_numel * itemsize         # (ring or tuple, link, step)
            senders = tuples if inside else ranks
            shape = nbytes.shape
            src = np.broadcast_to(senders[:, :, None], shape).ravel()
            dst = np.broadcast_to(np.roll(senders, -1, axis=1)[:, :, None], shape).ravel()
            sec, piece, piece_fill, msg, port, held = self._transfers(src, dst, nbytes.ravel(), w, routed)
            ring, _, col = np.unravel_index(msg, shape)
            if inside:
                held = held + extra[ring] * self.nvl_lat
                ring = first[ring]
            batch.legs.append((ring, steps[col], port, held))
            if not inside:
                routed_cells.append(np.broadcast_to((np.arange(n) * (k + 1))[:, None, None] + steps, shape).ravel())
                routed_pieces.append((piece, piece_fill))

        pos = np.arange(k)
        kv_steps = np.arange(k - 1)
        send(kv_steps, (pos[:, None] - kv_steps[None, :]) % k, self.isz)
        if backward:
            dkv_steps = np.arange(1, k + 1)
            send(dkv_steps, (pos[:, None] - dkv_steps[None, :] + 1) % k, self.acc)
        if routed_cells:
            cell = np.concatenate(routed_cells)
            piece, piece_fill = (np.concatenate(x) for x in zip(*routed_pieces))
            batch.via = np.bincount(cell, weights=piece, minlength=n * (k + 1)).reshape(n, k + 1)
            np.maximum.at(batch.fill.reshape(-1), cell, piece_fill)
        return batch

    def _rings(self, batches: list["_RingBatch"], backward: bool, work: np.ndarray, load: np.ndarray, w: int,
               gate: np.ndarray):
        """Every ring of the segment.  Rings that share a rank advance step by
        step together (a rank's send lane posts step ``s`` of every ring before
        step ``s + 1`` of any), so each connected family of rings is one chain:
        step ``s``'s kernel on a rank waits for the transfers of step ``s - 1``,
        which last as long as the family's busiest port needs for that step,
        or the family's routed crossings one after another (a routed piece is
        forwarded by GPUs whose send lanes post in message order: the next
        crossing's sender combines a piece of the previous one before it posts
        its own), plus one routed pipeline's fill.  Adds kernels to ``work`` and
        messages to ``load``; returns the function of the segment's port loads
        that yields each ring rank's seconds from the family's start to its exit."""
        S = max(bt.k for bt in batches) + 1
        ranks = [bt.ranks for bt in batches]
        base = np.cumsum([0] + [len(r) for r in ranks])
        ring_of_slot = np.concatenate([np.repeat(np.arange(len(r)) + base[i], r.shape[1])
                                       for i, r in enumerate(ranks)])
        rank_of_slot = np.concatenate([r.ravel() for r in ranks])
        family = _components(ring_of_slot, rank_of_slot, int(base[-1]), w)
        fam_of_rank = np.full(w, -1)
        fam_of_rank[rank_of_slot] = family[ring_of_slot]
        F = int(family.max()) + 1
        per_step = np.zeros((F, S))
        fill = np.zeros((F, S))
        leg_fam, leg_key, leg_port, leg_held = [], [], [], []
        n_ports = len(load)
        # Per (rank, step) kernel seconds, per (family, step) routed NIC pieces:
        # summed ring after ring (bincount adds in order, as a loop would).
        lane = np.bincount(np.concatenate([(bt.ranks[:, :, None] * S + np.arange(bt.k)).ravel() for bt in batches]),
                           np.concatenate([bt.comp.ravel() for bt in batches]), w * S).reshape(w, S)
        cells = [((family[base[i]:base[i + 1]] * S)[:, None] + np.arange(S)).ravel() for i in range(len(batches))]
        via = np.bincount(np.concatenate(cells), np.concatenate([_pad(bt.via, S).ravel() for bt in batches]),
                          F * S).reshape(F, S)
        for i, bt in enumerate(batches):
            fam = family[base[i]:base[i + 1]]
            np.maximum.at(fill.reshape(-1), cells[i], _pad(bt.fill, S).ravel())
            for ring, step, port, held in bt.legs:
                leg_fam.append(fam[ring])
                leg_key.append((fam[ring] * S + step) * n_ports + port)
                leg_port.append(port)
                leg_held.append(held)
        work += lane.sum(axis=1)
        if leg_key:
            key, port, held, lfam = (np.concatenate(x) for x in (leg_key, leg_port, leg_held, leg_fam))
            np.add.at(load, port, held)
            uniq, inv = np.unique(key, return_inverse=True)
            np.maximum.at(per_step.reshape(-1), uniq // n_ports, np.bincount(inv, weights=held))
        else:
            port, lfam = np.zeros(0, np.int64), np.zeros(0, np.int64)
        step_x = np.maximum(per_step, via) + fill
        arrive = np.concatenate([np.zeros((F, 1)), np.cumsum(step_x[:, :S - 1], axis=1)], axis=1)
        if gate.any() and S > ULYSSES_OUT_STEP + 1:
            # Transfers of steps after the Ulysses outputs' wait for the family's last Ulysses kernel.
            held = np.zeros(F)
            np.maximum.at(held, family[ring_of_slot], gate[rank_of_slot])
            after = np.cumsum(step_x[:, ULYSSES_OUT_STEP:S - 1], axis=1)
            arrive[:, ULYSSES_OUT_STEP + 1:] = np.maximum(arrive[:, ULYSSES_OUT_STEP + 1:], held[:, None] + after)
        members = np.nonzero(fam_of_rank >= 0)[0]
        tail = np.cumsum(lane[members, ::-1], axis=1)[:, ::-1]              # kernels of steps t >= s
        # A rank ends at max over s of (arrival of step s's data + its kernels from s on),
        # and no earlier than the last transfer of its family it takes part in.
        end = (arrive[fam_of_rank[members]] + tail).max(axis=1)
        last = arrive[fam_of_rank[members], -1] + step_x[fam_of_rank[members], -1] * backward

        def finish(total: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            drain = np.zeros(F)
            if len(port):
                np.maximum.at(drain, lfam, total[port])
            fam = fam_of_rank[members]
            return members, fam, np.maximum(np.maximum(end, last), drain[fam])

        return finish

    # -------------------------------------------------------- switch, linear
    def _switch(self, messages: tuple[np.ndarray, np.ndarray, np.ndarray], w: int, routed: bool,
                reverse: bool) -> _Segment:
        src, dst, tokens = messages
        if reverse:
            src, dst = dst, src
        load = np.zeros(self._n_ports(w))
        _, _, _, _, port, held = self._transfers(src, dst, tokens * self.row_bytes, w, routed)
        np.add.at(load, port, held)
        g = self.gpn
        r = np.arange(w)
        nic = 2 * w + 2 * ((r // g) * self.nics + self.affinity[r % g])
        per_rank = np.maximum.reduce([load[2 * r], load[2 * r + 1], load[nic], load[nic + 1]])
        return _Segment(np.zeros(w), [], per_rank)

    def _linear_s(self, tokens: np.ndarray) -> np.ndarray:
        """``CostModel.linear_s`` per rank, once per distinct count (a balanced
        layout has one or two; candidates of one batch share most; at most the
        token cap of them are kept)."""
        counts, of = np.unique(tokens, return_inverse=True)
        known = self.linear_memo
        for t in counts.tolist():
            if t not in known:
                known[t] = self.cost.linear_s(t)
        return np.array([known[t] for t in counts.tolist()])[of.reshape(-1)]

    # ------------------------------------------------------------------ step
    def step_s(self, plan: Plan) -> float:
        """Modeled step of ``plan`` in seconds: the replay's ``step_s`` (sync tail included)."""
        return self.layout_step_s(plan_arrays(plan), plan.world_size, plan.routed)

    def layout_step_s(self, layout: PlanArrays, w: int, routed: bool) -> float:
        """:meth:`step_s` of the plan of ``layout`` (``planner/plan_arrays.py``)
        on ``w`` ranks whose ``Plan.routed`` is ``routed``."""
        routed = routed and self.cost.routing
        msgs = layout.remap
        linear = self._linear_s(layout.linear_tokens)
        groups = UlyssesGroups(self, layout, w, self._n_ports(w)) if len(layout.group_len) else None
        parts = {}
        for bw in PASSES:
            seq = [("attn", self._attention(w, layout, groups, bw, routed))]
            if msgs is not None:
                seq.append(("to_linear", self._switch(msgs, w, routed, reverse=bw)))
            seq.append(("linear", _Segment(linear * self.lin_share[bw], [])))
            if msgs is not None:
                seq.append(("to_attn", self._switch(msgs, w, routed, reverse=not bw)))
            parts[bw] = seq
        m = REPLAYED_LAYERS
        layers = self.layers

        forward, backward = [s for _, s in parts[False]], [s for _, s in reversed(parts[True])]

        def run(t: np.ndarray, segments: list[_Segment], n: int) -> np.ndarray:
            for seg in segments * n:
                t = self._advance(seg, t)
            return t

        if layers <= m:
            finish = run(run(np.zeros(w), forward, layers), backward, layers)
        else:
            # m and m - 1 layers share their first m - 1 forward layers
            head = run(np.zeros(w), forward, m - 1)
            big, small = run(run(head, forward, 1), backward, m), run(head, backward, m - 1)
            finish = big + (big - small) * (layers - m)
        slowest = int(np.argmax(finish))
        attn = sum(seg.work[slowest] for bw in PASSES for name, seg in parts[bw] if name == "attn") * layers
        lin = sum(seg.work[slowest] for bw in PASSES for name, seg in parts[bw] if name == "linear") * layers
        tail = step_sync(self.cost, *forward_backward_split(attn, lin))
        return float(finish.max()) + tail.exposed_s

    @staticmethod
    def _advance(seg: _Segment, entry: np.ndarray) -> np.ndarray:
        """Per rank, when it leaves ``seg`` having entered at ``entry``."""
        if seg.alltoall is not None:
            busy = seg.alltoall > 0
            if not busy.any():
                return entry
            start = float(entry[busy].max())
            return np.where(busy, start + seg.alltoall, entry)
        out = entry + seg.work
        for flat, gid, end in seg.chains:
            start = np.full(gid.max() + 1, -np.inf)
            np.maximum.at(start, gid, entry[flat])
            np.maximum.at(out, flat, start[gid] + end)
        return out


def surrogate_clock(cost: CostModel) -> Callable[[Plan], float]:
    """The decision's ``PlanContext.step_model`` under ``cost``: the surrogate's
    step of a plan (what the simulator's ``zeppelin``, the trainer and
    ``pretrain_gpt.py --zeppelin`` decide by)."""
    return StepSurrogate(cost).step_s


def step_floor(cost: CostModel, plan: Plan) -> float:
    """A lower bound of ``StepSurrogate(cost).step_s(plan)`` (:func:`layout_floor`)."""
    return layout_floor(cost, layout_arrays(plan.world_size, plan.seq_lens, plan.attention, None, plan.packed_rings),
                        plan.linear_tokens_per_rank())


def layout_floor(cost: CostModel, layout: PlanArrays, linear_tokens: Sequence[int] | np.ndarray) -> float:
    """A lower bound of ``StepSurrogate(cost).step_s`` of the plan of ``layout``'s
    attention layout whose linear layout holds ``linear_tokens`` per rank, before
    that plan is built, for searches that price plans in bound order
    (``planner/fastest.py``).  From compute alone: a rank leaves every segment
    no earlier than its work after entering it, so each layer adds at least its
    work (a kernel block is at most the rank's shard of the sequence:
    ``attn_s`` at the shard's length or less), and the extrapolated layers at
    least the rank's backward and the least forward of any rank; the sync tail
    is at least its last buckets and the optimizer."""
    g, m = cost.cluster.gpu, cost.model
    per_pair = m.attn_flops_per_pair * (1 + ATTN_BWD_RATIO) / (g.peak_tflops * 1e12 * g.attn_efficiency)
    half, w = g.attn_half_block, len(linear_tokens)
    # Causal pairs per rank, each times its block's slowdown ``1 + half / block``.
    L = layout.local_len.astype(np.int64)
    pairs = np.zeros(w)     # (a bincount of no ranks is of ints)
    pairs += np.bincount(layout.local_rank, weights=(L * (L + 1) // 2) * (1 + half / L), minlength=w)
    L, d = layout.group_len, layout.group_size
    share = (L * (L + 1) // 2) // d * (1 + half / L)
    pairs += np.bincount(layout.group_ranks, weights=np.repeat(share, d), minlength=w)
    pairs += packed_floor_pairs(layout, half, w)
    for k, (ranks, L) in layout.rings.items():
        # Position i of a zigzag ring holds chunks i and 2k - 1 - i of 2k.
        b = np.arange(2 * k + 1) * L[:, None] // (2 * k)
        i = np.arange(k)
        s1, e1, s2, e2 = b[:, i], b[:, i + 1], b[:, 2 * k - 1 - i], b[:, 2 * k - i]
        held = (e1 * (e1 + 1) - s1 * (s1 + 1)) // 2 + (e2 * (e2 + 1) - s2 * (s2 + 1)) // 2
        pairs += np.bincount(ranks.ravel(), weights=(held * (1 + half / (e1 - s1 + e2 - s2))).ravel(), minlength=w)
    attn = pairs * per_pair
    tokens, of = np.unique(np.asarray(linear_tokens, np.int64), return_inverse=True)
    lin = np.array([cost.linear_s(t) for t in tokens.tolist()])[of.reshape(-1)]
    fwd = (attn / (1 + ATTN_BWD_RATIO) + lin / (1 + LINEAR_BWD_RATIO)) / m.num_layers
    bwd = (attn * ATTN_BWD_RATIO / (1 + ATTN_BWD_RATIO) + lin * LINEAR_BWD_RATIO / (1 + LINEAR_BWD_RATIO)) / m.num_layers
    n, rep = m.num_layers, min(m.num_layers, REPLAYED_LAYERS)
    compute = float((rep * (fwd + bwd) + (n - rep) * (bwd + fwd.min())).max())
    reduce_s, gather_s, buckets = grad_sync_s(cost)
    tail = (reduce_s + gather_s) / buckets if buckets else 0.0
    # Summed in another order than the surrogate sums: a margin far above rounding.
    return (compute + tail + optimizer_s(cost)) * (1 - 1e-9)
