"""The surrogate clock's Ulysses groups (``planner/surrogate.py``).

A group of ``d`` ranks runs an all-to-all in (always direct), its kernel on
``1/d`` of the heads, and an all-to-all out: ``d * (d - 1)`` messages each, a
message carrying its sender's tokens in and its receiver's out, over NVLink
to a member on its node and through the NICs to the rest.  As the engine runs
them (``Schedule.waves``, ``comm/lanes.py``), a rank posts its inputs of every
group it is in as one batch per lane (NVLink, NIC) at once, and its outputs
as one later batch per lane once the kernels of that lane's groups are done;
a kernel's data is there once its rank's batches it came by are done.  Every
port carries its messages back to back in the order they start (both ends
posted), and a message has moved once both its ports carried it -- the
replay's rule, followed message by message in numpy (a sort per pass and
a running maximum per port), so the members of overlapping groups land and
leave when the replay has them land and leave, the groups starting together.  What both passes share is
built once per plan (:class:`UlyssesGroups`); :meth:`UlyssesGroups.price`
prices one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_zeppelin.planner.plan_arrays import PlanArrays

if TYPE_CHECKING:
    from megatron_zeppelin.planner.surrogate import StepSurrogate


def _carried(held: np.ndarray, start: np.ndarray, first: np.ndarray, lift: np.ndarray) -> np.ndarray:
    """When each leg has been carried, legs listed port by port in the order
    their port carries them: ``end = max(start, previous end) + held`` along each
    port, from 0.  ``first``: per leg the first leg of its port; ``lift``: per
    leg its port's place (0, 1, 2, ... by port)."""
    before = np.cumsum(held)
    before -= before[first] - held[first]            # carried along the port, this leg included
    if not start.any():
        return before
    # end_k = C_k + max over j <= k on its port of (start_j - C_(j-1)): a running
    # maximum that restarts per port (each port's values lifted above the last's).
    lead = start - (before - held)
    lift = lift * (np.abs(lead).max() * 2 + 1)
    return before + np.maximum.accumulate(lead + lift) - lift


