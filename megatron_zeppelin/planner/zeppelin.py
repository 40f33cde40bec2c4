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
communication; Ulysses all-to-alls block.  The linear modules run on the
token-balanced layout of :mod:`.linear_layout`, equal on every rank, so only
attention is balanced here.  docs/planner.md explains the choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode, Plan, SeqPlacement, placement
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.planner.linear_layout import balance_linear

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
    """Allow inter-node rings where an intra-node one would do (off: only when
    the token cap forces more ranks than a node has; Ulysses groups, whose
    all-to-alls are priced on the link they use, may still span nodes)."""


#: Passes in order of usefulness (measured on long-tailed code corpora at 64
#: GPUs, docs/planner.md); large clusters run only the first few.
PASSES: tuple[_Pass, ...] = (
    _Pass(1.2, 0.0, spill=False), _Pass(1.2, 0.0, share=1.0), _Pass(1.35, 0.0),
    _Pass(1.1, 0.0, spill=False), _Pass(1.2, 0.2), _Pass(1.0, 0.0), _Pass(1.35, 0.4),
    _Pass(1.2, 0.4))
#: A sequence is "light" when its local attention takes at most LIGHT_TIME of
#: the mean per-rank attention time and it holds at most LIGHT_TOKENS of the
#: token cap: it stays local and is placed after the heavy ones by a vectorised
#: LPT fill (too small to unbalance a rank's time or to strand its tokens).
LIGHT_TIME = 0.25
LIGHT_TOKENS = 0.25
#: Packing passes are tried in PASSES order while (heavy sequences x passes)
#: stays within this budget (at least one pass): large clusters get fewer.
PASS_BUDGET = 200


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
        self._memo: dict[tuple[int, int, bool], tuple[float, float]] = {}

    def ulysses(self, length: int, d: int, inter: bool) -> float:
        """Per-rank seconds of a Ulysses group of ``d`` (nothing overlaps its all-to-alls)."""
        key = (length, -d, inter)
        hit = self._memo.get(key)
        if hit is None:
            hit = (self.cost.ulysses_cost(length, d, self.inter if inter else self.intra).total_s, 0.0)
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

    @classmethod
    def empty(cls, world: int) -> "_Loads":
        return cls(np.zeros(world), np.zeros(world), np.zeros(world, dtype=np.int64),
                   np.zeros(world), np.zeros(world))

    def add(self, idx: np.ndarray, total: float, compute: float, tokens: np.ndarray | int,
            ulysses: float = 0.0) -> float:
        """Add a placement's per-rank load on ranks ``idx``; return the rise in summed time."""
        before = float(self.time[idx].sum())
        self.ring[idx] += total
        self.compute[idx] += compute
        self.tokens[idx] += tokens
        self.ulysses[idx] += ulysses
        self.time[idx] = self.ulysses[idx] + np.maximum(self.ring[idx], self.compute[idx])
        return float(self.time[idx].sum()) - before

    def copy(self) -> "_Loads":
        return _Loads(self.ring.copy(), self.compute.copy(), self.tokens.copy(),
                      self.ulysses.copy(), self.time.copy())


