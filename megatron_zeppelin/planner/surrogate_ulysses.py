"""The surrogate clock's Ulysses groups (``planner/surrogate.py``).

A group of ``d`` ranks runs an all-to-all in (always direct), its kernel on
``1/d`` of the heads, and an all-to-all out.  A member's messages take NVLink
to the other members on its node and its NIC to the rest; a message carries
its sender's tokens in (step 0) and its receiver's out (step 1), so each
port's seconds per all-to-all follow from per-member counts and token sums,
not from the ``d * (d - 1)`` messages.  What both passes share is built once
per plan (:class:`UlyssesGroups`); :meth:`UlyssesGroups.price` prices one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_zeppelin.planner.plan_arrays import PlanArrays

if TYPE_CHECKING:
    from megatron_zeppelin.planner.surrogate import StepSurrogate


class UlyssesGroups:
    """A plan's Ulysses groups under one clock, ready to price either pass."""

    def __init__(self, clock: StepSurrogate, layout: PlanArrays, w: int, n_ports: int) -> None:
        self.clock, self.w = clock, w
        L, d, flat = layout.group_len, layout.group_size, layout.group_ranks
        G = len(L)
        gid = np.repeat(np.arange(G), d)                                     # group of each member
        member = np.arange(len(flat)) - (np.cumsum(d) - d)[gid]              # position in its group
        self.ranks, self.gid, self.groups = flat, gid, G
        self.tokens = ((member + 1) * L[gid] // d[gid] - member * L[gid] // d[gid]).astype(np.float64)
        # attn_s per group before the pass's share: pairs / d at block L
        self.kernel = clock._attn_s(((L * (L + 1) // 2) // d).astype(np.float64), L.astype(np.float64))
        node = flat // clock.gpn
        _, of, on_node = np.unique(gid * (w // clock.gpn) + node, return_inverse=True, return_counts=True)
        node_tokens = np.bincount(of, weights=self.tokens)[of]
        self.near, self.far = on_node[of] - 1, d[gid] - on_node[of]         # peers on its node, elsewhere
        self.near_tokens, self.far_tokens = node_tokens - self.tokens, L[gid] - node_tokens
        hq, hk = clock.q_heads // d, clock.kv_heads // d
        row = clock.head_dim * clock.isz
        self.q_row, self.qkv_row = (hq * row)[gid], ((hq + 2 * hk) * row)[gid]   # bytes per token
        # Each member's ports per all-to-all (in, then out): NVLink out and
        # in, NIC out and in; a port it does not use carries nothing.
        nic = 2 * w + 2 * (node * clock.nics + clock.affinity[flat % clock.gpn])
        port = np.concatenate([2 * flat, 2 * flat + 1, nic, nic + 1] * 2)
        a2a = np.concatenate([2 * gid + step for step in (0, 1) for _ in range(4)])
        self.used = np.concatenate([self.near, self.near, self.far, self.far] * 2) > 0
        uniq, self.of_key = np.unique(a2a[self.used] * n_ports + port[self.used], return_inverse=True)
        self.key_a2a, self.key_port = uniq // n_ports, uniq % n_ports
        # The groups' inputs share ports and go in the schedule's order: a
        # group's all-to-all in has arrived once each of its ports carried it
        # and every earlier group's input through that port.
        inputs = np.flatnonzero(self.key_a2a % 2 == 0)
        self.inputs = inputs[np.lexsort((self.key_a2a[inputs], self.key_port[inputs]))]
        p_in = self.key_port[self.inputs]
        starts = np.flatnonzero(np.r_[True, p_in[1:] != p_in[:-1]])
        self.queue_start = np.repeat(starts, np.diff(np.r_[starts, len(p_in)]))
        # A rank runs its groups in order: a column per rank, its groups by row.
        by_rank = np.argsort(flat, kind="stable")
        runs = np.flatnonzero(np.r_[True, np.diff(flat[by_rank]) != 0])
        lengths = np.diff(np.r_[runs, len(flat)])
        self.chain_of = np.empty(len(flat), np.int64)
        self.nth = np.empty(len(flat), np.int64)
        self.chain_of[by_rank] = np.repeat(np.arange(len(runs)), lengths)
        self.nth[by_rank] = np.arange(len(flat)) - np.repeat(runs, lengths)
        self.chain_rank, self.chain_last = flat[by_rank[runs]], lengths - 1

    def price(self, backward: bool, work: np.ndarray, load: np.ndarray, gate: np.ndarray):
        """One pass: adds the kernels to ``work`` and the ports' seconds to
        ``load``, sets ``gate`` (each member rank's last Ulysses kernel's end);
        returns the function of the segment's port loads that yields each
        member's seconds from the groups' start to its exit."""
        c = self.clock
        kernel = self.kernel * c.attn_share[backward]
        np.add.at(work, self.ranks, kernel[self.gid])
        near, far, own = self.near, self.far, self.tokens
        held = []
        for step, row in enumerate((self.q_row, self.qkv_row) if backward else (self.qkv_row, self.q_row)):
            # (out, in) bytes of the member's ports: in step 0 it sends its own
            # tokens to each peer, in step 1 it receives its own tokens from each
            nvl = (near * (own * row), self.near_tokens * row)
            via_nic = (far * (own * row), self.far_tokens * row)
            if step == 1:
                nvl, via_nic = nvl[::-1], via_nic[::-1]
            held += [near * c.nvl_lat + b / c.nvl_bw for b in nvl]
            held += [far * c.nic_lat + b / c.nic_bw for b in via_nic]
        sums = np.bincount(self.of_key, weights=np.concatenate(held)[self.used])
        np.add.at(load, self.key_port, sums)
        # Each all-to-all lasts as long as its busiest port needs.
        busiest = np.zeros(2 * self.groups)
        np.maximum.at(busiest, self.key_a2a, sums)
        queued = np.cumsum(sums[self.inputs])
        queued -= (queued - sums[self.inputs])[self.queue_start]
        arrival = np.zeros(self.groups)
        np.maximum.at(arrival, self.key_a2a[self.inputs] // 2, queued)
        # A rank runs its groups' kernels in order as their data arrives and
        # sends each group's outputs once its kernel is done, one group's after
        # another: lane_n = max(lane_n-1, arrival_n) + kernel_n and sent_n =
        # max(sent_n-1, lane_n) + out_n.
        shape = (int(self.nth.max()) + 1, len(self.chain_rank))
        lane = self._chain(arrival[self.gid], kernel[self.gid], shape)
        sent = self._chain(lane[self.nth, self.chain_of], busiest[1::2][self.gid], shape)
        last = (self.chain_last, np.arange(shape[1]))
        lane_of, sent_of = np.zeros(self.w), np.zeros(self.w)
        lane_of[self.chain_rank], sent_of[self.chain_rank] = lane[last], sent[last]
        gate[self.ranks] = lane_of[self.ranks]
        group_of_key = self.key_a2a // 2

        def finish(total: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            drain = np.zeros(self.groups)
            np.maximum.at(drain, group_of_key, total[self.key_port])
            return self.ranks, self.gid, np.maximum(sent_of[self.ranks], drain[self.gid])

        return finish

    def _chain(self, ready: np.ndarray, cost: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """Per (n-th group, rank) ``x_n = max(x_n-1, ready_n) + cost_n`` from
        ``x = 0``, every rank's n-th group at once.  Added one by one as the
        engine's lane runs them: a closed form (running maxima of prefix sums)
        rounds differently for the same groups in another order, and breaks
        the decision's ties between such plans."""
        r, m = np.zeros(shape), np.zeros(shape)
        r[self.nth, self.chain_of], m[self.nth, self.chain_of] = ready, cost
        x = np.zeros(shape)
        for n in range(shape[0]):
            x[n] = np.maximum(x[n - 1] if n else 0.0, r[n]) + m[n]
        return x
