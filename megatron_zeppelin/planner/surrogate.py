"""A closed-form stand-in for the replay's step time, certified against it.

The replay (``sim/replay.py``) runs every op of the step's schedule; building
that schedule costs far more than a planner may spend per candidate.  This
module computes, from a :class:`~megatron_zeppelin.plan.Plan` alone and in
numpy over its rings, groups and ranks, what the replay executes:

* per rank and pass the compute lane's work: local sequences, every ring
  step's kernel (zigzag chunk rows, ``CostModel.attn_s`` at the step's block
  length) and Ulysses shares, the linear work (``CostModel.linear_s``);
* a ring as the engine's lanes run it: per rank a lane per link class posting
  a wave of transfers at a time as one batch, done with its slowest transfer;
  the K/V of step ``s`` reaches position ``j`` once position ``j - 1`` had it and
  their link carried it -- one wave direct, up to three routed (``schedule/routing.py``:
  dispatch, NIC, combine, every position crossing at once) -- each wave as long
  as the busiest port of its legs in the family of rings sharing ranks (or
  relaying each other's routed pieces), and a step no shorter than the
  busiest port that step of the rings joined through ranks of rings still
  sending then (unless it routes pieces); a direct transfer starts once the
  lanes it takes at both its ends are done with their batches before, which
  hold the other rings' and the groups' transfers of those waves (a second
  pass, paced by the first's batches); a rank relays
  routed pieces (a proxy, or its twin) in its own lanes' batches of the
  pieces' waves, so a piece leaves it once the lane's batch before is done
  and every send of its batch has its data -- a Ulysses member's inputs' and
  outputs' all-to-alls, its own rings' transfers (a second pass, paced by the
  first's batches) -- and the rank leaves the segment once it relayed its
  last piece; backward, a K/V batch also carries the dK/dV of its wave, which
  waits for its kernel, and the K/V lands with the receiver's batch once that
  batch's dK/dV moved too; a transfer holds its port for the port's load in
  the transfer's own wave (a receiving port: all of it; a sending port: what
  it carries before it, in the schedule's order), and every rank's lane is
  done with a wave's batch no sooner than with the batch before plus its
  busiest port's load in it -- after the other lane's batch before, for a
  relayed piece (``planner/surrogate_lanes.py``); a rank's compute lane is
  done at the latest over its ring and Ulysses kernels of (one's release +
  the kernels released no earlier), as any lane that idles only while none
  is released (the replay's runs the first released op in lane order); it
  leaves once its last message in and out landed;
* Ulysses groups as the engine posts them (``planner/surrogate_ulysses.py``): a
  rank's inputs of all its groups as one batch per lane, its kernels in the
  compute lane's order beside its local kernel calls, then its outputs as one
  later batch, its rings' transfers of those waves in the same batches --
  followed message by message from every rank's own entry;
  layout switches as all-to-alls followed the same way
  (``planner/surrogate_alltoall.py``), a routed message's pieces a wave per hop;
* the segments chained per rank as the replay chains them (a rank enters a
  segment when its part of the previous one is done; a message leaves once
  both its ends entered, so a ring member leaves as late after each member's
  entry as the ring's chain from that entry to its exit takes -- rings of a
  family that hold different ranks, coupled through their lanes, start once
  its last member entered; what the groups' batches hold back of a ring
  member goes as much earlier as every Ulysses member of its family has its
  outputs done earlier, followed from the entries, than the chain timed
  them from the family's start), for ``m`` and
  ``m - 1`` layers extrapolated as ``replay_step`` extrapolates, plus the
  gradient sync tail (``cost/step_sync.py``).

The plan is read once into flat arrays (``planner/plan_arrays.py``); Python
loops run per ring size, ring step and distinct token count, not per
sequence, rank or message.

Every constant is the cost model's; nothing is fitted.  ``benchmarks/surrogate_error.py``
measures how far it is from the replay (``docs/results/surrogate.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO, LINEAR_BWD_RATIO, CostModel
from megatron_zeppelin.cost.step_sync import forward_backward_split, grad_sync_s, optimizer_s, step_sync
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.plan_arrays import PlanArrays, layout_arrays, plan_arrays
from megatron_zeppelin.planner.surrogate_alltoall import exchanged
from megatron_zeppelin.planner.surrogate_packed import packed_floor_pairs, packed_ring_batches
from megatron_zeppelin.planner.surrogate_rings import (COMBINE, DIRECT, DISPATCH, NIC, ULYSSES_OUT_WAVE,
                                                       RingBatch, RingSegments)
from megatron_zeppelin.planner.surrogate_ulysses import UlyssesGroups
from megatron_zeppelin.schedule.routing import min_routed_bytes

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
    chains: list[tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]],
                       tuple[np.ndarray, np.ndarray] | None]]
    """Ring families: (member ranks flat, family id per member, seconds from the
    family's start to the member's exit, per ring batch (its (rings, k) ranks,
    per (ring, position i, position j) how much earlier the rank at j leaves
    this ring after position i entered (the others long before:
    ``surrogate_rings._entry_leave``) than the latest of its rings when all enter at once:
    <= 0; none for a family whose rings hold different ranks), and for
    families beside Ulysses groups (else None) per member (relaying ranks
    after them hold none) the seconds of its kernels, ring and Ulysses, one
    after another, and when its Ulysses outputs were done in the chain (NaN:
    none of its own, or a family that routes pieces)).  A ring
    member leaves its family's seconds after the latest over its rings'
    positions ``i`` of entry plus that slack (without: the family's start),
    less what the groups hold back of it as much as every member of its
    family has its outputs done earlier, as followed, than in the chain."""
    followed: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]] | None = None
    """What is followed from every rank's own entry (the Ulysses groups:
    ``UlyssesGroups.price``; a direct layout switch): from the entries, (its
    ranks, when each leaves, per rank when its Ulysses outputs were done or
    None); None without."""


class StepSurrogate(RingSegments):
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
        # Per NIC the GPUs on it (a row each, padded), and how many.
        on_nic = [np.flatnonzero(self.affinity == j) for j in range(self.nics)]
        self.nic_gpus = np.zeros((self.nics, max(map(len, on_nic))), np.int64)
        for j, gpus in enumerate(on_nic):
            self.nic_gpus[j, :len(gpus)] = gpus
        self.nic_count = np.array([len(x) for x in on_nic])[:, None]
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

    def _hops(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, w: int, routed: bool) -> list[tuple]:
        """The hops of the messages from ``src`` to ``dst``, as ``schedule/routing.py``
        cuts them: (which of the arrays' entries are a transfer, or None for all;
        message index, egress port, ingress port, seconds the transfer holds
        both, hop: :data:`DIRECT`, :data:`DISPATCH`, :data:`NIC` or :data:`COMBINE`,
        its wave within the message from 0).
        A direct message holds its sender's egress and its receiver's ingress
        port.  A routed one (across nodes, at least the break-even) goes in ``P``
        pieces, piece ``j`` dispatched over NVLink to the sender's proxy on NIC
        ``j`` (none when the sender sits on it), through NIC ``j`` to the proxy's
        twin on the receiver's node, and combined into the receiver (none when
        the twin is the receiver): each hop a wave of the engine's lanes, so a
        piece takes one to three waves (``Schedule.waves``: one more than what it
        waits for) and the message as many as its longest piece -- two, not
        three, on nodes of two GPUs with a NIC each (a TP view)."""
        inside, out, inn = self._ports(src, dst, w)
        seconds = np.where(inside, self.nvl_lat + nbytes / self.nvl_bw, self.nic_lat + nbytes / self.nic_bw)
        ids = np.arange(len(src))
        if not (routed and self.nics > 1):
            return [(None, ids, out, inn, seconds, DIRECT, 0)]
        route = ~inside & (nbytes >= self.threshold)
        direct = ~route
        hops = [(direct, ids, out, inn, seconds, DIRECT, 0)]
        if route.any():
            P, g = self.nics, self.gpn
            i, s, t, j, d, n, proxy, peer = self._pieces(ids[route], src[route], dst[route], nbytes[route])
            dispatched = proxy != s
            crossing = dispatched.astype(np.int64)         # the NIC leg's wave
            hops += [(dispatched, i, 2 * s, 2 * proxy + 1, d, DISPATCH, 0),
                     (None, i, 2 * w + 2 * ((s // g) * P + j), 2 * w + 2 * ((t // g) * P + j) + 1, n, NIC, crossing),
                     (peer != t, i, 2 * peer, 2 * t + 1, d, COMBINE, crossing + 1)]
        return hops

    def _pieces(self, ids: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple:
        """The pieces of routed messages, as (piece ``j``, message) arrays: (message
        index, sender, receiver, ``j``, seconds of its dispatch or combine, of its
        NIC crossing, its proxy, the proxy's twin on the receiver's node).  Piece
        ``j`` crosses NIC ``j``; its proxy is the sender when it sits on that NIC,
        else the receiver's twin when it does, else a GPU of the NIC rotated by
        message (``schedule/routing.py: _proxy``)."""
        P, g = self.nics, self.gpn
        j = np.arange(P)[:, None]
        i, s, t = (np.broadcast_to(x, (P, len(ids))) for x in (ids, src, dst))
        d = np.broadcast_to(self.nvl_lat + nbytes / P / self.nvl_bw, s.shape)
        n = np.broadcast_to(self.nic_lat + nbytes / P / self.nic_bw, s.shape)
        base = s - s % g
        proxy = np.where(self.affinity[s % g] == j, s,
                         np.where(self.affinity[t % g] == j, base + t % g,
                                  base + self.nic_gpus[j, (s + t) % self.nic_count]))
        return i, s, t, np.broadcast_to(j, s.shape), d, n, proxy, t - t % g + proxy % g

    def _relays(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, ...]:
        """The hops that ranks other than a message's ends take part in, of the
        routed messages from ``src`` to ``dst`` (:meth:`_hops`): (message index,
        the relaying rank, the hop's wave within its message, its lane (0:
        NVLink, 1: NIC), whether the rank sends it, seconds of the hop, seconds
        of the hops after it).  A proxy receives the dispatch and
        sends the NIC crossing, the proxy's twin receives that and sends the
        combine -- each in its own lanes' batches."""
        route = (src // self.gpn != dst // self.gpn) & (nbytes >= self.threshold)
        if self.nics == 1 or not route.any():
            return tuple(np.zeros(0, t) for t in (np.int64,) * 4 + (bool, np.float64, np.float64))
        i, s, t, _, d, n, proxy, peer = self._pieces(np.flatnonzero(route), src[route], dst[route], nbytes[route])
        proxied, twinned = proxy != s, peer != t
        combine = np.where(twinned, d, 0.0)
        crossing = proxied.astype(np.int64)
        # (which pieces, message, rank, wave, lane: 0 NVLink / 1 NIC, whether it sends, seconds, seconds after)
        rows = [(proxied, i, proxy, 0, 0, False, d, n + combine), (proxied, i, proxy, 1, 1, True, n, combine),
                (twinned, i, peer, crossing, 1, False, n, d), (twinned, i, peer, crossing + 1, 0, True, d, 0.0)]
        return tuple(np.concatenate([np.broadcast_to(row[f], i.shape)[row[0]] for row in rows]) for f in range(1, 8))

    def _hop_transfers(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, w: int,
                       routed: bool) -> list[tuple[np.ndarray, ...]]:
        """Per hop of the messages from ``src`` to ``dst`` (:meth:`_hops`), its
        transfers: (message index, egress port, ingress port, seconds, hop, wave,
        sending rank, receiving rank)."""
        out = []
        hops = self._hops(src, dst, nbytes, w, routed)
        for x, (on, i, a, b, sec, kind, wave) in enumerate(hops):
            # A GPU's NVLink ports are its own; a NIC crossing goes from the
            # piece's proxy (the dispatch's receiver) to its twin (the combine's sender).
            snd, rcv = ((src[i], dst[i]) if kind == DIRECT else
                        ((hops[x - 1][3] - 1) // 2, hops[x + 1][2] // 2) if kind == NIC else (a // 2, (b - 1) // 2))
            wave = np.broadcast_to(wave, i.shape)
            i, a, b, sec, wave, snd, rcv = (x.ravel() if on is None else x[on] for x in (i, a, b, sec, wave, snd, rcv))
            out.append((i, a, b, sec, np.full(len(i), kind), wave, snd, rcv))
        return out

    @staticmethod
    def _legs(hops: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
        """The legs of the transfers ``hops`` (:meth:`_hop_transfers`): (message
        index, port, seconds the leg holds the port, hop, wave, the rank whose
        lanes post it), each transfer's egress leg (its sender's) and ingress
        leg (its receiver's)."""
        legs = []
        for i, a, b, sec, kinds, wave, snd, rcv in hops:
            legs += [(i, a, sec, kinds, wave, snd), (i, b, sec, kinds, wave, rcv)]
        return tuple(np.concatenate(x) for x in zip(*legs))

    # ----------------------------------------------------------- attention
    def _attention(self, w: int, layout: PlanArrays, groups: UlyssesGroups | None, backward: bool,
                   routed: bool) -> _Segment:
        share = self.attn_share[backward]
        work = np.zeros(w)
        load = np.zeros(self._n_ports(w))
        L = layout.local_len
        if len(L):
            np.add.at(work, layout.local_rank, self._attn_s(L * (L + 1) / 2, L) * share)
        # A rank's ring transfers share its lanes with its Ulysses all-to-alls:
        # per rank when its Ulysses inputs landed, when its outputs left, and
        # its Ulysses kernels' seconds (``gate``; 0 without Ulysses).
        # Rows 3-8: per lane (NVLink, NIC) when its inputs' batch was done, when
        # its outputs' batch was posted and when it was done (what rings inside
        # a node wait for, and the hops it relays for rings: ``Relays``).
        gate = np.zeros((9, w))
        batches = ([self._ring_batch(k, ranks, lens, backward, routed, w) for k, (ranks, lens) in layout.rings.items()]
                   + packed_ring_batches(self, layout, backward, routed, w))
        followed = None
        if groups is not None:
            # The compute lane runs a rank's ring kernels of steps 0 and 1 before
            # its Ulysses kernels (the schedule's order), step 1's once the first
            # wave brought its data over a direct link: over NVLink inside a
            # node, through the NIC across (a routed link's takes more waves,
            # unfollowed here: ahead, as step 0's).
            first, first_lanes = np.zeros((2, w)), np.zeros((2, w), bool)
            for bt in batches:
                first[0] += np.bincount(bt.ranks.ravel(), bt.comp[:, :, 0].ravel(), w)
                if bt.k > 1:
                    nodes = bt.ranks // self.gpn
                    across = (nodes != np.roll(nodes, 1, axis=1)).ravel()
                    waits = ~(across & routed)
                    first[0] += np.bincount(bt.ranks.ravel()[~waits], bt.comp[:, :, 1].ravel()[~waits], w)
                    first[1] += np.bincount(bt.ranks.ravel()[waits], bt.comp[:, :, 1].ravel()[waits], w)
                    first_lanes[across.astype(np.int64)[waits], bt.ranks.ravel()[waits]] = True
            followed = groups.price(backward, work, load, gate if batches else None, first, first_lanes,
                                    self._beside_groups(batches, groups, backward))
        chains = [self._rings(batches, backward, work, load, w, gate)(load)] if batches else []
        return _Segment(work, chains, followed=followed)

    def _beside_groups(self, batches: list[RingBatch], groups: UlyssesGroups, backward: bool
                       ) -> tuple[np.ndarray, ...]:
        """The rings' transfers that a rank's lanes post in one batch with its
        Ulysses inputs (wave 0: every ring's first) or outputs
        (:data:`ULYSSES_OUT_WAVE`, those with a member at an end) -- a lane's
        batch is done with its slowest transfer and they share its ports --
        as ``surrogate_ulysses._follow``'s ``ring_*``: (sender, receiver, lane,
        seconds, egress port, ingress port, the batch's wave, whether it goes
        ahead of the groups' messages: the schedule puts a wave's K/V ahead of
        the inputs and after the outputs, its dK/dV ahead)."""
        rows = []
        member = np.zeros(groups.w, bool)
        member[groups.ranks] = True
        for bt in batches:
            if not bt.transfers:
                continue
            kind = np.concatenate([np.full(len(x[0]), i) for i, x in enumerate(bt.transfers)])
            ring, link, step, within, snd, rcv, sec, out, inn = (np.concatenate(x) for x in zip(*bt.transfers))
            at, _ = self._segment_waves(bt, kind, ring, link, step, within, backward)
            on = (at == 0) | ((at == ULYSSES_OUT_WAVE) & (member[snd] | member[rcv]))
            rows.append((snd[on], rcv[on], (out[on] >= 2 * groups.w).astype(np.int64), sec[on], out[on], inn[on],
                         at[on], ((at == 0) | (kind == 1))[on]))
        if not rows:
            return tuple(np.zeros(0, t) for t in (np.int64,) * 3 + (np.float64,) + (np.int64,) * 3 + (bool,))
        return tuple(np.concatenate(x) for x in zip(*rows))

    # -------------------------------------------------------- switch, linear
    def _switch(self, messages: tuple[np.ndarray, np.ndarray, np.ndarray], w: int, routed: bool,
                reverse: bool) -> _Segment:
        """A layout switch followed from every rank's own entry
        (``surrogate_alltoall.exchanged``): a direct message one transfer, a
        routed one its pieces' hops (:meth:`_hops`), each a wave after the one
        whose landing it carries on from."""
        src, dst, tokens = messages
        if reverse:
            src, dst = dst, src
        hops = self._hops(src, dst, tokens * self.row_bytes, w, routed)
        on, i, out, inn, sec, _, _ = hops[0]
        i, out, inn, sec = (x if on is None else x[on] for x in (i, out, inn, sec))
        # per leg: message, piece, hop, sender, receiver, lane (NIC ports follow the
        # 2 w NVLink ports), wave, seconds, egress and ingress port, and the hop it carries on from
        zero = np.zeros(len(i), np.int64)
        legs = [(i, zero, zero + DIRECT, src[i], dst[i], (out >= 2 * w).astype(np.int64), zero, sec, out, inn, zero - 1)]
        if len(hops) > 1:
            (_, i, d_out, d_in, d_sec, _, _), (_, _, n_out, n_in, n_sec, _, crossing), (_, _, c_out, c_in, c_sec, _, _) \
                = hops[1:]
            piece = np.broadcast_to(np.arange(self.nics)[:, None], i.shape)
            proxy, peer, s, t = (d_in - 1) // 2, c_out // 2, src[i], dst[i]
            dispatched, combined = proxy != s, peer != t
            one = np.ones(i.shape, np.int64)
            legs += [tuple(x[dispatched] for x in (i, piece, one * DISPATCH, s, proxy, 0 * one, 0 * one, d_sec, d_out,
                                                    d_in, 0 * one - 1)),
                     tuple(x.ravel() for x in (i, piece, one * NIC, proxy, peer, one, crossing, n_sec, n_out, n_in,
                                               np.where(dispatched, DISPATCH, -1))),
                     tuple(x[combined] for x in (i, piece, one * COMBINE, peer, t, 0 * one, crossing + 1, c_sec, c_out,
                                                 c_in, one * NIC))]
        msg, piece, hop, snd, rcv, lane, wave, held, a, b, before = (np.concatenate(x) for x in zip(*legs))
        # wave by wave, each wave's legs in the schedule's order (message, piece, hop)
        key = (msg * self.nics + piece) * 4 + hop
        order = np.lexsort((key, wave))
        key, wave = key[order], wave[order]
        by_key = np.argsort(key)
        prior = np.where(before[order] >= 0, key - hop[order] + before[order], -1)
        after = np.where(prior >= 0, by_key[np.searchsorted(key[by_key], prior)], -1)
        wave_ptr = np.searchsorted(wave, np.arange(int(wave.max()) + 2))
        snd, rcv, lane, held, a, b = (x[order] for x in (snd, rcv, lane, held, a, b))
        ranks = np.unique(np.concatenate([snd, rcv]))
        n_ports = self._n_ports(w)
        return _Segment(np.zeros(w), [], followed=lambda entry: (
            ranks, exchanged(entry, snd, rcv, lane, held, a, b, after, wave_ptr, w, n_ports)[ranks], None))

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
        groups = UlyssesGroups(self, layout, w) if len(layout.group_len) else None
        # the remap's two directions (forward's to-linear is backward's to-attention)
        switch = {reverse: self._switch(msgs, w, routed, reverse) for reverse in PASSES} if msgs is not None else None
        parts = {}
        for bw in PASSES:
            seq = [("attn", self._attention(w, layout, groups, bw, routed))]
            if switch is not None:
                seq.append(("to_linear", switch[bw]))
            seq.append(("linear", _Segment(linear * self.lin_share[bw], [])))
            if switch is not None:
                seq.append(("to_attn", switch[not bw]))
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
        out = entry + seg.work
        if seg.followed is not None:
            groups, leave, outputs = seg.followed(entry)
        for flat, gid, end, rings, gated in seg.chains:
            start = np.full(gid.max() + 1, -np.inf)
            np.maximum.at(start, gid, entry[flat])
            # A ring member starts once its ring's members' entries, each as
            # late as the member's exit waits for it, allow (a relaying rank
            # outside the rings: once its family entered).
            own = np.full(len(entry), -np.inf)
            for ranks, slack in rings:
                np.maximum.at(own, ranks, (entry[ranks][:, :, None] + slack).max(axis=1))
            begin = np.where(own[flat] > -np.inf, own[flat], start[gid])
            at = begin + end
            if gated is not None:
                # Ulysses outputs that every member of a family has done
                # earlier, as followed from the entries, than its chain has
                # them (from its begin) let what they hold back go that much
                # earlier -- a member no earlier than its kernels from its begin.
                free, anchor = gated
                on = np.flatnonzero(~np.isnan(anchor))
                early = np.full(gid.max() + 1, np.inf)
                np.minimum.at(early, gid[on], begin[on] + anchor[on] - outputs[flat[on]])
                held = np.flatnonzero((end[:len(anchor)] > free) & (early[gid[:len(anchor)]] < np.inf))
                gain = np.maximum(early[gid[held]], 0.0)
                at[held] = np.maximum(begin[held] + free[held], at[held] - gain)
            np.maximum.at(out, flat, at)
        if seg.followed is not None:
            out[groups] = np.maximum(out[groups], leave)
        return out


def surrogate_clock(cost: CostModel) -> Callable[[Plan], float]:
    """The decision's ``PlanContext.step_model`` under ``cost``: the surrogate's
    step of a plan (what the simulator's ``zeppelin``, the trainer and
    ``pretrain_gpt.py --zeppelin`` decide by)."""
    return StepSurrogate(cost).step_s


def step_floor(cost: CostModel, plan: Plan) -> float:
    """A lower bound of ``StepSurrogate(cost).step_s(plan)`` (:func:`layout_floor`)."""
    return layout_floor(cost, layout_arrays(plan.world_size, plan.seq_lens, plan.attention, None, plan.packed_rings,
                                            plan.packed_ulysses),
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
    share = layout.group_pairs * (1 + half / layout.group_block)
    pairs += np.bincount(layout.group_ranks, weights=np.repeat(share, layout.group_size), minlength=w)
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