class UlyssesGroups:
    """A plan's Ulysses groups under one clock, ready to price either pass."""

    def __init__(self, clock: StepSurrogate, layout: PlanArrays, w: int) -> None:
        self.clock, self.w = clock, w
        L, d, flat = layout.group_len, layout.group_size, layout.group_ranks
        G = len(L)
        gid = np.repeat(np.arange(G), d)                                     # group of each member
        member = np.arange(len(flat)) - (np.cumsum(d) - d)[gid]              # position in its group
        self.ranks, self.gid, self.groups = flat, gid, G
        tokens = ((member + 1) * L[gid] // d[gid] - member * L[gid] // d[gid]).astype(np.float64)
        # attn_s per group before the pass's share: pairs / d at block L (a
        # packed group's: its members' summed pairs at their pair-weighted length)
        self.kernel = clock._attn_s(layout.group_pairs.astype(np.float64), layout.group_block.astype(np.float64))
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
        src, dst = flat[sender], flat[receiver]
        inside, out, inn = clock._ports(src, dst, w)
        self.src, self.dst, self.m = src, dst, len(src)
        self.lane = np.where(inside, 0, 1)                                   # NVLink lane, NIC lane
        lat = np.where(inside, clock.nvl_lat, clock.nic_lat)
        bw = np.where(inside, clock.nvl_bw, clock.nic_bw)
        # (inputs, outputs) seconds per pass: in, a message carries its sender's
        # rows; out, its receiver's; Q/K/V (forward in, backward out) or Q-shaped.
        fwd = (lat + tokens[sender] * qkv_row[sender] / bw, lat + tokens[receiver] * q_row[receiver] / bw)
        bwd = (lat + tokens[sender] * q_row[sender] / bw, lat + tokens[receiver] * qkv_row[receiver] / bw)
        self.seconds = {False: fwd, True: bwd}
        self.port = np.concatenate([out, inn])                               # a message's two legs
        # Inputs start together: as the later of their ends posts (ranks post in
        # rank order, a rank's messages in the schedule's).
        later = np.maximum(src, dst)
        self.in_rank = np.tile(np.argsort(later, kind="stable").argsort(), 2)
        self.in_order = np.lexsort((self.in_rank, self.port))
        # Sorted by port, legs fall in the same runs whatever their order within.
        by_port = self.port[self.in_order]
        runs = np.flatnonzero(np.r_[True, by_port[1:] != by_port[:-1]])
        self.run_first = np.repeat(runs, np.diff(np.r_[runs, len(by_port)]))
        self.run_lift = np.cumsum(np.r_[0.0, by_port[1:] != by_port[:-1]])
        # Per (rank, lane), the messages it sends or receives: a run each.
        touch = np.concatenate([src * 2 + self.lane, dst * 2 + self.lane])
        by_touch = np.argsort(touch, kind="stable")
        self.touch_msg = np.tile(np.arange(len(src)), 2)[by_touch]
        keys = touch[by_touch]
        self.touch_at = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        self.touch_key = keys[self.touch_at]
        # A leg's key for ordering its port's legs: (port, when it starts, then
        # as the inputs at equal times), as one integer -- the start's place among
        # at most 2 w distinct post times in the middle.
        place = np.empty(len(by_port), np.int64)
        place[self.in_order] = self.run_lift
        m2 = 2 * len(src)
        self.key_port = place * (2 * w * m2) + self.in_rank
        self.key_start = m2
        # Which lanes a member's messages of its group take (it receives on each).
        self.member_lanes = np.zeros((2, len(flat)), bool)
        self.member_lanes[self.lane, receiver] = True
        # A rank's groups as a column, by row: the n-th group of every rank at once.
        by_rank = np.argsort(flat, kind="stable")
        runs = np.flatnonzero(np.r_[True, np.diff(flat[by_rank]) != 0])
        lengths = np.diff(np.r_[runs, len(flat)])
        self.chain_rank = flat[by_rank[runs]]
        self.chain_of = np.empty(len(flat), np.int64)
        self.chain_of[by_rank] = np.repeat(np.arange(len(runs)), lengths)
        self.chain_len = int(lengths.max()) if len(lengths) else 0

    def _order(self, post: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The legs port by port in the order their messages start: as the later
        of ``post[a]`` and ``post[b]``, ties as the inputs (which start together)."""
        place = np.empty(len(post), np.int64)
        place[np.argsort(post, kind="stable")] = np.arange(len(post))
        later = np.maximum(place[a], place[b])
        return np.argsort(self.key_port + np.concatenate([later, later]) * self.key_start)

    def _moved(self, seconds: np.ndarray, order: np.ndarray, start: np.ndarray) -> np.ndarray:
        """When each message has moved, starting at ``start``, its legs carried in
        ``order`` (port by port)."""
        held = np.concatenate([seconds, seconds])[order]
        at = np.empty(2 * self.m)
        at[order] = _carried(held, np.concatenate([start, start])[order], self.run_first, self.run_lift)
        return np.maximum(at[:self.m], at[self.m:])

    def _per_lane(self, values: np.ndarray) -> np.ndarray:
        """(lane, rank): the latest of ``values`` over the messages each rank sends
        or receives on each lane (0 where none)."""
        out = np.zeros(2 * self.w)
        out[self.touch_key] = np.maximum.reduceat(values[self.touch_msg], self.touch_at)
        return out.reshape(self.w, 2).T

    def price(self, backward: bool, work: np.ndarray, load: np.ndarray, gate: np.ndarray, first: np.ndarray):
        """One pass: adds the kernels to ``work`` and the ports' seconds to
        ``load``, sets ``gate`` (per member rank when its inputs landed, when its
        outputs left, its Ulysses kernels' seconds, from the groups' start; then
        per lane when its inputs landed, its outputs were posted, they left);
        ``first``: per rank the compute lane's work before its Ulysses kernels.
        Returns the function of the segment's port loads that yields each
        member's seconds from the groups' start to its exit.  The groups start
        together (once every member entered): following each member from its
        own entry, message by message, every layer, cost three times the
        surrogate's time per call for an error p95 of 1.10 % instead of 1.13 %
        (``benchmarks/surrogate_error.py``)."""
        w, ranks = self.w, self.ranks
        kernel = (self.kernel * self.clock.attn_share[backward])[self.gid]
        np.add.at(work, ranks, kernel)
        sec_in, sec_out = self.seconds[backward]
        n_ports = len(load)
        load += np.bincount(self.port, np.concatenate([sec_in, sec_in]), n_ports)
        load += np.bincount(self.port, np.concatenate([sec_out, sec_out]), n_ports)
        landed = self._per_lane(self._moved(sec_in, self.in_order, np.zeros(self.m)))
        # A member's kernel runs once its rank's batches its inputs came by are
        # done; a rank runs its kernels as their data lands.
        ready = np.where(self.member_lanes, landed[:, ranks], 0.0).max(axis=0)
        shape = (self.chain_len, len(self.chain_rank))
        nth = np.lexsort((self.gid, ready, self.chain_of))
        row = np.empty(len(ranks), np.int64)
        row[nth] = np.arange(len(ranks)) - np.searchsorted(self.chain_of[nth], self.chain_of[nth])
        r, k = np.full(shape, -np.inf), np.zeros(shape)
        r[row, self.chain_of], k[row, self.chain_of] = ready, kernel
        x = np.empty(shape)
        prev = first[self.chain_rank]
        for n in range(shape[0]):
            prev = x[n] = np.maximum(prev, r[n]) + k[n]
        done = x[row, self.chain_of]
        # Each lane posts its outputs once its groups' kernels are done (and its
        # inputs' batch, the lane's previous one, is).
        posted = landed.copy()
        np.maximum.at(posted.reshape(-1), np.arange(2)[:, None] * w + ranks, np.where(self.member_lanes, done, 0.0))
        start = np.maximum(posted[self.lane, self.src], posted[self.lane, self.dst])
        order = self._order(posted.reshape(-1), self.lane * w + self.src, self.lane * w + self.dst)
        left = self._per_lane(self._moved(sec_out, order, start))
        sent = left.max(axis=0)
        gate[0][ranks], gate[1][ranks] = landed.max(axis=0)[ranks], sent[ranks]
        gate[2][ranks] = np.bincount(ranks, kernel, w)[ranks]
        gate[3:5, ranks], gate[5:7, ranks], gate[7:9, ranks] = landed[:, ranks], posted[:, ranks], left[:, ranks]
        return lambda total: (ranks, self.gid, sent[ranks])
