"""The rings of a segment, as the surrogate follows them (``planner/surrogate.py``).

:class:`RingSegments` is the part of :class:`~megatron_zeppelin.planner.surrogate.StepSurrogate`
that prices ring attention: a segment's rings grouped by size
(:class:`RingBatch`), their message legs on the ports and lanes, and each
size's chain step by step (``_ring_chain``), joined into families that share
ranks or ports (``_rings``).  It reads the cost model's shares, link and port
helpers from the surrogate it is mixed into.  The module docstring of
``planner/surrogate.py`` says what the chains follow and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_zeppelin.plan.shards import chunk_sizes
from megatron_zeppelin.planner.surrogate_lanes import LaneClock, Relays, lane_floor

#: The wave of a Ulysses group's outputs (``Schedule.waves``: all-to-all in at
#: wave 0, the kernel two more, the outputs one after it).
ULYSSES_OUT_WAVE = 3
#: A backward ring's K/V for step ``t`` travels (wave ``t - 1``) beside the dK/dV
#: of step ``t - 2``, which waits for kernel ``t - BACKWARD_LAG`` (``Schedule.waves``:
#: a kernel counts two waves, so the dK/dV that waits for kernel ``s - 1`` goes at
#: wave ``s + 1``) -- for direct rings, whose positions share their waves; a routed
#: crossing shifts the waves downstream of it, so ``_rings`` matches the waves and
#: looks for the dK/dV within ``2 * BACKWARD_LAG`` steps back.
BACKWARD_LAG = 3
#: A message leg's hop (``schedule/routing.py``): a direct transfer, or a routed
#: piece's dispatch, NIC crossing or combine -- each a wave of its own.
DIRECT, DISPATCH, NIC, COMBINE = 0, 1, 2, 3


@dataclass
class RingBatch:
    """The rings of one size ``k`` of a segment, one row per ring."""

    ranks: np.ndarray
    """(rings, k) ranks by position."""
    comp: np.ndarray
    """(rings, position, step) kernel seconds."""
    k: int
    legs: list = field(default_factory=list)
    """(ring, link, step, port, seconds held, hop, wave) arrays of every message
    leg (link ``j``: position ``j`` to ``j + 1``)."""
    relays: list = field(default_factory=list)
    """Per kind of message (K/V, then dK/dV backward), the hops that a rank
    other than the link's ends relays, as (ring, link, step, relaying rank,
    wave within the message, lane, whether it sends, seconds of the hop, of
    the hops after it) arrays (``StepSurrogate._relays``)."""
    transfers: list = field(default_factory=list)
    """Per kind of message (K/V, then dK/dV backward), its transfers as (ring,
    link, step, wave within the message, sender, receiver, seconds, egress
    port, ingress port) arrays -- what a Ulysses member's batches hold beside
    its groups' messages (``StepSurrogate._attention``)."""


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


def _lane_end(rank: np.ndarray, release: np.ndarray, seconds: np.ndarray, w: int) -> np.ndarray:
    """Per rank, when its compute lane is done with the jobs of ``seconds`` each
    released at ``release`` on ``rank`` (-inf: none).  The replay's compute lane
    runs whichever of its released ops comes first in lane order whenever it is
    free, so it idles only while none is released: whatever that order, it is
    done at the latest over its jobs of (a job's release + the seconds of every
    job released no earlier)."""
    end = np.full(w, -np.inf)
    if not len(rank):
        return end
    order = np.lexsort((-release, rank))
    rank, release, seconds = rank[order], release[order], seconds[order]
    after = np.cumsum(seconds)
    first = np.r_[0, np.flatnonzero(rank[1:] != rank[:-1]) + 1]
    after -= np.repeat(np.r_[0.0, after[first[1:] - 1]], np.diff(np.r_[first, len(rank)]))
    np.maximum.at(end, rank, release + after)
    return end


def _sharing(batches: list["RingBatch"], backward: bool, ring_of_slot: np.ndarray, rank_of_slot: np.ndarray,
             relay: list[tuple[np.ndarray, np.ndarray]], w: int) -> np.ndarray:
    """Per step and ring, a label shared by the rings that step that are
    connected through ranks of rings that still send messages that step (K/V
    up to step ``k - 2``, dK/dV up to ``k``), or relay their pieces; the last
    row holds for every later step."""
    last = np.concatenate([np.full(len(bt.ranks), bt.k if backward else bt.k - 2) for bt in batches])
    n = len(last)
    bands = np.unique(last)
    rows = []
    for lo, hi in zip(np.r_[-1, bands[:-1]], bands):
        on = last >= hi
        rings = np.concatenate([ring_of_slot[on[ring_of_slot]]] + [r[on[r]] for r, _ in relay])
        ranks = np.concatenate([rank_of_slot[on[ring_of_slot]]] + [x[on[r]] for r, x in relay])
        label = _components(rings, ranks, n, w) + len(rows) * n
        rows += [label] * int(hi - lo)
    return np.array(rows)


