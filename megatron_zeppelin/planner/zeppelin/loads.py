"""Bookkeeping of one plan under construction: tier times, rank loads, assignments."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.plan.shards import zigzag_shard_tokens


def min_ring_size(length: int, token_cap: int) -> int:
    """Smallest group (1: local) whose largest zigzag shard fits ``token_cap``."""
    k = max(1, -(-length // token_cap))
    while k > 1 and int(zigzag_shard_tokens(length, k).max()) > token_cap:
        k += 1
    return k


class _TierTimes:
    """Per-rank ``(ring total, attention compute)`` seconds of one sequence on
    ``k`` ranks (``k = 1``: local), memoised: the search asks for the same
    (length, size) pairs many times."""

    def __init__(self, cost: CostModel, gpus_per_node: int, nodes: int) -> None:
        self.cost = cost
        # link_for only distinguishes one node (NVLink) from several (NICs).
        self.intra = cost.link_for([0, 1]) if gpus_per_node > 1 else None
        self.inter = cost.link_for([0, gpus_per_node]) if nodes > 1 else None
        # All-to-alls get no routing gain across nodes (every GPU's NIC share is busy).
        self.a2a_inter = cost.alltoall_link([0, gpus_per_node]) if nodes > 1 else None
        self._memo: dict[tuple[int, int, bool], tuple[float, float]] = {}
        #: Whether any group across nodes was asked about (only those answers depend on routing).
        self.crossed = False

    def ulysses(self, length: int, d: int, inter: bool) -> float:
        """Per-rank seconds of a Ulysses group of ``d`` (nothing overlaps its all-to-alls)."""
        key = (length, -d, inter)
        self.crossed |= inter
        hit = self._memo.get(key)
        if hit is None:
            hit = (self.cost.ulysses_cost([length], d, self.a2a_inter if inter else self.intra).total_s, 0.0)
            self._memo[key] = hit
        return hit[0]

    def get(self, length: int, k: int, inter: bool) -> tuple[float, float]:
        key = (length, k, inter)
        self.crossed |= inter and k > 1
        hit = self._memo.get(key)
        if hit is None:
            if k == 1:
                hit = (0.0, self.cost.local_attn_s(length))
            else:
                rc = self.cost.ring_cost([length], k, self.inter if inter else self.intra)
                hit = (rc.total_s, rc.compute_s)
            self._memo[key] = hit
        return hit


@dataclass
class _Loads:
    """Modeled attention load of every rank while a plan is built."""

    ring: np.ndarray
    """Sum of the totals of the rings the rank is in (seconds)."""
    compute: np.ndarray
    """Sum of all attention compute on the rank (seconds)."""
    tokens: np.ndarray
    """Tokens in the rank's attention buffer."""
    ulysses: np.ndarray
    """Sum of the totals of the rank's Ulysses groups: their all-to-alls block,
    so nothing hides them and they hide nothing."""
    time: np.ndarray
    """``ulysses + max(ring, compute)``: local work hides in the rings' exposed
    communication, never the reverse (kept up to date by :meth:`add`)."""
    linear_per_token: float = 0.0
    """Linear-module seconds per attention token counted in ``time``: 0 when
    the remap gives every rank the same linear share, the linear cost when the
    linear layout is the attention layout (no remap)."""

    @classmethod
    def empty(cls, world: int, linear_per_token: float = 0.0) -> "_Loads":
        return cls(np.zeros(world), np.zeros(world), np.zeros(world, dtype=np.int64),
                   np.zeros(world), np.zeros(world), linear_per_token)

    def add(self, ranks: tuple[int, ...], total: float, compute: float, tokens: np.ndarray | int,
            ulysses: float = 0.0) -> float:
        """Add a placement's per-rank load on ``ranks``; return the rise in summed time."""
        if len(ranks) == 1:
            # Scalar path: most placements are local, and fancy indexing costs
            # more than the arithmetic on one element.
            r = ranks[0]
            before = self.time[r]
            self.ring[r] += total
            self.compute[r] += compute
            self.tokens[r] += tokens
            self.ulysses[r] += ulysses
            self.time[r] = self.ulysses[r] + max(self.ring[r], self.compute[r]) \
                + self.linear_per_token * self.tokens[r]
            return float(self.time[r] - before)
        idx = np.asarray(ranks)
        before = float(self.time[idx].sum())
        self.ring[idx] += total
        self.compute[idx] += compute
        self.tokens[idx] += tokens
        self.ulysses[idx] += ulysses
        self.time[idx] = self.ulysses[idx] + np.maximum(self.ring[idx], self.compute[idx]) \
            + self.linear_per_token * self.tokens[idx]
        return float(self.time[idx].sum()) - before

    def add_local(self, idx: np.ndarray, compute: np.ndarray, tokens: np.ndarray) -> None:
        """Add local sequences on distinct ranks ``idx`` (vectorised light fill)."""
        self.compute[idx] += compute
        self.tokens[idx] += tokens
        self.time[idx] = self.ulysses[idx] + np.maximum(self.ring[idx], self.compute[idx]) \
            + self.linear_per_token * self.tokens[idx]

    def copy(self) -> "_Loads":
        return _Loads(self.ring.copy(), self.compute.copy(), self.tokens.copy(),
                      self.ulysses.copy(), self.time.copy(), self.linear_per_token)


@dataclass
class _Assign:
    """Where every sequence goes while a plan is built."""

    local: np.ndarray
    """Rank of every local sequence, -1 for the others (arrays: the light fill
    assigns whole rounds at once)."""
    groups: dict[int, tuple[tuple[int, ...], bool]]
    """Sequence -> (ranks, whether they form a Ulysses group) for split sequences."""

    @classmethod
    def empty(cls, n: int) -> "_Assign":
        return cls(np.full(n, -1, dtype=np.int64), {})

    def set(self, seq: int, ranks: tuple[int, ...], ulysses: bool = False) -> None:
        if len(ranks) == 1 and not ulysses:
            self.local[seq] = ranks[0]
        else:
            self.groups[seq] = (ranks, ulysses)

    def copy(self) -> "_Assign":
        return _Assign(self.local.copy(), dict(self.groups))
