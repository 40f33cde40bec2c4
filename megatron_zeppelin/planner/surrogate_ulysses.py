"""The surrogate clock's Ulysses groups (``planner/surrogate.py``).

A group of ``d`` ranks runs an all-to-all in (always direct), its kernel on
``1/d`` of the heads, and an all-to-all out: ``d * (d - 1)`` messages each, a
message carrying its sender's tokens in and its receiver's out, over NVLink
to a member on its node and through the NICs to the rest.  As the engine runs
them (``Schedule.waves``, ``comm/lanes.py``), a rank posts its inputs of every
group it is in as one batch per lane (NVLink, NIC) when it enters the
segment, and its outputs as one later batch per lane once the kernels of that
lane's groups are done; a kernel's data is there once its rank's batches it
came by are done.  Every port carries its messages back to back in the order
they start (both ends posted), and a message has moved once both its ports
carried it -- the replay's rule (``planner/surrogate_alltoall.py``).  A rank's
compute lane runs, whenever it is free, the first op in the schedule's order
whose data is there (``schedule/ops.py``): its ring kernels of steps 0 and 1,
its Ulysses kernels in plan order, then its local sequences in kernel calls of
at least ``AttnShape.local_pack_tokens`` rows, which fill the lane while no
kernel's data is there -- and a call that started runs to its end while a
kernel's data lands.  So a member whose entry, inputs or local calls differ
from the others' delays its groups, and every layer the ranks enter at
different times.  A rank's lanes post its rings' transfers of those waves in
the same batches (its first ring K/V beside the inputs, what its rings send
in the outputs' wave beside the outputs), which are done with their slowest
transfer and share their ports (a 25 MB ring K/V in the inputs' batch of a
rank of two groups and an inter-node ring held its Ulysses kernels 0.5 ms);
and its compute lane runs its ring kernels of step 1 once the first wave
brought their data.  So the groups are followed message by message and
kernel by kernel from every rank's own entry (:meth:`UlyssesGroups.price`
returns that function of the entries), in one compiled pass (:func:`_follow`).
What both passes share is built once per plan (:class:`UlyssesGroups`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
from numba import njit

from megatron_zeppelin.pair_heap import key_pop, key_push
from megatron_zeppelin.planner.plan_arrays import PlanArrays
from megatron_zeppelin.planner.surrogate_alltoall import carried
from megatron_zeppelin.schedule.attention import AttnShape

if TYPE_CHECKING:
    from megatron_zeppelin.planner.surrogate import StepSurrogate

#: Rows of a rank's consecutive local sequences per kernel call (the schedule's).
LOCAL_PACK_TOKENS = AttnShape.local_pack_tokens


@njit(cache=True)
def _joined(ring, before, after, x):
    """The rings' transfers ``ring[before]``, then ``x``, then ``ring[after]``."""
    return np.concatenate((ring[before], x, ring[after]))


@njit(cache=True)
def _batches(post, src, dst, lane, held, port_out, port_in, w, n_ports):
    """Per lane and rank when its batch of these transfers is done (0: none),
    every end posting at ``post`` (``carried``)."""
    moved = carried(post, src, dst, lane, held, port_out, port_in, w, np.full(n_ports, -np.inf))
    done = np.zeros((2, w))
    for i in range(len(src)):
        done[lane[i], src[i]] = max(done[lane[i], src[i]], moved[i])
        done[lane[i], dst[i]] = max(done[lane[i], dst[i]], moved[i])
    return done