class _Packer:
    """Places sequences on ranks, updating :class:`_Loads` (one packing pass)."""

    def __init__(self, lens: np.ndarray, ctx: PlanContext, times: _TierTimes) -> None:
        topo = ctx.topology
        self.lens, self.times = lens, times
        self.w, self.g, self.nodes = topo.world_size, topo.gpus_per_node, topo.nodes
        self.cap = ctx.tokens_per_gpu
        self.fill = max(float(lens.sum()) / self.w, 1.0)
        self.density = 0.0
        uniq, inverse = np.unique(lens, return_inverse=True)
        self.local_s = np.array([times.cost.local_attn_s(int(n)) for n in uniq])[inverse]
        """Local attention seconds of every sequence."""
        heads = int(np.gcd(*ctx.local_heads))
        self.ulysses_sizes = [d for d in range(2, min(heads, self.w) + 1) if heads % d == 0]
        """Ulysses group sizes the engine can run: they divide the query and KV heads."""
        self.ulysses: set[int] = set()
        """Sequences of the current pass placed as Ulysses groups."""

    # ----------------------------------------------------------- cost view
    def _is_inter(self, ranks: tuple[int, ...]) -> bool:
        return len(ranks) > 1 and ranks[0] // self.g != ranks[-1] // self.g

    def _rank_time(self, length: int, k: int) -> float:
        """Per-rank modeled time of a ring of ``k`` (inter-node once it outgrows a node)."""
        total, compute = self.times.get(length, k, k > self.g)
        return total if k > 1 else compute

    def _apply(self, length: int, ranks: tuple[int, ...], loads: _Loads, ulysses: bool = False) -> float:
        """Add a placement to ``loads``; return the rise in summed rank time."""
        if ulysses:
            d = len(ranks)
            shards = np.diff((np.arange(d + 1, dtype=np.int64) * length) // d)
            return loads.add(np.asarray(ranks), 0.0, 0.0, shards,
                             self.times.ulysses(length, d, self._is_inter(ranks)))
        total, compute = self.times.get(length, len(ranks), self._is_inter(ranks))
        shards = zigzag_shard_tokens(length, len(ranks)) if len(ranks) > 1 else length
        return loads.add(np.asarray(ranks), total, compute, shards)

    # ------------------------------------------------------- heavy sequences
    def place_heavy(self, seqs: Sequence[int], setting: _Pass, rest_work: float,
                    loads: _Loads, out: dict[int, tuple[int, ...]]) -> None:
        """Longest first.  Each sequence takes the smallest ring or Ulysses group
        (at least the token-forced size) whose shards fit under ``setting.level``
        x the level all work would reach if the still-unplaced part (``rest_work``
        is the light sequences') were spread evenly -- so early, long sequences
        leave room for the later ones instead of filling ranks to a fixed target."""
        local = self.local_s[list(seqs)].tolist()
        remaining = total = float(sum(local)) + rest_work
        rem_tokens = float(self.lens.sum())
        placed = float(loads.time.sum())
        for i, c in zip(seqs, local):
            length = int(self.lens[i])
            # The mean level is the water level while no rank sits above it
            # (the usual case, and O(1) instead of a sort).
            target = setting.level * (placed + remaining) / self.w
            self.density = setting.density * remaining / max(rem_tokens, 1.0)
            remaining -= c
            rem_tokens -= length
            # Proportional share: a sequence never takes more ranks than its
            # part of the batch's work (beyond what the cap forces), so the
            # first long ones cannot crowd out the next.
            share = int(min(self.w, np.ceil(setting.share * self.w * c / total)))
            ranks, ulysses = self._choose(length, target, loads, share, setting.spill)
            placed += self._apply(length, ranks, loads, ulysses)
            out[i] = ranks
            if ulysses:
                self.ulysses.add(i)

    def _choose(self, length: int, target: float, loads: _Loads, share: int,
                spill: bool) -> tuple[tuple[int, ...], bool]:
        """Ranks for one heavy sequence, and whether they form a Ulysses group."""
        k_lo = min_ring_size(length, self.cap)
        k_hi = max(k_lo, min(self.w, length // 2, share))
        shard = length if k_lo == 1 else int(zigzag_shard_tokens(length, k_lo).max())
        # Projected load: free token slots will be filled at the remaining density.
        proj = loads.time + self.density * np.maximum(self.fill - loads.tokens, 0.0)
        key = np.where(self.cap - loads.tokens >= shard, proj, np.inf)
        if k_lo == 1:
            # Fast path (most sequences): local on the least-loaded rank fits.
            r = int(np.argmin(key))
            if key[r] + self._rank_time(length, 1) - self.density * length <= target:
                return (r,), False
        ordered = np.sort(key)

        def net(k: int) -> float:
            return self._rank_time(length, k) - self.density * length / k

        # Intra-node sizes first, then inter-node ones: within each tier a
        # ring's per-rank time falls with k (its total work grows), across the
        # node boundary it jumps to the NIC link.  Split no more than needed.
        best: tuple[float, int] | None = None
        segments = [(k_lo, min(self.g, k_hi))]
        if spill or k_lo > self.g:
            segments.append((max(k_lo, self.g + 1), k_hi))
        for lo, hi in segments:
            if lo > hi:
                continue
            found = self._first_fit(lo, hi, ordered, net, target)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
            if best is not None and best[0] <= target:
                break
        ulysses = self._ulysses_fit(length, k_lo, k_hi, ordered, target)
        if ulysses is not None and (best is None or self._prefer_ulysses(length, best, ulysses, target)):
            d = ulysses[1]
            chunk = -(-length // d)
            return self._pick_ranks(d, np.where(self.cap - loads.tokens >= chunk, proj, np.inf)), True
        if best is None:
            return self._token_fallback(length, loads), False
        k = best[1]
        shard = length if k == 1 else int(zigzag_shard_tokens(length, k).max())
        return self._pick_ranks(k, np.where(self.cap - loads.tokens >= shard, proj, np.inf)), False

    def _ulysses_fit(self, length: int, k_lo: int, k_hi: int, ordered: np.ndarray,
                     target: float) -> tuple[float, int] | None:
        """Smallest Ulysses group (heads divide evenly, shards fit the cap) that
        fits under ``target``, else the one with the lowest resulting load.  Its
        kernel sees whole-length blocks (no short-block efficiency loss) but its
        all-to-alls block: it wins for long sequences on fast links."""
        best: tuple[float, int] | None = None
        for d in self.ulysses_sizes:
            if d < k_lo or d > k_hi or 2 * d > length or not np.isfinite(ordered[d - 1]):
                continue
            t = self.times.ulysses(length, d, d > self.g) - self.density * length / d
            f = float(ordered[d - 1]) + t
            if best is None or f < best[0]:
                best = (f, d)
            if f <= target:
                break
        return best

    def _prefer_ulysses(self, length: int, ring: tuple[float, int], ulysses: tuple[float, int],
                        target: float) -> bool:
        """Both fit: the one with less total work (GPU-seconds); else the lower load."""
        if ring[0] <= target and ulysses[0] <= target:
            k, d = ring[1], ulysses[1]
            return d * self.times.ulysses(length, d, d > self.g) < k * self._rank_time(length, k)
        return ulysses[0] < ring[0]

    @staticmethod
    def _first_fit(lo: int, hi: int, ordered: np.ndarray, net, target: float) -> tuple[float, int] | None:
        """Within one tier: the smallest k in ``[lo, hi]`` whose shard raises the
        k-th least-loaded rank to at most ``target``, or the k with the lowest
        such peak among those tried (None: too few ranks have token room)."""
        # The smallest size is always a candidate: for tiny sequences latency
        # makes a ring slower than its first size, not faster.
        best = (float(ordered[lo - 1]) + net(lo), lo) if np.isfinite(ordered[lo - 1]) else None
        k = lo
        if k < hi and ordered[0] + net(k) > target:
            # Binary search: the emptiest rank's bound falls monotonically with k.
            a, b = k + 1, hi
            while a < b:
                mid = (a + b) // 2
                if ordered[0] + net(mid) > target:
                    a = mid + 1
                else:
                    b = mid
            k = a
        for kk in range(k, min(hi, 2 * k + 8) + 1):
            if not np.isfinite(ordered[kk - 1]):
                break
            f = float(ordered[kk - 1]) + net(kk)
            if best is None or f < best[0]:
                best = (f, kk)
            if f <= target:
                break
        return best

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
        order = np.argsort(-room, kind="stable")
        for k in range(min_ring_size(length, self.cap), min(self.w, max(1, length // 2)) + 1):
            need = length if k == 1 else int(zigzag_shard_tokens(length, k).max())
            if room[order[k - 1]] >= need:
                return tuple(sorted(int(r) for r in order[:k]))
        raise InfeasibleError(
            f"zeppelin: no room for a sequence of {length} tokens: the rest of the batch fills "
            f"the {self.w} GPUs up to tokens_per_gpu={self.cap}; lower the batch's token budget a "
            f"little below {self.w} x {self.cap} tokens or raise tokens_per_gpu")

    # ------------------------------------------------------- light sequences
    def fill_light(self, seqs: Sequence[int], norm_s: float | None, loads: _Loads,
                   out: dict[int, tuple[int, ...]]) -> None:
        """Short sequences stay local.  Longest first, in rounds of at most W:
        the round's i-th longest goes to the rank with the i-th lowest
        ``max(time / norm_s, tokens / mean tokens)`` (LPT, vectorised; they barely
        move the time, so they mostly even out the tokens).  One that does not
        fit there goes, before any shorter one, to the roomiest rank, or as a
        small ring over the roomiest ranks when no rank can hold it whole.
        ``norm_s=None`` ranks by tokens alone (worst fit: keeps the free room
        even, the last resort of nearly full batches)."""
        seqs = np.asarray(seqs, dtype=np.int64)
        for lo in range(0, len(seqs), self.w):
            batch = seqs[lo:lo + self.w]
            score = loads.tokens if norm_s is None else \
                np.maximum(loads.time / norm_s, loads.tokens / self.fill)
            for key in (score, loads.tokens):
                # Second try for the misfits: the roomiest ranks, longest first.
                ranks = np.argsort(key, kind="stable")[:len(batch)]
                fits = loads.tokens[ranks] + self.lens[batch] <= self.cap
                loads.add(ranks[fits], 0.0, self.local_s[batch[fits]], self.lens[batch[fits]])
                out.update((int(i), (int(r),)) for i, r in zip(batch[fits], ranks[fits]))
                batch = batch[~fits]
            for i in batch:
                length = int(self.lens[i])
                out[int(i)] = self._token_fallback(length, loads)
                self._apply(length, out[int(i)], loads)

    # ------------------------------------------------------------ last resort
    def tokens_only(self, seqs: list[int]) -> dict[int, tuple[int, ...]]:
        """Placement by tokens alone, for batches so full that every balanced
        pass stranded a sequence.  First: everything longest first on the
        roomiest rank (smallest ring when it cannot fit whole).  Else: the
        sequences that fit one GPU packed best-fit first, then the others as
        the widest rings whose shards still fit, so that several long
        sequences can share the same ranks."""
        out: dict[int, tuple[int, ...]] = {}
        try:
            self.fill_light(seqs, None, _Loads.empty(self.w), out)
            return out
        except InfeasibleError:
            pass
        loads, out = _Loads.empty(self.w), {}
        rest = []
        for i in seqs:
            length = int(self.lens[i])
            room = self.cap - loads.tokens
            fits = np.nonzero(room >= length)[0]
            if len(fits) == 0:
                rest.append(i)
                continue
            r = int(fits[np.argmin(room[fits])])
            out[i] = (r,)
            self._apply(length, (r,), loads)
        for i in rest:
            length = int(self.lens[i])
            room = np.sort(self.cap - loads.tokens)[::-1]
            widest = [k for k in range(2, min(self.w, length // 2) + 1)
                      if room[k - 1] >= zigzag_shard_tokens(length, k).max()]
            if widest:
                order = np.argsort(-(self.cap - loads.tokens), kind="stable")
                out[i] = tuple(sorted(int(r) for r in order[:widest[-1]]))
            else:
                out[i] = self._token_fallback(length, loads)   # raises if nothing fits
            self._apply(length, out[i], loads)
        return out


class ZeppelinPlanner:
    """Hierarchical sequence partitioning: local / intra-node ring / inter-node ring,
    and Ulysses groups where the cost model prefers them."""

    name = "zeppelin"

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
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
        light_seqs = order[light[order]].tolist()
        light_work = float(local_s[light].sum())

        best: tuple[float, dict[int, tuple[int, ...]], set[int]] | None = None
        for setting in PASSES[:max(1, PASS_BUDGET // max(len(heavy), 1))]:
            try:
                result = _one_pass(packer, heavy, light_seqs, light_work, mean_s, setting)
            except InfeasibleError:
                continue
            if best is None or result[0] < best[0] - 1e-12:
                best = result
        if best is None:
            out, ulysses = packer.tokens_only(order.tolist()), set()
        else:
            _, out, ulysses = best
        seq_lens = tuple(lens.tolist())
        # Most sequences are local: build those directly, not via the shard builder.
        ranks = [out[i] for i in range(len(seq_lens))]
        attention = tuple(SeqPlacement(i, Mode.LOCAL, r, (((0, n),),)) if len(r) == 1 else
                          placement(i, n, Mode.ULYSSES if i in ulysses else Mode.RING, r)
                          for i, (n, r) in enumerate(zip(seq_lens, ranks)))
        return Plan(strategy=self.name, world_size=w, gpus_per_node=g,
                    seq_lens=seq_lens, attention=attention,
                    linear=(balance_linear(attention, lens, w, g, cap) if ctx.remap_enabled
                            else same_layout_linear(w, attention)), token_cap=cap)


def _one_pass(packer: _Packer, heavy: list[int], light: list[int], light_work: float,
              mean_s: float, setting: _Pass) -> tuple[float, dict[int, tuple[int, ...]], set[int]]:
    """Heavy placement, then the light fill: (modeled attention makespan,
    placement, the sequences placed as Ulysses groups)."""
    loads, out = _Loads.empty(packer.w), {}
    packer.ulysses = set()
    packer.place_heavy(heavy, setting, light_work, loads, out)
    filled, done = loads.copy(), dict(out)
    try:
        packer.fill_light(light, mean_s, filled, done)
    except InfeasibleError:
        # A nearly full batch can strand the last short sequences between
        # fragments of free room: fill again keeping the free room even.
        filled, done = loads.copy(), dict(out)
        packer.fill_light(light, None, filled, done)
    return float(filled.time.max()), done, packer.ulysses


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
