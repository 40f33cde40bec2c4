"""One packing pass: heavy sequences by the cost model, light ones by a vectorised fill."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.plan.shards import contiguous_shard_tokens, zigzag_shard_tokens
from megatron_zeppelin.planner.zeppelin.loads import _Assign, _Loads, _TierTimes, min_ring_size
from megatron_zeppelin.planner.zeppelin.search import _first_fit, _lower, _Ranked
from megatron_zeppelin.planner.zeppelin.settings import _Pass

class _Packer:
    """Places sequences on ranks, updating :class:`_Loads` (one packing pass)."""

    def __init__(self, lens: np.ndarray, ctx: PlanContext, times: _TierTimes, memo_of: "_Packer | None" = None) -> None:
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
        # Shard sizes by (length, ring size; minus the group size: Ulysses) and
        # least ring sizes by length depend on the lengths and the cap alone:
        # ``memo_of``, a packer of the same batch and cap, shares its own.
        same = memo_of is not None and memo_of.cap == self.cap
        self._shards: dict[tuple[int, int], tuple[np.ndarray, int]] = memo_of._shards if same else {}
        self._k_lo: dict[int, int] = memo_of._k_lo if same else {}

    # ----------------------------------------------------------- cost view
    def _is_inter(self, ranks: tuple[int, ...]) -> bool:
        return len(ranks) > 1 and ranks[0] // self.g != ranks[-1] // self.g

    def _rank_time(self, length: int, k: int) -> float:
        """Per-rank modeled time of a ring of ``k`` (inter-node once it outgrows a node)."""
        total, compute = self.times.get(length, k, k > self.g)
        return total if k > 1 else compute

    def _shard_tokens(self, length: int, k: int, ulysses: bool = False) -> tuple[np.ndarray, int]:
        """Memoised :func:`zigzag_shard_tokens` (``ulysses``: a group's
        :func:`contiguous_shard_tokens`) and its largest shard (every pass asks
        for the same ones)."""
        key = (length, -k if ulysses else k)
        hit = self._shards.get(key)
        if hit is None:
            sizes = (contiguous_shard_tokens if ulysses else zigzag_shard_tokens)(length, k)
            hit = self._shards[key] = (sizes, int(sizes.max()))
        return hit

    def _largest_shard(self, length: int, k: int) -> int:
        return length if k == 1 else self._shard_tokens(length, k)[1]

    def _min_ring(self, length: int) -> int:
        hit = self._k_lo.get(length)
        if hit is None:
            hit = self._k_lo[length] = min_ring_size(length, self.cap)
        return hit

    def _apply(self, seq: int, ranks: tuple[int, ...], loads: _Loads, ulysses: bool = False) -> float:
        """Add a placement to ``loads``; return the rise in summed rank time."""
        length = int(self.lens[seq])
        if ulysses:
            d = len(ranks)
            return loads.add(ranks, 0.0, 0.0, self._shard_tokens(length, d, ulysses=True)[0],
                             self.times.ulysses(length, d, self._is_inter(ranks)))
        total, compute = self.times.get(length, len(ranks), self._is_inter(ranks))
        shards = self._shard_tokens(length, len(ranks))[0] if len(ranks) > 1 else length
        return loads.add(ranks, total, compute, shards)

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
                loads.add_local(ranks, self.local_s[seq], self.lens[seq])
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