@njit(cache=True)
def _follow(entry, first, first_lanes, src, dst, lane, held_in, held_out, port_out, port_in, rank, kernel, lanes,
            chain_ptr, chain_slot, pack_ptr, pack_s, w, ring_src, ring_dst, ring_lane, ring_held, ring_out, ring_in,
            ring_wave, ring_ahead):
    """One pass of the groups from every rank's ``entry``: (per lane and rank
    when its inputs' batch was done, when its outputs' batch was posted and
    when it was done, per rank of ``chain_ptr`` when its compute lane ran its
    last kernel and local call).
    Members (``rank``, ``kernel`` seconds, ``lanes``: which lanes it receives
    on) in ``chain_slot`` by rank (``chain_ptr``), each rank's in plan order;
    its local calls' seconds ``pack_s`` by rank (``pack_ptr``); ``first``: per
    rank the lane's work ahead of its Ulysses kernels in order -- its ring
    kernels of step 0 (row 0), released on entry, and of step 1 (row 1),
    released once its batches of the lanes ``first_lanes`` brought their data
    in the first wave (with the inputs); ``ring_*``: the rings'
    transfers that go in the inputs' batches (``ring_wave`` 0) or the outputs'
    (else), ahead of the groups' messages or after them (``ring_ahead``: the
    schedule's order), sharing their ports."""
    post = np.empty(2 * w)
    post[:w] = entry
    post[w:] = entry
    n_ports = max(port_out.max(), port_in.max(), ring_out.max() if len(ring_out) else 0,
                  ring_in.max() if len(ring_in) else 0) + 1
    by_wave = []
    for x in (ring_wave == 0, ring_wave != 0):
        by_wave.append((x & ring_ahead, x & ~ring_ahead))
    a, b = by_wave[0]
    landed = _batches(post, _joined(ring_src, a, b, src), _joined(ring_dst, a, b, dst),
                      _joined(ring_lane, a, b, lane), _joined(ring_held, a, b, held_in),
                      _joined(ring_out, a, b, port_out), _joined(ring_in, a, b, port_in), w, n_ports)
    inputs = landed.copy()
    ready = np.zeros(len(rank))
    for j in range(len(rank)):
        for x in range(2):
            if lanes[x, j]:
                ready[j] = max(ready[j], landed[x, rank[j]])
    done = np.zeros(len(rank))
    lane_end = np.empty(len(chain_ptr) - 1)
    waiting = np.empty(chain_ptr[-1] if len(chain_ptr) else 0, np.int64)   # a min-heap of places in order
    for c in range(len(chain_ptr) - 1):
        lo, hi = chain_ptr[c], chain_ptr[c + 1]
        r = rank[chain_slot[lo]]
        t = entry[r] + first[0, r]
        ring_ready, ring_left = entry[r], first[1, r] > 0       # the ring kernels of step 1
        for x in range(2):
            if first_lanes[x, r]:
                ring_ready = max(ring_ready, landed[x, r])
        pk, pend = pack_ptr[c], pack_ptr[c + 1]
        by_ready = np.argsort(ready[chain_slot[lo:hi]], kind="mergesort")
        nxt, n = 0, 0
        for _ in range(hi - lo):
            # The first kernel in order whose data is there (the ring kernels
            # of step 1 before the Ulysses ones); else local calls until the
            # next one's data lands (the call then running runs on).
            while True:
                if ring_left and ring_ready <= t:
                    t += first[1, r]
                    ring_left = False
                if n > 0 or t >= ready[chain_slot[lo + by_ready[nxt]]]:
                    break
                soonest = ready[chain_slot[lo + by_ready[nxt]]]
                if ring_left:
                    soonest = min(soonest, ring_ready)
                while pk < pend and t < soonest:
                    t += pack_s[pk]
                    pk += 1
                t = max(t, soonest)
            while nxt < hi - lo and ready[chain_slot[lo + by_ready[nxt]]] <= t:
                n = key_push(waiting, lo, n, by_ready[nxt])
                nxt += 1
            place = key_pop(waiting, lo, n)
            n -= 1
            j = chain_slot[lo + place]
            t += kernel[j]
            done[j] = t
        if ring_left:
            while pk < pend and t < ring_ready:
                t += pack_s[pk]
                pk += 1
            t = max(t, ring_ready) + first[1, r]
        for q in range(pk, pend):
            t += pack_s[q]
        lane_end[c] = t
    for j in range(len(rank)):
        for x in range(2):
            if lanes[x, j]:
                landed[x, rank[j]] = max(landed[x, rank[j]], done[j])   # now: when the outputs post
    a, b = by_wave[1]
    sent = _batches(landed.ravel(), _joined(ring_src, a, b, src), _joined(ring_dst, a, b, dst),
                    _joined(ring_lane, a, b, lane), _joined(ring_held, a, b, held_out),
                    _joined(ring_out, a, b, port_out), _joined(ring_in, a, b, port_in), w, n_ports)
    return inputs, landed, sent, lane_end