def _entry_leave(link_s: np.ndarray, dkv_link: np.ndarray, floor: np.ndarray, comp: np.ndarray,
                 backward: bool) -> np.ndarray:
    """Per (ring, position i, position j): when position j leaves the ring if
    position i entered at 0 and the others long before (max-plus: the replay's
    ring transfer waits for its own two ends, so a member that entered early
    starts early).  Followed as ``_ring_chain`` follows a ring
    -- a step's data reaches position j once position j - 1 had it and their
    link carried it, a kernel once its data arrived and the kernel before is
    done, a member leaves once its last message in and out landed -- from one
    entering position at a time (max-plus: the first axis).  ``link_s``: per
    (ring, link, step) a K/V's seconds (``dkv_link``: a dK/dV's); ``floor``: per (ring, step) the busiest port of
    the rings joined to it that step; ``comp``: per (ring, position, step)
    kernel seconds."""
    n, k = comp.shape[:2]
    got = np.broadcast_to(np.where(np.eye(k, dtype=bool), 0.0, -np.inf), (n, k, k))
    link, kernels = link_s[:, None], comp[:, None]
    done = got + kernels[..., 0]
    for t in range(1, k):
        got = np.maximum(np.roll(got + link[..., t - 1], 1, axis=2), got + floor[:, t - 1, None, None])
        done = np.maximum(done, got) + kernels[..., t]
    final = got
    if backward:        # the last dK/dV, after the position before ran its last kernel
        got = np.maximum(np.roll(got + link[..., k - 1], 1, axis=2), got + floor[:, k - 1, None, None])
        final = np.maximum(got, np.roll(done, 1, axis=2)) + np.roll(dkv_link[:, None, :, k], 1, axis=2)
    return np.maximum(np.maximum(final, np.roll(final, -1, axis=2)), done)


def _link_seconds(hops: np.ndarray) -> np.ndarray:
    """Per kind of message (K/V, dK/dV), ring, link and step, the seconds a link
    carries it: a direct transfer's wave, or a routed piece's hops one after
    another (``hops``: the same axes, then the hop)."""
    return np.maximum(hops[..., DIRECT], hops[..., DISPATCH:].sum(axis=-1))


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


