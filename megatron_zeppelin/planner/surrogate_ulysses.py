"""The surrogate clock's Ulysses groups (``planner/surrogate.py``).

A group of ``d`` ranks runs an all-to-all in (always direct), its kernel on
``1/d`` of the heads, and an all-to-all out.  A member's messages take NVLink
to the other members on its node and its NIC to the rest; a message carries
its sender's tokens in (step 0) and its receiver's out (step 1), so each
port's seconds per all-to-all follow from per-member counts and token sums,
not from the ``d * (d - 1)`` messages.  What both passes share is built once
per plan (:class:`UlyssesGroups`); :meth:`UlyssesGroups.price` prices one pass.

The engine posts a rank's all-to-all inputs of every group it is in as one
batch per lane (wave 0) and its outputs as one later batch once all its
Ulysses kernels are done (``Schedule.waves``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from megatron_zeppelin.planner.plan_arrays import PlanArrays

if TYPE_CHECKING:
    from megatron_zeppelin.planner.surrogate import StepSurrogate


@functools.cache
def alltoall_stretch(d: int) -> float:
    """How much longer than its busiest port the replay takes to move an
    all-to-all among ``d`` ranks (the slowest rank's batch, relative).

    The replay books every transfer, when the second of its ends posts its
    batch (ranks post in order), into the earliest window in which both of its
    ports are free, for good: with messages of (even slightly) unequal sizes a
    port is left with gaps no later transfer fits.  This books two groups'
    all-to-alls of nearly equal messages by that rule (sizes ``1 + i / 1000``)."""
    ports: list[list[tuple[float, float]]] = [[] for _ in range(2 * d)]
    done = np.zeros(d)
    sizes = 1 + (np.arange(2 * d) % 7) / 1000
    for r in range(d):
        for g in range(2):
            for a in range(d):
                for b in range(d):
                    if a == b or max(a, b) != r:
                        continue
                    dur, start = sizes[g * d + a], 0.0
                    moved = True
                    while moved:
                        moved = False
                        for busy in (ports[2 * a], ports[2 * b + 1]):
                            for lo, hi in busy:
                                if lo < start + dur and hi > start:
                                    start, moved = hi, True
                    ports[2 * a].append((start, start + dur))
                    ports[2 * b + 1].append((start, start + dur))
                    done[a] = max(done[a], start + dur)
                    done[b] = max(done[b], start + dur)
    load = max(sum(sizes[g * d + a] for g in range(2)) * (d - 1) for a in range(d))
    return float(done.max() / load) if d > 1 else 1.0


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
        self.key_step = self.key_a2a % 2
        self.key_group = self.key_a2a // 2
        sizes, of = np.unique(d, return_inverse=True)
        self.stretch = np.array([alltoall_stretch(x) for x in sizes.tolist()])[of.reshape(-1)]
        self.n_ports = n_ports

    def price(self, backward: bool, work: np.ndarray, load: np.ndarray, gate: np.ndarray, first: np.ndarray):
        """One pass: adds the kernels to ``work`` and the ports' seconds to
        ``load``, sets ``gate`` (per member rank when its inputs landed, when its
        outputs left, its Ulysses kernels' seconds); ``first``: per rank the
        compute lane's work before its Ulysses kernels.  Returns the function of
        the segment's port loads that yields each member's seconds from the
        groups' start to its exit."""
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
        # A group's all-to-all has moved once the busiest port it uses has
        # carried every group's all-to-all of that step through it (a rank posts
        # all its groups' at once), stretched as the replay books unequal messages.
        busiest = []
        for step in (0, 1):
            on = self.key_step == step
            per_port = np.bincount(self.key_port[on], sums[on], self.n_ports)
            most = np.zeros(self.groups)
            np.maximum.at(most, self.key_group[on], per_port[self.key_port[on]])
            busiest.append(most * self.stretch)
        ranks, gid, w = self.ranks, self.gid, self.w
        # A rank's batch of inputs has landed once all its groups' have; it then
        # runs its kernels and posts its outputs.  A group's outputs are over
        # once its busiest port carried them from its first member's post on, and
        # once its last member moved its own (sent and received).
        landed = np.zeros(w)
        np.maximum.at(landed, ranks, busiest[0][gid])
        kernel_s = np.bincount(ranks, kernel[gid], w)
        computed = np.maximum(landed, first) + kernel_s
        own_out, own_in = held[4] + held[6], held[5] + held[7]       # step 1's NVLink and NIC, per member
        moved = np.maximum(np.bincount(ranks, own_out, w), np.bincount(ranks, own_in, w))
        posted = np.full(self.groups, np.inf)
        np.minimum.at(posted, gid, computed[ranks])
        out_end = posted + busiest[1]
        np.maximum.at(out_end, gid, (computed + moved)[ranks])
        sent = np.zeros(w)
        np.maximum.at(sent, ranks, out_end[gid])
        gate[0][ranks], gate[1][ranks], gate[2][ranks] = landed[ranks], sent[ranks], kernel_s[ranks]

        def finish(total: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            drain = np.zeros(self.groups)
            np.maximum.at(drain, self.key_group, total[self.key_port])
            return ranks, gid, np.maximum(sent[ranks], drain[gid])

        return finish
