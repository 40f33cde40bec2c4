"""Zeppelin's hierarchical sequence partitioning (EuroSys'26).

Every sequence of the global batch runs in one of three tiers: ``local`` (one
GPU), an intra-node ring (NVLink) or an inter-node ring (NICs, routed) -- or,
where the cost model prefers it, a Ulysses group.  The planner picks the tier
and size per sequence from the cost model and balances the ranks' modeled
attention time under the per-GPU token cap, at two levels: a group of at most
``gpus_per_node`` ranks goes into one *node bucket* (the node whose GPUs can
take it at the lowest load), then onto that node's least-loaded *GPU buckets*;
larger groups span nodes.

Step-time model (the simulator's): a rank's attention time is
``ulysses totals + max(sum of its ring totals, ring + local compute)``, i.e.
the ring totals plus whatever local work does not fit into the rings' exposed
communication; Ulysses all-to-alls block.  With the remap layer the linear
modules run on the token-balanced layout of :mod:`.linear_layout` (equal on
every rank: attention is balanced, the remap priced exactly); without it on
the attention layout itself, so attention plus linear time is balanced.  The
pass with the lowest modeled step wins, ties within ``PAIRS_SLACK`` going to
the most even causal pairs per rank.  docs/planner.md explains the choices.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode, Plan, SeqPlacement, placement
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.planner.linear_layout import balance_linear, remap_volume


@dataclass(frozen=True)
class _Pass:
    """Settings of one greedy packing pass (the best pass's plan wins)."""

    level: float
    """Shards must fit under this multiple of the water level all unplaced work
    would reach: lower splits more (finer balance, more kernel-efficiency loss)."""
    density: float
    """Charge a rank's free token slots at this fraction of the remaining work's
    mean attention density, so a rank holding a dense shard keeps its room for
    light tokens (it matters when the batch nearly fills the token cap)."""
    share: float = np.inf
    """Cap a ring at this multiple of the sequence's proportional share of the
    ranks (beyond what the token cap forces): long sequences cannot crowd out
    the next ones."""
    spill: bool = True
    """Let the inter-node tier (searched only when no intra-node group fits)
    use rings (off: only when the token cap forces more ranks than a node has;
    Ulysses groups, whose all-to-alls are priced on the link they use, may
    still span nodes)."""
    remap: bool = True
    """Balance attention alone, then remap to a token-balanced linear layout
    (``PlanContext.remap_enabled``); off: the linear modules keep the attention
    layout, so attention plus linear time is balanced per rank."""


#: Passes, per linear layout in order of usefulness: greedy best subsets of a
#: grid of settings on six corpora at 64 GPUs (docs/planner.md; remap on
#: re-tuned for the all-to-all link fix, with a cheap first setting, the only
#: one large clusters run).
PASSES: tuple[_Pass, ...] = (
    _Pass(1.05, 0.0, spill=False), _Pass(1.0, 0.1), _Pass(1.05, 0.0), _Pass(1.1, 0.2),
    _Pass(1.0, 0.2, spill=False, remap=False), _Pass(0.9, 0.0, spill=False, remap=False),
    _Pass(1.0, 0.0, spill=False, remap=False), _Pass(1.1, 0.2, spill=False, remap=False))
#: A sequence is "light" when its local attention takes at most LIGHT_TIME of
#: the mean per-rank attention time and it holds at most LIGHT_TOKENS of the
#: token cap: it stays local and is placed after the heavy ones by a vectorised
#: LPT fill (too small to unbalance a rank's time or to strand its tokens).
LIGHT_TIME = 0.25
LIGHT_TOKENS = 0.25
#: Packing passes are tried in PASSES order while (heavy sequences x passes)
#: stays within this budget (at least one pass): large clusters get fewer.
PASS_BUDGET = 100
#: Secondary objective: among passes whose modeled step is within this
#: fraction of the best, the one with the most even causal pairs per rank
#: wins (kernel efficiency differs by block length, so equal modeled time can
#: hide unequal work; a real kernel's efficiency is rarely modeled exactly).
PAIRS_SLACK = 0.02


def zigzag_shard_tokens(length: int, ring_size: int) -> np.ndarray:
    """Tokens each rank of a zigzag ring holds (rank ``i``: chunks ``i`` and
    ``2k-1-i``), the boundaries of :func:`megatron_zeppelin.plan.zigzag_shards`."""
    k = ring_size
    sizes = np.diff((np.arange(2 * k + 1, dtype=np.int64) * length) // (2 * k))
    return sizes[:k] + sizes[::-1][:k]


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

    def ulysses(self, length: int, d: int, inter: bool) -> float:
        """Per-rank seconds of a Ulysses group of ``d`` (nothing overlaps its all-to-alls)."""
        key = (length, -d, inter)
        hit = self._memo.get(key)
        if hit is None:
            hit = (self.cost.ulysses_cost([length], d, self.a2a_inter if inter else self.intra).total_s, 0.0)
            self._memo[key] = hit
        return hit[0]

    def get(self, length: int, k: int, inter: bool) -> tuple[float, float]:
        key = (length, k, inter)
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
    pairs: np.ndarray
    """Causal query-key pairs the rank computes (``Plan.attn_pairs_per_rank``),
    for the secondary objective: work balance independent of kernel efficiency."""
    linear_per_token: float = 0.0
    """Linear-module seconds per attention token counted in ``time``: 0 when
    the remap gives every rank the same linear share, the linear cost when the
    linear layout is the attention layout (no remap)."""

    @classmethod
    def empty(cls, world: int, linear_per_token: float = 0.0) -> "_Loads":
        return cls(np.zeros(world), np.zeros(world), np.zeros(world, dtype=np.int64),
                   np.zeros(world), np.zeros(world), np.zeros(world), linear_per_token)

    def add(self, ranks: tuple[int, ...], total: float, compute: float, tokens: np.ndarray | int,
            pairs: float, ulysses: float = 0.0) -> float:
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
            self.pairs[r] += pairs
            self.time[r] = self.ulysses[r] + max(self.ring[r], self.compute[r]) \
                + self.linear_per_token * self.tokens[r]
            return float(self.time[r] - before)
        idx = np.asarray(ranks)
        before = float(self.time[idx].sum())
        self.ring[idx] += total
        self.compute[idx] += compute
        self.tokens[idx] += tokens
        self.ulysses[idx] += ulysses
        self.pairs[idx] += pairs
        self.time[idx] = self.ulysses[idx] + np.maximum(self.ring[idx], self.compute[idx]) \
            + self.linear_per_token * self.tokens[idx]
        return float(self.time[idx].sum()) - before

    def add_local(self, idx: np.ndarray, compute: np.ndarray, tokens: np.ndarray, pairs: np.ndarray) -> None:
        """Add local sequences on distinct ranks ``idx`` (vectorised light fill)."""
        self.compute[idx] += compute
        self.tokens[idx] += tokens
        self.pairs[idx] += pairs
        self.time[idx] = self.ulysses[idx] + np.maximum(self.ring[idx], self.compute[idx]) \
            + self.linear_per_token * self.tokens[idx]

    def pairs_imbalance(self) -> float:
        """max / mean causal pairs per rank (1: perfect)."""
        return float(self.pairs.max() / max(self.pairs.mean(), 1.0))

    def copy(self) -> "_Loads":
        return _Loads(self.ring.copy(), self.compute.copy(), self.tokens.copy(),
                      self.ulysses.copy(), self.time.copy(), self.pairs.copy(), self.linear_per_token)


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


class _Packer:
    """Places sequences on ranks, updating :class:`_Loads` (one packing pass)."""

    def __init__(self, lens: np.ndarray, ctx: PlanContext, times: _TierTimes) -> None:
        topo = ctx.topology
        self.lens, self.times = lens, times
        self.w, self.g, self.nodes = topo.world_size, topo.gpus_per_node, topo.nodes
        self.cap = ctx.tokens_per_gpu
        self.fill = max(float(lens.sum()) / self.w, 1.0)
        self.density = 0.0
        self.pairs = lens * (lens + 1) / 2.0
        """Causal pairs of every sequence (``causal_pairs(0, L)``)."""
        # Attention time is linear in the pair count, so one vectorised call at
        # one pair per query gives every sequence's local time (no per-length loop).
        self.local_s = self.pairs * times.cost.attn_s(1.0, lens.astype(np.float64))
        """Local attention seconds of every sequence (``CostModel.local_attn_s``)."""
        heads = int(np.gcd(*ctx.local_heads))
        self.ulysses_sizes = [d for d in range(2, min(heads, self.w) + 1) if heads % d == 0]
        """Ulysses group sizes the engine can run: they divide the query and KV heads."""
        cost = times.cost
        self.linear_per_token = cost.linear_s(1.0)
        """Linear-module seconds per token (``CostModel.linear_s`` is linear in tokens)."""
        self.balanced_linear_s = cost.linear_s(-(-int(lens.sum()) // self.w))
        """Linear seconds of the busiest rank of a token-balanced layout."""
        self._bytes_per_token = cost.model.hidden_bytes_per_token
        # The unit of inter-node bandwidth each rank's bytes share: its node
        # when routed (all NICs), else its own NIC.
        self._link_of = np.arange(self.w) // self.g if cost.routing else \
            np.array([topo.node_of(r) * topo.nics_per_node + topo.nic_of(r) for r in range(self.w)])
        self._remap_s = cost.remap_s
        self._shards: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
        self._k_lo: dict[int, int] = {}

    # ----------------------------------------------------------- cost view
    def _is_inter(self, ranks: tuple[int, ...]) -> bool:
        return len(ranks) > 1 and ranks[0] // self.g != ranks[-1] // self.g

    def _rank_time(self, length: int, k: int) -> float:
        """Per-rank modeled time of a ring of ``k`` (inter-node once it outgrows a node)."""
        total, compute = self.times.get(length, k, k > self.g)
        return total if k > 1 else compute

    def _shard_tokens(self, length: int, k: int) -> tuple[np.ndarray, int]:
        """Memoised :func:`zigzag_shard_tokens` and its largest shard (every pass
        asks for the same ones)."""
        hit = self._shards.get((length, k))
        if hit is None:
            sizes = zigzag_shard_tokens(length, k)
            hit = self._shards[(length, k)] = (sizes, int(sizes.max()))
        return hit

    def _largest_shard(self, length: int, k: int) -> int:
        return length if k == 1 else self._shard_tokens(length, k)[1]

    def remap_estimate(self, tokens: np.ndarray) -> float:
        """Modeled seconds of the remap to the balanced layout, priced like the
        simulator: the busiest rank's NVLink bytes, the busiest inter-node link
        (a node when routed, else a NIC), one message per peer."""
        v = remap_volume(tokens, self.g)
        intra = max(int(v.intra_sent.max()), int(v.intra_received.max()))
        inter = max(np.bincount(self._link_of, v.inter_sent).max(),
                    np.bincount(self._link_of, v.inter_received).max())
        if not intra and not inter:
            return 0.0
        return self._remap_s(intra * self._bytes_per_token, float(inter) * self._bytes_per_token,
                             int(v.peers.max()))

    def _min_ring(self, length: int) -> int:
        hit = self._k_lo.get(length)
        if hit is None:
            hit = self._k_lo[length] = min_ring_size(length, self.cap)
        return hit

    def _apply(self, seq: int, ranks: tuple[int, ...], loads: _Loads, ulysses: bool = False) -> float:
        """Add a placement to ``loads``; return the rise in summed rank time."""
        length = int(self.lens[seq])
        pairs = self.pairs[seq] / len(ranks)
        if ulysses:
            d = len(ranks)
            shards = np.diff((np.arange(d + 1, dtype=np.int64) * length) // d)
            return loads.add(ranks, 0.0, 0.0, shards, pairs,
                             self.times.ulysses(length, d, self._is_inter(ranks)))
        total, compute = self.times.get(length, len(ranks), self._is_inter(ranks))
        shards = self._shard_tokens(length, len(ranks))[0] if len(ranks) > 1 else length
        return loads.add(ranks, total, compute, shards, pairs)

    # ------------------------------------------------------- heavy sequences
    def place_heavy(self, seqs: Sequence[int], setting: _Pass, rest_work: float,
                    loads: _Loads, out: _Assign) -> None:
        """Longest first.  Each sequence takes the smallest ring or Ulysses group
        (at least the token-forced size) whose shards fit under ``setting.level``
        x the level all work would reach if the still-unplaced part (``rest_work``
        is the light sequences') were spread evenly -- so early, long sequences
        leave room for the later ones instead of filling ranks to a fixed target."""
        local = self.local_s[list(seqs)].tolist()
        total = float(sum(local)) + rest_work
        rem_tokens = float(self.lens.sum())
        lin = loads.linear_per_token
        remaining = total + lin * rem_tokens    # unplaced work, linear included when it counts
        placed = float(loads.time.sum())
        for i, c in zip(seqs, local):
            length = int(self.lens[i])
            # The mean level is the water level while no rank sits above it
            # (the usual case, and O(1) instead of a sort).
            target = setting.level * (placed + remaining) / self.w
            self.density = setting.density * remaining / max(rem_tokens, 1.0)
            remaining -= c + lin * length
            rem_tokens -= length
            # Proportional share: a sequence never takes more ranks than its
            # part of the batch's work (beyond what the cap forces), so the
            # first long ones cannot crowd out the next.
            share = int(min(self.w, np.ceil(setting.share * self.w * c / total)))
            # The level every rank would end at without this sequence: a group's
            # total work (spread) lifts it from there.
            floor = target - setting.level * c / self.w
            ranks, ulysses = self._choose(length, target, loads, share, setting.spill, floor)
            placed += self._apply(i, ranks, loads, ulysses)
            out.set(i, ranks, ulysses)

    def _choose(self, length: int, target: float, loads: _Loads, share: int,
                spill: bool, floor: float) -> tuple[tuple[int, ...], bool]:
        """Ranks for one heavy sequence, and whether they form a Ulysses group."""
        k_lo = self._min_ring(length)
        k_hi = max(k_lo, min(self.w, length // 2, share))
        shard = self._largest_shard(length, k_lo)
        room = self.cap - loads.tokens
        # Projected load: free token slots will be filled at the remaining density.
        proj = loads.time + self.density * np.maximum(self.fill - loads.tokens, 0.0) \
            if self.density else loads.time
        key = np.where(room >= shard, proj, np.inf)
        # Per-token change of a rank's projected load: its free slots shrink
        # (density), its linear work grows when there is no remap.
        per_token = loads.linear_per_token - self.density
        if k_lo == 1:
            # Fast path (most sequences): local on the least-loaded rank fits.
            r = int(np.argmin(key))
            if key[r] + self._rank_time(length, 1) + per_token * length <= target:
                return (r,), False
        ranked = _Ranked(proj, room)

        def ring_spread(k: int) -> float:
            """The ring's total work spread over all ranks (see :func:`_lower`)."""
            return k * self._rank_time(length, k) / self.w

        def ring_peak(k: int, nth: int) -> float:
            """Load of the ``nth`` least-loaded rank with room for the shard of a
            ring of ``k``, plus that shard (``nth = k``: the ring's peak)."""
            return ranked.kth(nth, self._largest_shard(length, k)) + self._rank_time(length, k) \
                + per_token * length / k

        # Tiers: intra-node groups first, inter-node ones only when no intra-node
        # ring or Ulysses group fits under the target.  Within a tier a ring's
        # per-rank time falls with k (its total work grows), and across the node
        # boundary both jump to the NICs: a ring to the routed link, an
        # all-to-all to each GPU's NIC share.  Split no more than needed.
        best: tuple[float, int, float] | None = None
        ulysses: tuple[float, int, float] | None = None
        tiers = [(k_lo, min(self.g, k_hi)), (max(k_lo, self.g + 1), k_hi)]
        for lo, hi in tiers:
            if lo > hi:
                continue
            if spill or lo <= self.g or k_lo > self.g:
                best = _lower(best, _first_fit(lo, hi, ring_peak, target, ring_spread, floor), floor)
            ulysses = _lower(ulysses, self._ulysses_fit(length, lo, hi, ranked, target, per_token, floor),
                             floor)
            if any(c is not None and c[0] <= target for c in (best, ulysses)):
                break
        if ulysses is not None and (best is None or self._prefer_ulysses(best, ulysses, target, floor)):
            d = ulysses[1]
            return self._pick_ranks(d, np.where(room >= -(-length // d), proj, np.inf)), True
        if best is None:
            return self._token_fallback(length, loads), False
        k = best[1]
        return self._pick_ranks(k, np.where(room >= self._largest_shard(length, k), proj, np.inf)), False

    def _ulysses_fit(self, length: int, k_lo: int, k_hi: int, ranked: "_Ranked",
                     target: float, per_token: float, floor: float) -> tuple[float, int, float] | None:
        """Smallest Ulysses group (heads divide evenly, shards fit the cap) that
        fits under ``target``, else the best by :func:`_lower`.  Its
        kernel sees whole-length blocks (no short-block efficiency loss) but its
        all-to-alls block: it wins for long sequences on fast links."""
        best: tuple[float, int, float] | None = None
        for d in self.ulysses_sizes:
            if d < k_lo or d > k_hi or 2 * d > length:
                continue
            t = self.times.ulysses(length, d, d > self.g)
            f = ranked.kth(d, -(-length // d)) + t + per_token * length / d
            if not np.isfinite(f):
                continue
            if f <= target:
                return f, d, d * t / self.w
            best = _lower(best, (f, d, d * t / self.w), floor)
        return best

    @staticmethod
    def _prefer_ulysses(ring: tuple[float, int, float], ulysses: tuple[float, int, float],
                        target: float, floor: float) -> bool:
        """Both fit: the one with less total work (GPU-seconds); else :func:`_lower`."""
        if ring[0] <= target and ulysses[0] <= target:
            return ulysses[2] < ring[2]
        return _lower(ring, ulysses, floor) is ulysses

    def _pick_ranks(self, k: int, key: np.ndarray) -> tuple[int, ...]:
        """Node bucket, then GPU buckets: a ring that fits in a node goes to the
        node whose ``k`` least-loaded GPUs are least loaded (NVLink, no NIC
        traffic); a longer ring takes the least-loaded ranks, node-major order."""
        if k == 1:
            return (int(np.argmin(key)),)
        g = self.g
        if k <= g and self.nodes > 1:
            rows = key.reshape(self.nodes, g)
            kth = np.partition(rows, k - 1, axis=1)[:, k - 1]
            node = int(np.argmin(kth))
            if np.isfinite(kth[node]):
                local = np.argsort(rows[node], kind="stable")[:k]
                return tuple(sorted(int(node * g + j) for j in local))
        picked = np.argsort(key, kind="stable")[:k]
        return tuple(sorted(int(r) for r in picked))

    def _token_fallback(self, length: int, loads: _Loads) -> tuple[int, ...]:
        """Tokens only: the smallest ring whose shards fit the roomiest ranks."""
        room = self.cap - loads.tokens
        for k in range(self._min_ring(length), min(self.w, max(1, length // 2)) + 1):
            # The k roomiest ranks (a partition, not a sort: called once per
            # misfit of a nearly full batch, usually with k = 1 or 2).
            top = np.argpartition(-room, k - 1)[:k] if k < self.w else np.arange(k)
            if room[top].min() >= self._largest_shard(length, k):
                return tuple(sorted(top.tolist()))
        raise InfeasibleError(
            f"zeppelin: no room for a sequence of {length} tokens: the rest of the batch fills "
            f"the {self.w} GPUs up to tokens_per_gpu={self.cap}; lower the batch's token budget a "
            f"little below {self.w} x {self.cap} tokens or raise tokens_per_gpu")

    # ------------------------------------------------------- light sequences
    def fill_light(self, seqs: np.ndarray, norm_s: float | None, loads: _Loads, out: _Assign) -> None:
        """Short sequences stay local.  Longest first, in vectorised rounds: the
        round's i-th longest goes to the rank with the i-th lowest
        ``max(time / norm_s, tokens / mean tokens)`` (LPT on time where time is
        uneven, token water-filling where it is not), and only ranks below the
        level all remaining work would reach take part, so a rank already above
        it gets nothing.  One that does not fit there goes, before any shorter
        one, to the roomiest rank, or as a small ring over the roomiest ranks
        when no rank can hold it whole.  ``norm_s=None`` ranks by tokens alone
        (worst fit: keeps the free room even, the last resort of nearly full
        batches)."""
        # Work and tokens still to place from each position on (a suffix sum).
        work = self.local_s[seqs] + loads.linear_per_token * self.lens[seqs]
        rest_s = np.append(np.cumsum(work[::-1])[::-1], 0.0)
        rest_tokens = np.append(np.cumsum(self.lens[seqs][::-1])[::-1], 0)
        lo = 0
        while lo < len(seqs):
            if norm_s is None:
                score, n = loads.tokens, self.w
            else:
                score = np.maximum(loads.time / norm_s, loads.tokens / self.fill)
                n = self.w
                if loads.linear_per_token:
                    # Without remap tokens are time: a rank above the level must
                    # not take more.  (With remap a light sequence barely moves
                    # the time; every rank takes one per round, which spreads
                    # the tokens and leaves no fragments of free room.)
                    level = max((loads.time.sum() + rest_s[lo]) / (self.w * norm_s),
                                (loads.tokens.sum() + rest_tokens[lo]) / (self.w * self.fill))
                    n = int(np.count_nonzero(score < level)) or self.w
            batch = seqs[lo:lo + n]
            lo += len(batch)
            for key in (score, loads.tokens):
                # Second try for the misfits: the roomiest ranks, longest first.
                if not len(batch):
                    break
                ranks = np.argsort(key, kind="stable")[:len(batch)]
                fits = loads.tokens[ranks] + self.lens[batch] <= self.cap
                seq, ranks = batch[fits], ranks[fits]
                loads.add_local(ranks, self.local_s[seq], self.lens[seq], self.pairs[seq])
                out.local[seq] = ranks
                batch = batch[~fits]
            for i in batch.tolist():
                ranks = self._token_fallback(int(self.lens[i]), loads)
                out.set(i, ranks)
                self._apply(i, ranks, loads)

    # ------------------------------------------------------------ last resort
    def tokens_only(self, seqs: np.ndarray) -> _Assign:
        """Placement by tokens alone, for batches so full that every balanced
        pass stranded a sequence.  First: everything longest first on the
        roomiest rank (smallest ring when it cannot fit whole).  Else: the
        sequences that fit one GPU packed best-fit first, then the others as
        the widest rings whose shards still fit, so that several long
        sequences can share the same ranks."""
        out = _Assign.empty(len(self.lens))
        try:
            self.fill_light(seqs, None, _Loads.empty(self.w), out)
            return out
        except InfeasibleError:
            pass
        loads, out = _Loads.empty(self.w), _Assign.empty(len(self.lens))
        rest = []
        for i in seqs.tolist():
            length = int(self.lens[i])
            room = self.cap - loads.tokens
            fits = np.nonzero(room >= length)[0]
            if len(fits) == 0:
                rest.append(i)
                continue
            r = (int(fits[np.argmin(room[fits])]),)
            out.set(i, r)
            self._apply(i, r, loads)
        for i in rest:
            length = int(self.lens[i])
            room = np.sort(self.cap - loads.tokens)[::-1]
            widest = [k for k in range(2, min(self.w, length // 2) + 1)
                      if room[k - 1] >= self._largest_shard(length, k)]
            if widest:
                order = np.argsort(-(self.cap - loads.tokens), kind="stable")
                ranks = tuple(sorted(int(r) for r in order[:widest[-1]]))
            else:
                ranks = self._token_fallback(length, loads)   # raises if nothing fits
            out.set(i, ranks)
            self._apply(i, ranks, loads)
        return out


class ZeppelinPlanner:
    """Hierarchical sequence partitioning: local / intra-node ring / inter-node ring,
    and Ulysses groups where the cost model prefers them."""

    name = "zeppelin"

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        # A plan allocates tens of thousands of small objects (placements,
        # spans) and none of them forms a cycle: the cyclic collector's passes
        # over the whole heap would be pure overhead (~20 % at 1024 GPUs).
        with _gc_paused():
            return self._plan(seq_lens, ctx)

    def _plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        topo = ctx.topology
        w, g, cap = topo.world_size, topo.gpus_per_node, ctx.tokens_per_gpu
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        check_feasible(lens, w, cap)
        times = _TierTimes(ctx.cost, g, topo.nodes)
        packer = _Packer(lens, ctx, times)
        order = np.argsort(-lens, kind="stable")
        local_s = packer.local_s
        mean_s = max(float(local_s.sum()) / w, 1e-12)
        light = (lens <= LIGHT_TOKENS * cap) & (local_s <= LIGHT_TIME * mean_s)
        heavy = order[~light[order]].tolist()
        light_seqs = order[light[order]]
        light_work = float(local_s[light].sum())

        # The remap layer promises a token-balanced linear layout; without it
        # the attention layout is the linear one and is balanced with it.
        settings = [p for p in PASSES if p.remap == ctx.remap_enabled]
        results: list[_Result] = []
        for setting in settings[:max(1, PASS_BUDGET // max(len(heavy), 1))]:
            try:
                results.append(_one_pass(packer, heavy, light_seqs, light_work, mean_s, setting))
            except InfeasibleError:
                continue
        if results:
            chosen = _select(results)
            out, remap = chosen.assign, chosen.remap
        else:
            out, remap = packer.tokens_only(order), ctx.remap_enabled
        seq_lens = tuple(lens.tolist())
        # Most sequences are local: build those directly, not via the shard builder.
        local_mode, groups = Mode.LOCAL, out.groups
        attention = tuple(
            SeqPlacement(i, local_mode, (r,), (((0, n),),)) if r >= 0 else
            placement(i, n, Mode.ULYSSES if groups[i][1] else Mode.RING, groups[i][0])
            for i, (n, r) in enumerate(zip(seq_lens, out.local.tolist())))
        return Plan(strategy=self.name, world_size=w, gpus_per_node=g,
                    seq_lens=seq_lens, attention=attention,
                    linear=(balance_linear(attention, lens, w, g, cap) if remap
                            else same_layout_linear(w, attention)), token_cap=cap)


class _Ranked:
    """Ranks ordered by projected load, to ask for the ``k``-th least-loaded rank
    that has room for a shard: a wider group has smaller shards, so it can use
    ranks a narrower one cannot."""

    def __init__(self, proj: np.ndarray, room: np.ndarray) -> None:
        order = np.argsort(proj, kind="stable")
        self.proj, self.room = proj[order], room[order]
        self._prefix_room = np.minimum.accumulate(self.room)
        """Least room among the ``k`` least-loaded ranks: when it is enough, the
        answer is the k-th rank itself (no array pass, the usual case)."""

    def kth(self, k: int, need: int) -> float:
        """Projected load of the ``k``-th least-loaded rank with ``need`` free
        token slots (inf when fewer than ``k`` ranks have them)."""
        if self._prefix_room[k - 1] >= need:
            return float(self.proj[k - 1])
        j = int(np.searchsorted(np.cumsum(self.room >= need), k))
        return float(self.proj[j]) if j < len(self.proj) else np.inf


def _lower(a: tuple[float, int, float] | None, b: tuple[float, int, float] | None,
           floor: float) -> tuple[float, int, float] | None:
    """Of two ``(peak, size, spread)`` candidates that do not both fit the
    target, the one with the lower estimated step ``max(peak, floor + spread)``:
    ``spread`` is the group's total work over the world size, what it lifts the
    level every rank ends near from ``floor`` (that level without this
    sequence).  A wider group lowers its own peak but costs more work (short
    kernel blocks, NIC transfers): by peak alone the search took 32- to 64-rank
    groups for 30-100k token sequences once nothing fitted, doubling their work;
    by ``peak + spread`` it left ranks idle when nothing else could fill them
    (None: no candidate)."""
    if a is None:
        return b
    if b is None:
        return a
    return b if max(b[0], floor + b[2]) < max(a[0], floor + a[2]) else a


def _first_fit(lo: int, hi: int, peak, target: float, spread,
               floor: float) -> tuple[float, int, float] | None:
    """Within one tier: the smallest k in ``[lo, hi]`` whose ``peak(k, k)`` (the
    load the group's shards raise their k-th least-loaded rank to) is at most
    ``target``, else the best k among those tried by :func:`_lower` (None: too
    few ranks have token room)."""
    # The smallest size is always a candidate: for tiny sequences latency
    # makes a ring slower than its first size, not faster.
    f = peak(lo, lo)
    best = (f, lo, spread(lo)) if np.isfinite(f) else None
    if best is not None and f <= target:
        return best
    k = lo
    if k < hi:
        # Binary search on a lower bound, the emptiest eligible rank plus the
        # shard, which falls with k inside a tier (shards and per-rank time
        # shrink): no smaller size can fit.
        a, b = k + 1, hi
        while a < b:
            mid = (a + b) // 2
            if peak(mid, 1) > target:
                a = mid + 1
            else:
                b = mid
        k = a
    for kk in range(k, min(hi, 2 * k + 8) + 1):
        f = peak(kk, kk)
        if not np.isfinite(f):
            continue
        if f <= target:
            return f, kk, spread(kk)
        best = _lower(best, (f, kk, spread(kk)), floor)
    return best


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting still frees
    everything); restore it only if it was on, so nested or concurrent callers
    never leave it off."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class _Result:
    """One packing pass's plan and its modeled cost."""

    step_s: float
    """Modeled step time (attention + linear, + the estimated remap)."""
    pairs_imbalance: float
    """max / mean causal pairs per rank."""
    assign: _Assign
    """Where every sequence goes."""
    remap: bool
    """Whether the linear layout is token-balanced (else the attention layout)."""


def _select(results: list[_Result]) -> _Result:
    """The pass with the lowest causal-pairs imbalance among those whose modeled
    step is within PAIRS_SLACK of the best (first pass on ties)."""
    best = min(r.step_s for r in results)
    return min((r for r in results if r.step_s <= best * (1 + PAIRS_SLACK)), key=lambda r: r.pairs_imbalance)


def _one_pass(packer: _Packer, heavy: list[int], light: np.ndarray, light_work: float,
              mean_s: float, setting: _Pass) -> _Result:
    """Heavy placement, then the light fill."""
    per_token = 0.0 if setting.remap else packer.linear_per_token
    loads, out = _Loads.empty(packer.w, per_token), _Assign.empty(len(packer.lens))
    packer.place_heavy(heavy, setting, light_work, loads, out)
    filled, done = loads.copy(), out.copy()
    try:
        packer.fill_light(light, mean_s + per_token * packer.fill, filled, done)
    except InfeasibleError:
        # A nearly full batch can strand the last short sequences between
        # fragments of free room: fill again keeping the free room even.
        filled, done = loads.copy(), out.copy()
        packer.fill_light(light, None, filled, done)
    step = float(filled.time.max())
    if setting.remap:
        step += packer.balanced_linear_s + packer.remap_estimate(filled.tokens)
    return _Result(step, filled.pairs_imbalance(), done, setting.remap)


def check_feasible(lens: np.ndarray, world: int, cap: int) -> None:
    """Raise :class:`InfeasibleError` for batches no placement can hold."""
    if len(lens) and int(lens.min()) < 1:
        seq = int(np.argmin(lens))
        raise InfeasibleError(f"zeppelin: sequence {seq} has {int(lens[seq])} tokens; every "
                              f"sequence needs at least one token (drop empty documents)")
    for seq in np.nonzero(lens > cap)[0]:
        length = int(lens[seq])
        k = min_ring_size(length, cap)
        if k > world or 2 * k > length:
            raise InfeasibleError(
                f"zeppelin: sequence {int(seq)} has {length} tokens, more than the whole cluster "
                f"holds ({world} GPUs x tokens_per_gpu={cap}, zigzag shards of {k} ranks); lower "
                f"--max-seq-len to at most {world * cap}, raise tokens_per_gpu, or add GPUs")
    if int(lens.sum()) > cap * world:
        raise InfeasibleError(
            f"zeppelin: the batch has {int(lens.sum())} tokens, more than the cluster holds "
            f"({world} GPUs x tokens_per_gpu={cap} = {world * cap}); lower the batch's token budget")