class RingSegments:
    """Ring attention's methods of ``StepSurrogate`` (see the module docstring)."""

    def _ring_batch(self, k: int, ranks: np.ndarray, L: np.ndarray, backward: bool, routed: bool,
                    w: int) -> "RingBatch":
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
        batch = RingBatch(ranks, comp, k)
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

        def send(steps: np.ndarray, owners: np.ndarray, itemsize: int) -> None:
            nbytes = 2 * shard[:, owners] * self.kv_numel * itemsize         # (ring or tuple, link, step)
            senders = tuples if inside else ranks
            shape = nbytes.shape
            src = np.broadcast_to(senders[:, :, None], shape).ravel()
            dst = np.broadcast_to(np.roll(senders, -1, axis=1)[:, :, None], shape).ravel()
            hopped = self._hop_transfers(src, dst, nbytes.ravel(), w, routed)
            msg, port, held, hop, wave, owner = self._legs(hopped)
            i, out, inn, sec, _, within, snd, rcv = (np.concatenate(x) for x in zip(*hopped))
            ring, link, col = np.unravel_index(msg, shape)
            t_ring, t_link, t_col = np.unravel_index(i, shape)
            if inside:
                held, sec = held + extra[ring] * self.nvl_lat, sec + extra[t_ring] * self.nvl_lat
                ring, t_ring = first[ring], first[t_ring]
            batch.legs.append((ring, link, steps[col], port, held, hop, wave, owner))
            batch.transfers.append((t_ring, t_link, steps[t_col], within, snd, rcv, sec, out, inn))
            if routed and not inside:
                msg, *relayed = self._relays(src, dst, nbytes.ravel())
                ring, link, col = np.unravel_index(msg, shape)
                batch.relays.append((ring, link, steps[col], *relayed))

        pos = np.arange(k)
        kv_steps = np.arange(k - 1)
        send(kv_steps, (pos[:, None] - kv_steps[None, :]) % k, self.isz)
        if backward:
            dkv_steps = np.arange(1, k + 1)
            send(dkv_steps, (pos[:, None] - dkv_steps[None, :] + 1) % k, self.acc)
        return batch

    def _rings(self, batches: list["RingBatch"], backward: bool, work: np.ndarray, load: np.ndarray, w: int,
               gate: np.ndarray):
        """Every ring of the segment, as the engine's lanes run it: step ``s``'s
        transfers of a rank are batches of its lanes (one wave for a direct
        link, up to three for a routed one: dispatch, NIC, combine), and the K/V a
        position forwards at step ``s`` is what it received at step ``s - 1``.
        So the data of step ``s`` reaches a position once the position before
        had it and their link carried it, each wave lasting as long as the
        busiest port of its legs in the family (rings sharing ranks share
        lanes and ports), and no sooner than a step after the previous one at
        the busiest port of the rings joined to it that step (``_sharing``;
        unless the family routes pieces: then its
        positions cross at different waves, and the ranks relaying the pieces
        pace them wave by wave, :class:`Relays`).  A rank's kernel of step
        ``s`` waits for that data.  Adds kernels to ``work`` and messages to
        ``load``; returns the function of the segment's port loads that yields
        each ring (or relaying) rank's seconds from the family's start to its
        exit (``_Segment.chains``)."""
        S = max(bt.k for bt in batches) + 1
        ranks = [bt.ranks for bt in batches]
        base = np.cumsum([0] + [len(r) for r in ranks])
        ring_of_slot = np.concatenate([np.repeat(np.arange(len(r)) + base[i], r.shape[1])
                                       for i, r in enumerate(ranks)])
        rank_of_slot = np.concatenate([r.ravel() for r in ranks])
        # A routed piece's proxy relays it in its own lanes' batches: the rings
        # whose pieces a rank relays share its lanes as its own rings do.
        # (NVLink ports are numbered 2 * rank and 2 * rank + 1)
        relay = [(base[i] + ring[port < 2 * w], port[port < 2 * w] // 2) for i, bt in enumerate(batches)
                 for ring, _, _, port, _, _, _, _ in bt.legs]
        family = _components(np.concatenate([ring_of_slot] + [r for r, _ in relay]),
                             np.concatenate([rank_of_slot] + [x for _, x in relay]), int(base[-1]), w)
        fam_of_rank = np.full(w, -1)
        fam_of_rank[rank_of_slot] = family[ring_of_slot]
        relay_fam = np.full(w, -1)
        for ring, rank in relay:
            relay_fam[rank] = family[ring]
        F = int(family.max()) + 1
        n_ports = len(load)
        # Per (rank, step) kernel seconds: summed ring after ring (bincount adds
        # in order, as a loop would).
        lane = np.bincount(np.concatenate([(bt.ranks[:, :, None] * S + np.arange(bt.k)).ravel() for bt in batches]),
                           np.concatenate([bt.comp.ravel() for bt in batches]), w * S).reshape(w, S)
        work += lane.sum(axis=1)
        # A rank's compute lane runs its Ulysses kernels (once their inputs
        # landed) beside its ring kernels, in the schedule's order: at step 1.
        if S > 1:
            lane[:, 1] += gate[2]
        legs = [(ring, link, step, port, held, hop, wave, owner, family[base[i] + ring], np.full(len(ring), kind))
                for i, bt in enumerate(batches)
                for kind, (ring, link, step, port, held, hop, wave, owner) in enumerate(bt.legs)]
        # the legs of batch i: leg_at[i] .. leg_at[i + 1]
        leg_at = np.cumsum([0] + [sum(len(leg[0]) for leg in bt.legs) for bt in batches])
        # Per (ring, step): the busiest port over every leg of that step of the
        # rings it shares ranks with through rings that still send then (what a
        # rank's lanes need per step at the least: a lane's batch holds every
        # ring's transfers of its wave); per leg: its port's load in its own
        # wave (the batches posted in that wave: a K/V beside the dK/dV of an
        # earlier step, one hop of routed pieces beside what their relays post then).
        busiest = np.zeros((int(base[-1]), S))
        waves = []
        routes = np.zeros(F, bool)      # the families that route pieces
        if legs:
            ring, link, step, port, held, hop, wave, owner, lfam, kind = (np.concatenate(x) for x in zip(*legs))
            np.add.at(load, port, held)
            sharing = _sharing(batches, backward, ring_of_slot, rank_of_slot, relay, w)
            ring_at = np.concatenate([base[i] + leg[0] for i, bt in enumerate(batches) for leg in bt.legs])
            label = sharing[np.minimum(step, sharing.shape[0] - 1), ring_at]
            both, of = np.unique((label * S + step) * n_ports + port, return_inverse=True)
            keys, of_key = np.unique(both // n_ports, return_inverse=True)
            most = np.zeros(len(keys))
            np.maximum.at(most, of_key, np.bincount(of, weights=held))
            steps = np.arange(S)
            want = sharing[np.minimum(steps, sharing.shape[0] - 1)].T * S + steps
            j = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
            busiest = np.where(keys[j] == want, most[j], 0.0)
            # Each leg's wave in the segment (``_segment_waves``).
            at = np.empty(len(ring), np.int64)
            for i, bt in enumerate(batches):
                on = slice(leg_at[i], leg_at[i + 1])
                at[on], ring_waves = self._segment_waves(bt, kind[on], ring[on], link[on], step[on], wave[on],
                                                         backward)
                waves.append(ring_waves)
            # A port carries its wave's transfers back to back in the order they
            # start: a receiving port's batch is done once it carried them all,
            # a sending port's transfer once it carried those before it too (in
            # the schedule's order: by step, K/V before dK/dV, ring, link, hop).
            _, inv = np.unique((lfam * (at.max() + 1) + at) * n_ports + port, return_inverse=True)
            in_wave = np.bincount(inv, weights=held)[inv]
            sends = port % 2 == 0
            seq = np.concatenate([np.full(leg_at[i + 1] - leg_at[i], i) for i in range(len(batches))])
            order = np.lexsort((hop, link, ring, seq, kind, step, inv))
            ahead = np.cumsum(held[order])
            starts = np.r_[True, inv[order][1:] != inv[order][:-1]]
            ahead -= np.repeat(ahead[starts] - held[order][starts], np.diff(np.r_[np.flatnonzero(starts), len(order)]))
            in_wave[order[sends[order]]] = ahead[sends[order]]
            # A rank's lanes post their batches wave after wave, a relayed piece
            # in the wave after its previous hop landed (``surrogate_lanes.py``).
            lane_of = (port >= 2 * w).astype(np.int64)
            span = int(at.max()) + 1
            mine, of = np.unique(((owner * 2 + lane_of) * span + at) * n_ports + port, return_inverse=True)
            key, of_batch = np.unique(mine // n_ports, return_inverse=True)
            busiest_port = np.zeros(len(key))
            np.maximum.at(busiest_port, of_batch, np.bincount(of, weights=held))
            # a proxy's NIC crossing (wave 1 of its piece) and a twin's combine, as sent
            relayed = np.zeros(len(key), np.bool_)
            relayed[of_batch[of[(port % 2 == 0) & (((hop == NIC) & (wave == 1)) | (hop == COMBINE))]]] = True
            b_rank, b_lane, b_wave = key // (2 * span), key // span % 2, key % span
            order = np.argsort(b_wave, kind="stable")
            floor_s = np.empty(len(key))
            floor_s[order] = lane_floor(b_rank[order], b_lane[order], b_wave[order], busiest_port[order],
                                        relayed[order], w)
            paced = LaneClock([(b_rank, b_lane, b_wave, np.full(len(key), -np.inf), floor_s)])
            # A family that routes pieces does not step together: a crossing
            # spreads a step over up to three waves, positions cross at
            # different waves, and the ranks relaying the pieces pace them
            # wave by wave; its ports bind through each hop's load and the drain.
            routes[lfam[hop != DIRECT]] = True
            busiest[routes[family]] = 0.0
        else:
            port, lfam, paced = np.zeros(0, np.int64), np.zeros(0, np.int64), None
        inputs = []
        for i, bt in enumerate(batches):
            # per kind of message (K/V, dK/dV), ring, link, step and hop: its wave's seconds
            hops = np.zeros((2,) + bt.comp.shape[:2] + (bt.k + 1, 4))
            if legs:
                on = slice(leg_at[i], leg_at[i + 1])
                np.maximum.at(hops, (kind[on], ring[on], link[on], step[on], hop[on]), in_wave[on])
            else:
                waves.append(self._ring_waves(np.ones((len(bt.ranks), bt.k, bt.k + 1), np.int64), backward))
            nodes = bt.ranks // self.gpn
            # (none where no piece is relayed: no lane clock is built then)
            relays = [Relays(x) for x in bt.relays]
            relays = relays if any(len(x.rank) for x in relays) else []
            inputs.append((hops, waves[i], nodes != np.roll(nodes, -1, axis=1), relays, paced))
        # A Ulysses member's lanes post its inputs at wave 0 and its outputs at
        # ULYSSES_OUT_WAVE, once its kernels are done (``gate`` rows 3-8).
        member = np.flatnonzero(gate[2] > 0)
        none = np.zeros(len(member))
        ulysses = [(member, np.full(len(member), lane), np.full(len(member), wave), posted, gate[row + lane, member])
                   for lane in range(2)
                   for wave, posted, row in ((0, none, 3), (ULYSSES_OUT_WAVE, gate[5 + lane, member], 7))]

        def chain(clock: LaneClock | None, events: list | None) -> tuple:
            """Per ring kernel (rank, when its data arrived), per rank when its last
            dK/dV left and when it relayed its last piece, the relayed pieces paced by
            ``clock``; adds the rings' batches to ``events`` (unless None)."""
            released = []
            last, relayed = np.zeros(w), np.full(w, -np.inf)
            for i, bt in enumerate(batches):
                got, final = self._ring_chain(bt, *inputs[i], busiest[base[i]:base[i + 1]], lane, gate,
                                              backward, clock, relayed, events)
                released.append(got[:, :, :bt.k].ravel())
                np.maximum.at(last, bt.ranks.ravel(), final.ravel())
            return np.concatenate(released), last, relayed

        # Once with the Ulysses batches alone, then with the rings' batches as
        # the first pass had them: a rank relays pieces in its own lanes'
        # batches, so rings that relay each other's pieces move at the slower
        # one's pace, wave by wave; and a rank in several rings posts their
        # transfers of a wave in one batch of a lane, which is done with the
        # slowest of them, and only then posts the next wave's.
        pieces = any(len(x.rank) for bt in inputs for x in bt[3])
        shared = np.bincount(rank_of_slot, minlength=w).max(initial=0) > 1
        events = [] if shared or pieces else None
        released, last, relayed = chain(LaneClock(ulysses) if pieces else None, events)
        if events is not None:
            released, last, relayed = chain(LaneClock(ulysses + events), None)
        members = np.nonzero(fam_of_rank >= 0)[0]
        # A rank's kernel jobs: every ring kernel, released when its step's data
        # arrived, and its Ulysses kernels, once their inputs landed.
        on_member = member[fam_of_rank[member] >= 0]
        end = _lane_end(np.concatenate([np.repeat(bt.ranks.ravel(), bt.k) for bt in batches] + [on_member]),
                        np.concatenate([released, gate[0, on_member]]),
                        np.concatenate([bt.comp.ravel() for bt in batches] + [gate[2, on_member]]), w)[members]
        # and no earlier than the last transfer of its family it takes part in.
        last = last[members]
        # The Ulysses batches above are timed from every rank entering at the
        # family's start, but the groups are followed from each rank's own
        # entry (``UlyssesGroups.price``) and span ranks far outside the
        # family: where every member of a family has its outputs done earlier
        # than here, what those batches hold back goes that much earlier
        # (``StepSurrogate._advance``), down to the member's kernels, ring and
        # Ulysses, one after another from its begin (and no earlier than it
        # relays pieces: ``free``; a floor, not its chain without the groups,
        # which would price the rings twice).  Not in a family that routes
        # pieces (ranks outside it relay them in batches of their own), nor in
        # one with a member outside the groups: its batches pace the others
        # from its own entry (a ring's dK/dV riding a member's outputs' batch
        # holds a rank outside the groups as long as it held it).
        # (``anchor``: per member when its outputs were done here, ``gate``
        # row 1; NaN: a family that routes or has a member outside the groups)
        fam = fam_of_rank[members]
        outside = np.bincount(fam, gate[2, members] <= 0, F) > 0
        anchor = np.where(~routes[fam] & ~outside[fam], gate[1, members], np.nan)
        free = np.maximum(lane.sum(axis=1)[members], relayed[members])
        # A rank that relays pieces leaves once it relayed its last one.
        relaying = np.flatnonzero((relayed > -np.inf) & (fam_of_rank < 0))
        end = np.maximum(np.r_[end, relayed[relaying]], np.r_[relayed[members], relayed[relaying]])
        last = np.r_[last, end[len(members):]]
        members = np.r_[members, relaying]
        fam_of_rank[relaying] = relay_fam[relaying]

        # A ring's transfers wait for their own two ends only: how late a
        # member's exit is when each member entered late, against the latest
        # of its rings' exits when all enter at once -- in a family whose
        # rings all hold the same ranks (a rank in rings of other ranks, or
        # relaying their pieces, couples them through its lanes, and a family
        # that routes pieces is paced by its relays' lanes: such a family
        # starts once its last member entered).
        in_family = family[ring_of_slot]
        alike = (np.bincount(in_family, minlength=F)
                 == np.bincount(fam_of_rank[np.unique(rank_of_slot)], minlength=F) * np.bincount(family, minlength=F))
        alike[relay_fam[relaying]] = False
        alike &= ~routes        # paced by their relays' lanes wave by wave, which _entry_leave does not follow
        keep = [alike[family[base[i]:base[i + 1]]] for i in range(len(batches))]
        # per kind of message (K/V, dK/dV): a link's seconds, as ``_ring_chain`` takes them
        links = [_link_seconds(hops) for hops, *_ in inputs]
        leave = [_entry_leave(kv[on], dkv[on], busiest[base[i]:base[i + 1]][on], bt.comp[on], backward)
                 for i, (bt, (kv, dkv), on) in enumerate(zip(batches, links, keep))]
        latest = np.full(w, -np.inf)
        for bt, x, on in zip(batches, leave, keep):
            np.maximum.at(latest, bt.ranks[on], x.max(axis=1))
        slack = [(bt.ranks[on], x - latest[bt.ranks[on]][:, None, :]) for bt, x, on in zip(batches, leave, keep)]

        def finish(total: np.ndarray) -> tuple:
            drain = np.zeros(F)
            if len(port):
                np.maximum.at(drain, lfam, total[port])
            fam = fam_of_rank[members]
            ends = np.maximum(np.maximum(end, last), drain[fam])
            if np.isnan(anchor).all():
                return members, fam, ends, slack, None
            # (the relaying ranks after the members hold no anchor)
            return members, fam, ends, slack, (np.maximum(free, drain[fam[:len(anchor)]]), anchor)

        return finish

    def _segment_waves(self, bt: "RingBatch", kind: np.ndarray, ring: np.ndarray, link: np.ndarray,
                       step: np.ndarray, wave: np.ndarray, backward: bool) -> tuple[np.ndarray, tuple]:
        """Each of ``bt``'s message legs' (or transfers': ``kind`` 0 a K/V, 1 a
        dK/dV, on ``ring``'s ``link`` at ``step``, ``wave`` within its
        message) wave in the segment -- its message's first hop's (after the
        K/V it forwards; a dK/dV's after its kernel and the dK/dV it adds to)
        plus the hop's within the message -- and the rings' waves
        (:meth:`_ring_waves`)."""
        span = np.ones((len(bt.ranks), bt.k, bt.k + 1), np.int64)
        np.maximum.at(span, (ring, link, step), wave + 1)
        waves = self._ring_waves(span, backward)
        kv_wave, dkv_sent, _ = waves
        return np.where(kind == 0, kv_wave[ring, link, step] + 1, dkv_sent[ring, link, step]) + wave, waves

    @staticmethod
    def _ring_waves(spans: np.ndarray, backward: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (ring, position, step) the waves (``Schedule.waves``) of the
        transfer that delivered the position's data of the step (-1: its own),
        of the first hop of the dK/dV it sends at the step (after its kernel
        of the step before: two waves after that kernel's data; and after the
        dK/dV it received), of that dK/dV's arrival; ``spans``: per (ring,
        link, step) the waves its message takes."""
        n, k = spans.shape[:2]
        kv_wave = np.full((n, k, k + 1), -1)
        dkv_sent = np.full((n, k, k + 1), -2 * k - 9)
        dkv_got = np.full((n, k, k + 1), -2 * k - 9)
        for t in range(1, k + 1):
            kv_wave[:, :, t] = np.roll(kv_wave[:, :, t - 1] + spans[:, :, t - 1], 1, axis=1)
            if backward:
                dkv_sent[:, :, t] = np.maximum(kv_wave[:, :, t - 1] + 2, dkv_got[:, :, t - 1]) + 1
                dkv_got[:, :, t] = np.roll(dkv_sent[:, :, t] + spans[:, :, t] - 1, 1, axis=1)
        return kv_wave, dkv_sent, dkv_got

    @staticmethod
    def _ring_chain(bt: "RingBatch", hops: np.ndarray, waves: tuple, crossing: np.ndarray, relays: list,
                    paced: LaneClock | None,
                    floor: np.ndarray, lane: np.ndarray, gate: np.ndarray, backward: bool,
                    clock: LaneClock | None, relayed_until: np.ndarray, events: list | None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The rings of one size step by step: (per (ring, position, step) when
        the step's data reached the position, per (ring, position) when its
        last message -- the K/V forward, the dK/dV backward -- in and out
        landed).  ``hops``: per kind of message (K/V, dK/dV), ring, link, step
        and hop its wave's seconds; ``waves``: :meth:`_ring_waves`;
        ``crossing``: per (ring, link) whether it leaves the node; ``relays``:
        the hops other ranks relay (:class:`Relays`, K/V then dK/dV), paced by
        their lanes' batches in ``clock`` (which also paces direct links by
        the batches of both their ends); ``paced``: every rank's lanes' floor
        per wave (``surrogate_lanes.py``; None without legs); ``floor``: per
        (ring, step) the busiest port of the rings joined to it that step;
        ``gate``: per rank and lane when the Ulysses inputs landed and the
        outputs left (``_attention``).  Raises
        ``relayed_until`` per rank to when it relayed its last piece of these
        rings, and adds the rings' batches to ``events`` (:class:`LaneClock`;
        unless None)."""
        n, k = bt.ranks.shape
        # Data reaches position j at step s when the position before had it at
        # step s - 1 and the link between them carried it: a direct link in one
        # wave, a routed one in its hops one after another (every position
        # of the ring at once); and no sooner than the step before plus the
        # busiest port of the rings joined to it that step.
        link_s, dkv_link = _link_seconds(hops)
        first_hop, dkv_first = np.maximum(hops[..., DIRECT], hops[..., DISPATCH])
        # the hop a K/V lands in: a routed piece's combine (or NIC crossing into the receiver)
        last_hop = np.where(hops[0, ..., COMBINE] > 0, hops[0, ..., COMBINE],
                            np.maximum(hops[0, ..., DIRECT], hops[0, ..., NIC]))
        # A link's batches: on NVLink inside a node, through a NIC across, routed on both.
        on_lane = (~crossing | (hops[..., NIC].max(axis=(0, 3)) > 0), crossing)
        ranks = bt.ranks
        # per (ring, position) the lanes the link into it lands on; per (ring, position, step) whether it combines
        into = [np.roll(on, 1, axis=1) for on in on_lane]
        combined = np.roll(hops[0, ..., COMBINE] > 0, 1, axis=1).astype(np.int64)

        def batch(at_receiver: bool, wave: np.ndarray, posted: np.ndarray | None, done: np.ndarray) -> None:
            if events is None:
                return
            for ln, on in enumerate(into if at_receiver else on_lane):
                events.append((ranks[on], np.full(int(on.sum()), ln), wave[on],
                               np.full(int(on.sum()), -np.inf) if posted is None else posted[on], done[on]))

        ends = bt.ranks, np.roll(bt.ranks, 1, axis=1)
        # A link waits for the Ulysses batches of the lanes it takes at both
        # its ends (NVLink inside a node, the NIC across, both when routed):
        # per (ring, position) those of the link into it.
        after_in, posted_out, after_out = (
            np.max([np.where(into[ln], gate[row + ln][r], 0.0) for ln in (0, 1) for r in ends], axis=0)
            for row in (3, 5, 7))
        # (a receiver's outputs' batch: done with the transfers of that wave it holds)
        out_at_receiver = np.max([np.where(into[ln], gate[7 + ln][bt.ranks], 0.0) for ln in (0, 1)], axis=0)

        def ulysses_batch(wave: np.ndarray, link: np.ndarray) -> np.ndarray:
            """When a transfer of ``wave`` on the link into each position, carried
            in ``link`` seconds, has moved at the earliest: after the Ulysses
            inputs' batch; in the outputs' wave, in their batches, once both
            ends posted them (:meth:`landing`); after it, once they left."""
            return np.where(wave > ULYSSES_OUT_WAVE, after_out,
                            np.where(wave == ULYSSES_OUT_WAVE, posted_out + link, np.where(wave >= 1, after_in, 0.0)))

        def landing(wave: np.ndarray) -> np.ndarray:
            """When it lands at the earliest: in the outputs' wave, with the
            receiver's outputs' batch (``StepSurrogate._beside_groups``) -- its
            sender is done with it once it moved."""
            return np.where(wave == ULYSSES_OUT_WAVE, out_at_receiver, 0.0)

        got = np.zeros((n, k, k + 1))
        moved = np.zeros((n, k, k + 1))                 # when the step's data has moved (landed: ``got``)
        kv_wave, dkv_sent, dkv_got = waves
        kernels = lane[bt.ranks, :k + 1]                # (n, k, step) the rank's kernels
        done = np.zeros((n, k, k + 1))                  # when a position's kernel of each step is done
        done[:, :, 0] = kernels[:, :, 0]
        ulysses_in = np.where(gate[2][bt.ranks] > 0, gate[0][bt.ranks], 0.0)
        # A direct link's transfer of wave ``x`` starts once the lanes it takes
        # at both its ends are done with their batches before (which hold the
        # transfers of every ring and group on those ranks): per (ring,
        # position) for the link into it, and the seconds it holds.
        direct_in = ~(into[0] & into[1])
        direct_out = np.roll(direct_in, -1, axis=1)
        nic_in = into[1].astype(np.int64)

        def lanes_free(x: np.ndarray, seconds: np.ndarray) -> np.ndarray:
            if clock is None:
                return np.zeros(x.shape)
            before = [clock.done_by(r.ravel(), nic_in.ravel(), x.ravel() - 1) for r in ends]
            return np.where(direct_in, np.maximum(*before).reshape(x.shape) + seconds, 0.0)

        for t in range(1, k + 1):
            sent = got[:, :, t - 1] + link_s[:, :, t - 1]
            if relays:
                sent = np.maximum(sent, relays[0].bound(t - 1, kv_wave[:, :, t - 1] + 1, clock))
            got[:, :, t] = np.maximum(np.roll(sent, 1, axis=1), got[:, :, t - 1] + floor[:, t - 1, None])
            if backward:
                # The K/V's batches at its sender (its first wave) and at its
                # receiver (its last) hold the dK/dV sent in that wave, which
                # waits for the kernel of the step before it on that end: the
                # K/V leaves the sender after it, and its last hop lands with
                # the receiver's batch, once both it and that dK/dV moved.
                lo = max(1, t - 2 * BACKWARD_LAG)
                window = dkv_sent[:, :, lo:t + 1]
                match = window == (kv_wave[:, :, t - 1] + 1)[:, :, None]
                sender = np.where(match, done[:, :, lo - 1:t], 0.0).max(axis=2) + link_s[:, :, t - 1]
                match = window == kv_wave[:, :, t][:, :, None]
                receiver = (np.where(match, done[:, :, lo - 1:t], 0.0).max(axis=2)
                            + np.maximum(np.roll(last_hop[:, :, t - 1], 1, axis=1),
                                         np.where(match, dkv_first[:, :, lo:t + 1], 0.0).max(axis=2)))
                got[:, :, t] = np.maximum(got[:, :, t], np.maximum(np.roll(sender, 1, axis=1), receiver))
            wave = kv_wave[:, :, t]
            if paced is not None:
                # it lands once the receiver's batches it lands in are done:
                # the last wave's on NVLink (a direct link inside the node, a
                # routed piece's combine), through the NIC the wave before
                # (a routed piece crossing into the receiver) or the last
                for ln, on in enumerate(into):
                    at_wave = wave - (ln == 1) * combined[:, :, t - 1]
                    got[:, :, t] = np.maximum(got[:, :, t], np.where(on, paced.done_by(
                        ranks.ravel(), np.full(ranks.size, ln), at_wave.ravel()).reshape(ranks.shape), -np.inf))
            # a batch after the Ulysses inputs' lands after them; the outputs' batch, once they left
            into_link = np.roll(link_s[:, :, t - 1], 1, axis=1)
            moved[:, :, t] = np.maximum(got[:, :, t], np.maximum(ulysses_batch(wave, into_link),
                                                                 lanes_free(wave, into_link)))
            got[:, :, t] = np.maximum(moved[:, :, t], landing(wave))
            done[:, :, t] = np.maximum(done[:, :, t - 1], got[:, :, t]) + kernels[:, :, t]
            if t == 1:
                done[:, :, 1] = np.maximum(done[:, :, 1], ulysses_in + kernels[:, :, 1])
            if relays:
                relays[0].relayed(t - 1, np.roll(got[:, :, t], -1, axis=1), relayed_until)
            if t < k:          # the K/V of step t - 1: sent, then received
                out = np.where(direct_out, np.roll(moved[:, :, t], -1, axis=1),
                               got[:, :, t - 1] + first_hop[:, :, t - 1])
                batch(False, kv_wave[:, :, t - 1] + 1, got[:, :, t - 1], out)
                batch(True, kv_wave[:, :, t], None, got[:, :, t])
            if backward:
                # The dK/dV of step t, once this ring's kernel of step t - 1 is
                # done: ``done`` holds every ring's kernels of the rank's step,
                # but the lane runs a ring's kernel as soon as its data is there.
                before = done[:, :, t - 2] if t > 1 else 0.0
                start = np.maximum(before, got[:, :, t - 1]) + bt.comp[:, :, t - 1]
                into_link = np.roll(dkv_link[:, :, t], 1, axis=1)
                left = np.maximum.reduce([np.roll(start, 1, axis=1) + into_link,
                                          ulysses_batch(dkv_got[:, :, t], into_link),
                                          lanes_free(dkv_got[:, :, t], into_link)])
                land = np.maximum(left, landing(dkv_got[:, :, t]))
                batch(False, dkv_sent[:, :, t], start, np.where(direct_out, np.roll(left, -1, axis=1),
                                                                start + dkv_first[:, :, t]))
                batch(True, dkv_got[:, :, t], None, land)
        if backward:
            # the last dK/dV leaves once the position before ran its last
            # kernel, in its batch of its wave
            last_link = np.roll(dkv_link[:, :, k], 1, axis=1)
            sent = np.maximum.reduce([np.maximum(got[:, :, k], np.roll(done[:, :, k - 1], 1, axis=1)) + last_link,
                                      ulysses_batch(dkv_got[:, :, k], last_link),
                                      lanes_free(dkv_got[:, :, k], last_link)])
            if relays:
                sent = np.maximum(sent, np.roll(relays[1].bound(k, dkv_sent[:, :, k], clock), 1, axis=1))
                relays[1].relayed(k, np.roll(sent, -1, axis=1), relayed_until)
            final = np.maximum(sent, landing(dkv_got[:, :, k]))
        else:                   # forward, the last message is the K/V of step k - 2
            sent, final = moved[:, :, k - 1], got[:, :, k - 1]
        # a position's lanes are done once it received its last message and its successor's moved
        return got, np.maximum(final, np.roll(sent, -1, axis=1))