@njit(cache=True)
def _local_calls(chain_of, local_rank, local_len, seconds, pack_tokens, n_chain):
    """The kernel calls of the local sequences of ranks with a chain
    (``chain_of``: per rank its chain, -1: none), as the schedule packs them (a
    rank's consecutive sequences until a call holds ``pack_tokens`` rows): (CSR
    offsets by chain, each call's seconds, summed in order)."""
    calls = np.zeros(n_chain, np.int64)
    rows = np.zeros(n_chain, np.int64)
    call_of = np.full(len(local_rank), -1, np.int64)
    for i in range(len(local_rank)):
        c = chain_of[local_rank[i]]
        if c < 0:
            continue
        if calls[c] == 0 or rows[c] >= pack_tokens:
            calls[c] += 1
            rows[c] = 0
        rows[c] += int(local_len[i])
        call_of[i] = calls[c] - 1
    ptr = np.zeros(n_chain + 1, np.int64)
    ptr[1:] = np.cumsum(calls)
    out = np.zeros(ptr[-1])
    for i in range(len(local_rank)):
        if call_of[i] >= 0:
            out[ptr[chain_of[local_rank[i]]] + call_of[i]] += seconds[i]
    return ptr, out


class UlyssesGroups:
    """A plan's Ulysses groups under one clock, ready to price either pass."""

    def __init__(self, clock: StepSurrogate, layout: PlanArrays, w: int) -> None:
        self.clock, self.w = clock, w
        L, d, flat = layout.group_len, layout.group_size, layout.group_ranks
        G = len(L)
        gid = np.repeat(np.arange(G), d)                                     # group of each member
        member = np.arange(len(flat)) - (np.cumsum(d) - d)[gid]              # position in its group
        self.ranks, self.gid = flat, gid
        tokens = ((member + 1) * L[gid] // d[gid] - member * L[gid] // d[gid]).astype(np.float64)
        # attn_s per member before the pass's share: pairs / d at block L (a
        # packed group's: its members' summed pairs at their pair-weighted length)
        self.kernel = clock._attn_s(layout.group_pairs.astype(np.float64), layout.group_block.astype(np.float64))[gid]
        hq, hk = clock.q_heads // d, clock.kv_heads // d
        row = clock.head_dim * clock.isz
        q_row, qkv_row = (hq * row)[gid], ((hq + 2 * hk) * row)[gid]       # bytes per token, per member

        # Messages in the schedule's order: group by group, sender-major.
        gm = np.repeat(np.arange(G), d * d)
        cell = np.arange(len(gm)) - np.repeat(np.cumsum(d * d) - d * d, d * d)
        a, b = cell // d[gm], cell % d[gm]
        keep = a != b
        first = (np.cumsum(d) - d)[gm[keep]]
        sender, receiver = first + a[keep], first + b[keep]                  # member indices
        self.src, self.dst = flat[sender], flat[receiver]
        inside, self.port_out, self.port_in = clock._ports(self.src, self.dst, w)
        self.lane = np.where(inside, 0, 1)                                   # NVLink lane, NIC lane
        lat = np.where(inside, clock.nvl_lat, clock.nic_lat)
        bw = np.where(inside, clock.nvl_bw, clock.nic_bw)
        # (inputs, outputs) seconds per pass: in, a message carries its sender's
        # rows; out, its receiver's; Q/K/V (forward in, backward out) or Q-shaped.
        fwd = (lat + tokens[sender] * qkv_row[sender] / bw, lat + tokens[receiver] * q_row[receiver] / bw)
        bwd = (lat + tokens[sender] * q_row[sender] / bw, lat + tokens[receiver] * qkv_row[receiver] / bw)
        self.seconds = {False: fwd, True: bwd}
        self.port = np.concatenate([self.port_out, self.port_in])            # a message's two legs
        # Which lanes a member's messages of its group take (it receives on each).
        self.member_lanes = np.zeros((2, len(flat)), np.bool_)
        self.member_lanes[self.lane, receiver] = True
        # Each rank's members in plan order (its compute lane's order), rank after rank.
        self.chain_slot = np.argsort(flat, kind="stable")
        runs = np.flatnonzero(np.r_[True, np.diff(flat[self.chain_slot]) != 0])
        self.chain_ptr = np.r_[runs, len(flat)].astype(np.int64)
        self.chain_rank = flat[self.chain_slot[runs]]
        chain_of = np.full(w, -1, np.int64)
        chain_of[self.chain_rank] = np.arange(len(runs))
        # Their ranks' local sequences, as kernel calls (before the pass's share).
        Ll = layout.local_len
        self.call_ptr, self.calls = _local_calls(chain_of, layout.local_rank.astype(np.int64), Ll,
                                                 clock._attn_s(Ll * (Ll + 1) / 2, Ll), LOCAL_PACK_TOKENS,
                                                 len(runs))

    def price(self, backward: bool, work: np.ndarray, load: np.ndarray, gate: np.ndarray | None,
              first: np.ndarray, first_lanes: np.ndarray, rings: tuple[np.ndarray, ...]
              ) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """One pass: adds the kernels to ``work`` and the ports' seconds to
        ``load``; ``first``: per rank the compute lane's work ahead of its
        Ulysses kernels (rows: its ring kernels of steps 0 and 1) and
        ``first_lanes`` the lanes step 1's data comes by (:func:`_follow`);
        ``rings``: the rings' transfers that the ranks' lanes post in one
        batch with the inputs or outputs (:func:`_follow`'s ``ring_*``,
        ``StepSurrogate._beside_groups``); ``gate`` (rings beside the groups read it): set per
        member rank to when its inputs landed and its outputs left, entering
        at 0, and its Ulysses kernels' seconds (rows 0-2); then per lane
        (NVLink, NIC) when its inputs' batch was done (rows 3-4), its outputs'
        batch was posted (5-6) and was done (7-8).  Returns the function of
        every rank's entry that yields (the member ranks, when each leaves,
        per rank when its outputs were sent: a ring family of Ulysses members
        reads them, ``StepSurrogate._advance``)."""
        w, ranks = self.w, self.ranks
        share = self.clock.attn_share[backward]
        kernel = self.kernel * share
        np.add.at(work, ranks, kernel)
        sec_in, sec_out = self.seconds[backward]
        n_ports = len(load)
        load += np.bincount(self.port, np.concatenate([sec_in, sec_in]), n_ports)
        load += np.bincount(self.port, np.concatenate([sec_out, sec_out]), n_ports)
        fixed = (first, first_lanes, self.src, self.dst, self.lane, sec_in, sec_out, self.port_out, self.port_in, ranks,
                 kernel, self.member_lanes, self.chain_ptr, self.chain_slot, self.call_ptr, self.calls * share, w,
                 *rings)
        if gate is not None:
            landed, posted, sent, _ = _follow(np.zeros(w), *fixed)
            gate[0][ranks], gate[1][ranks] = landed.max(axis=0)[ranks], sent.max(axis=0)[ranks]
            gate[2][ranks] = np.bincount(ranks, kernel, w)[ranks]
            gate[3:5, ranks], gate[5:7, ranks], gate[7:9, ranks] = landed[:, ranks], posted[:, ranks], sent[:, ranks]
        chain_rank = self.chain_rank

        def leave(entry: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            _, _, sent, lane_end = _follow(entry, *fixed)
            outputs = sent.max(axis=0)
            return chain_rank, np.maximum(outputs[chain_rank], lane_end), outputs

        return leave
