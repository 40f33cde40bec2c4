"""A plan as the flat numpy arrays the surrogate clock (``planner/surrogate.py``) reads.

A plan holds one Python object per sequence, shard and span; at 1,024 GPUs
(16K sequences) walking them per candidate cost the clock more than its whole
model.  :func:`plan_arrays` reads each placement's ranks and each linear span
once and derives the rest from the canonical shards (``plan/shards.py``;
``Plan.validate`` checks plans hold them): the rings by size, the Ulysses
groups, and the remap's tokens per (sender, receiver) -- what
``Plan.remap_schedule`` moves, summed per pair -- from the overlap of the two
layouts as partitions of the batch's tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Sequence

import numpy as np

from megatron_zeppelin.plan import Mode, Plan, SeqPlacement, Span, placement

MODE_CODE = {Mode.LOCAL: 0, Mode.RING: 1, Mode.ULYSSES: 2}


@dataclass(frozen=True)
class PlanArrays:
    """One plan's layouts, placements in plan order within each kind."""

    local_rank: np.ndarray
    """Rank of each local sequence."""
    local_len: np.ndarray
    """Length of each local sequence (float64)."""
    rings: dict[int, tuple[np.ndarray, np.ndarray]]
    """Ring size ``k`` -> ((rings, k) ranks by position, (rings,) lengths), sizes in
    order of first appearance; the plan's packed rings' members are not here."""
    group_ranks: np.ndarray
    """The Ulysses groups' ranks, group after group (a packed group once)."""
    group_size: np.ndarray
    """Ranks of each Ulysses group."""
    group_len: np.ndarray
    """Length of each Ulysses group's sequence (a packed group's: its members' summed)."""
    group_pairs: np.ndarray
    """Causal pairs one position of each Ulysses group computes (its members'
    whole sequences on ``1/d`` of the heads, summed: ``geometry.ulysses_pairs``)."""
    group_block: np.ndarray
    """Each Ulysses group's kernel block: its members' pair-weighted length
    (``schedule/attention.py``'s for a packed group; the length for one sequence)."""
    remap: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    """(sender, receiver, tokens) of the remap to the linear layout, one row per
    pair in (sender, receiver) order; None when it moves nothing."""
    linear_tokens: np.ndarray
    """Tokens per rank in the linear layout (float64)."""
    packed: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    """The plan's packed rings (``Plan.packed_rings``): ((k,) ranks by position,
    members' lengths in plan order) each (``planner/surrogate_packed.py`` prices them)."""


def has_inter_node_ring(arrays: PlanArrays, gpus_per_node: int) -> bool:
    """Whether a ring (packed or not) of the layout spans nodes."""
    members = [ranks for ranks, _ in arrays.rings.values()] + [ranks[None, :] for ranks, _ in arrays.packed]
    return any(len(r) and bool(np.any(r.min(axis=1) // gpus_per_node != r.max(axis=1) // gpus_per_node))
               for r in members)


def _slices(start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Indices ``start[i] .. start[i] + size[i] - 1``, slice after slice."""
    ends = np.cumsum(size)
    return np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(start - (ends - size), size)


def plan_arrays(plan: Plan) -> PlanArrays:
    """The arrays of ``plan`` (the decision reads each plan's once: ``planner/fastest.py: Floor``)."""
    return layout_arrays(plan.world_size, plan.seq_lens, plan.attention, plan.linear, plan.packed_rings,
                         plan.packed_ulysses)


@dataclass(frozen=True)
class Placements:
    """An attention layout as columns, one row per placement in plan order: what
    :func:`layout_arrays` reads of the :class:`SeqPlacement`\\s.  A baseline lays
    its candidates out as columns (``planner/baseline_candidates.py``), and the
    decision builds the placements of only those it runs."""

    seq: np.ndarray
    """Sequence of each placement."""
    mode: np.ndarray
    """Mode of each placement (``MODE_CODE``: 0 local, 1 ring, 2 Ulysses; int8)."""
    size: np.ndarray
    """Ranks of each placement."""
    ranks: np.ndarray
    """The placements' ranks, placement after placement (ring order for rings)."""

    @classmethod
    def of(cls, att: Sequence[SeqPlacement]) -> "Placements":
        """The columns of built placements."""
        n = len(att)
        ranks = list(map(attrgetter("ranks"), att))
        size = np.fromiter(map(len, ranks), np.int64, n)
        return cls(np.fromiter(map(attrgetter("seq"), att), np.int64, n),
                   np.fromiter(map(MODE_CODE.__getitem__, map(attrgetter("mode"), att)), np.int8, n),
                   size, np.fromiter(chain.from_iterable(ranks), np.int64, int(size.sum())))

    @classmethod
    def of_blocks(cls, seq: np.ndarray, mode: np.ndarray, first: np.ndarray, size: np.ndarray) -> "Placements":
        """Placements on consecutive ranks ``first .. first + size - 1``."""
        return cls(seq, mode.astype(np.int8), size, _slices(first, size))

    def build(self, seq_lens: Sequence[int]) -> tuple[SeqPlacement, ...]:
        """The canonical :class:`SeqPlacement`\\s (``plan.placement``).  Local ones
        (most of a batch) share their rank's tuple, and every placement its
        shards (``plan.placement`` caches them): fewer objects for the cyclic
        collector to scan while the plan lives."""
        modes, out = tuple(MODE_CODE), []
        alone: dict[int, tuple[int]] = {}
        ends = np.cumsum(self.size).tolist()
        flat = self.ranks.tolist()
        for seq, code, end, size in zip(self.seq.tolist(), self.mode.tolist(), ends, self.size.tolist()):
            if code == 0:
                r = flat[end - 1]
                ranks: Sequence[int] = alone.get(r) or alone.setdefault(r, (r,))
            else:
                ranks = flat[end - size:end]
            out.append(placement(seq, seq_lens[seq], modes[code], ranks))
        return tuple(out)

    def ulysses_packs(self) -> tuple[tuple[int, ...], ...]:
        """``plan.ulysses_by_ranks`` of these placements, from the columns."""
        ends = np.cumsum(self.size).tolist()
        flat = self.ranks.tolist()
        by_ranks: dict[tuple[int, ...], list[int]] = {}
        for i in np.flatnonzero(self.mode == 2).tolist():
            by_ranks.setdefault(tuple(flat[ends[i] - self.size[i]:ends[i]]), []).append(int(self.seq[i]))
        return tuple(tuple(seqs) for seqs in by_ranks.values() if len(seqs) > 1)

    def same(self, other: "Placements") -> bool:
        """Whether both are one layout (placements are canonical: seq, mode and ranks say all)."""
        return all(np.array_equal(a, b) for a, b in ((self.seq, other.seq), (self.mode, other.mode),
                                                      (self.size, other.size), (self.ranks, other.ranks)))


def layout_arrays(w: int, seq_lens: Sequence[int], att: Sequence[SeqPlacement] | Placements,
                  linear: Sequence[Sequence[Span]] | None,
                  packed_rings: Sequence[Sequence[int]] = (),
                  packed_ulysses: Sequence[Sequence[int]] = ()) -> PlanArrays:
    """:func:`plan_arrays` of the plan of ``att`` whose linear layout is
    ``linear``, or the attention layout itself (None: no remap), and whose
    ``Plan.packed_rings`` and ``Plan.packed_ulysses`` are ``packed_rings`` and
    ``packed_ulysses``, before that plan is built
    (building a baseline's plan, every span and its validation, cost more than
    pricing it)."""
    cols = att if isinstance(att, Placements) else Placements.of(att)
    n = len(cols.seq)
    seq_len = np.asarray(seq_lens, np.int64)
    seq, mode, size, flat = cols.seq, cols.mode, cols.size, cols.ranks
    first = np.cumsum(size) - size
    L = seq_len[seq]

    ring = np.flatnonzero(mode == 1)
    packed = ()
    if packed_rings:
        in_packed = np.zeros(len(seq_len), bool)
        in_packed[np.fromiter(chain.from_iterable(packed_rings), np.int64)] = True
        ring = ring[~in_packed[seq[ring]]]
        index_of = np.empty(len(seq_len), np.int64)
        index_of[seq] = np.arange(n)
        members = [np.sort(index_of[list(seqs)]) for seqs in packed_rings]     # placements in plan order
        packed = tuple((flat[first[m[0]]:first[m[0]] + size[m[0]]], L[m]) for m in members)
    lead = None                           # a Ulysses placement's group: its pack's first member
    if packed_ulysses:
        lead = np.arange(n)
        index_of = np.empty(len(seq_len), np.int64)
        index_of[seq] = np.arange(n)
        for seqs in packed_ulysses:
            members = index_of[list(seqs)]
            lead[members] = members.min()
    rings = {}
    sizes, at = np.unique(size[ring], return_index=True)
    for k in sizes[np.argsort(at)].tolist():
        of = ring[size[ring] == k]
        rings[k] = (flat[first[of][:, None] + np.arange(k)], L[of])

    # The attention layout as pieces (chunks): a ring of k cuts its sequence
    # into 2k chunks, position i holding chunks i and 2k - 1 - i; a Ulysses
    # group of d (or a local sequence, d = 1) into d, position i holding chunk i.
    chunks = np.where(mode == 1, 2 * size, size)
    of = np.repeat(np.arange(n), chunks)
    piece_first = np.cumsum(chunks) - chunks
    c = np.arange(len(of)) - piece_first[of]
    pos = np.where(c < size[of], c, chunks[of] - 1 - c)
    lo, hi = c * L[of] // chunks[of], (c + 1) * L[of] // chunks[of]
    owner = flat[first[of] + pos]

    held = hi > lo
    if linear is None:
        kept = np.flatnonzero(held)
        return _arrays(flat, first, size, mode, L, rings, None,
                       np.bincount(owner[kept], weights=hi[kept] - lo[kept], minlength=w), packed, lead)
    spans = np.fromiter(chain.from_iterable(map(attrgetter("seq", "start", "end"), chain.from_iterable(linear))),
                        np.int64).reshape(-1, 3)
    span_owner = np.repeat(np.arange(w), np.fromiter(map(len, linear), np.int64, w))
    linear_tokens = np.bincount(span_owner, weights=spans[:, 2] - spans[:, 1], minlength=w)
    # A layout without a remap (every baseline's) lists each rank's attention
    # pieces in buffer order: placements in order, a rank's chunks in order.
    # (uint16 ranks: numpy sorts them stably in linear time.)
    kept = np.flatnonzero(held)
    same = len(spans) == len(kept)
    if same:
        kept = kept[np.argsort(owner[kept].astype(np.uint16) if w <= 1 << 16 else owner[kept], kind="stable")]
        same = all(np.array_equal(x, y) for x, y in ((span_owner, owner[kept]), (spans[:, 0], seq[of[kept]]),
                                                     (spans[:, 1], lo[kept]), (spans[:, 2], hi[kept])))
    remap = None
    if not same:
        # Pieces in token order: placements by sequence (each sequence has one), chunks in order.
        by_seq = np.empty(n, np.int64)
        by_seq[seq] = np.arange(n)
        order = _slices(piece_first[by_seq], chunks[by_seq])
        order = order[held[order]]
        seq_start = np.cumsum(seq_len) - seq_len
        remap = _moves(seq_start[seq[of[order]]] + lo[order], owner[order],
                       seq_start[spans[:, 0]] + spans[:, 1], span_owner, int(seq_len.sum()), w)
    return _arrays(flat, first, size, mode, L, rings, remap, linear_tokens, packed, lead)


def _arrays(flat: np.ndarray, first: np.ndarray, size: np.ndarray, mode: np.ndarray, L: np.ndarray,
            rings: dict[int, tuple[np.ndarray, np.ndarray]], remap: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
            linear_tokens: np.ndarray, packed: tuple[tuple[np.ndarray, np.ndarray], ...],
            lead: np.ndarray | None) -> PlanArrays:
    local, member = np.flatnonzero(mode == 0), np.flatnonzero(mode == 2)
    pairs = (L[member] * (L[member] + 1) // 2) // size[member]
    if lead is None:                                             # one group per sequence
        group, length, summed, block = member, L[member], pairs, L[member]
    else:
        group = member[lead[member] == member]                   # one per group, in plan order
        of = np.searchsorted(group, lead[member])                # each member's group
        length = np.bincount(of, weights=L[member], minlength=len(group)).astype(np.int64)
        summed = np.bincount(of, weights=pairs, minlength=len(group)).astype(np.int64)
        # A packed group's block as the schedule's (float sums: a surrogate's
        # input); one sequence's block is its length, exactly.
        block = np.bincount(of, weights=pairs * L[member], minlength=len(group)) // np.maximum(summed, 1)
        block = np.where(np.bincount(of, minlength=len(group)) == 1, L[group], np.maximum(block, 1)).astype(np.int64)
    return PlanArrays(local_rank=flat[first[local]], local_len=L[local].astype(np.float64), rings=rings,
                      group_ranks=flat[_slices(first[group], size[group])], group_size=size[group],
                      group_len=length, remap=remap, linear_tokens=linear_tokens, packed=packed,
                      group_pairs=summed, group_block=block)


def _moves(a_lo: np.ndarray, a_owner: np.ndarray, b_lo: np.ndarray, b_owner: np.ndarray, total: int,
           w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Tokens per (owner in a, owner in b) pair that differ, of two partitions of
    ``[0, total)`` given by their pieces' starts (``a_lo`` ascending) and owners."""
    b = np.argsort(b_lo, kind="stable")
    b_lo, b_owner = b_lo[b], b_owner[b]
    cuts = np.sort(np.concatenate([a_lo, b_lo]), kind="stable")     # two sorted runs: a linear merge
    cuts = cuts[np.r_[True, cuts[1:] != cuts[:-1]]]
    src = a_owner[np.searchsorted(a_lo, cuts, "right") - 1]
    dst = b_owner[np.searchsorted(b_lo, cuts, "right") - 1]
    moved = src != dst
    if not moved.any():
        return None
    length = np.diff(np.r_[cuts, total])[moved]
    pair, of = np.unique(src[moved] * w + dst[moved], return_inverse=True)
    return pair // w, pair % w, np.bincount(of, weights=length).astype(np.int64)


def pack_rings(layout: PlanArrays) -> PlanArrays:
    """``layout`` with every ring rank tuple holding two or more sequences as one
    packed ring (``plan.rings_by_ranks``), from its arrays alone: a static CP
    layout's packed copy costs no second read of its placements.  Packed rings
    come size by size, each size's by first appearance; members in plan order."""
    rings, packed = {}, []
    for k, (ranks, L) in layout.rings.items():
        order = np.lexsort(ranks.T[::-1])               # stable: each tuple's rings in plan order
        tuples = ranks[order]
        start = np.flatnonzero(np.r_[True, (tuples[1:] != tuples[:-1]).any(axis=1)])
        count = np.diff(np.r_[start, len(order)])
        solo = np.zeros(len(order), bool)
        solo[order[start[count == 1]]] = True
        if solo.any():
            rings[k] = (ranks[solo], L[solo])
        multi = np.flatnonzero(count > 1)
        multi = multi[np.argsort(order[start[multi]])]   # by first appearance
        members = L[order]
        packed += [(tuples[start[t]], members[start[t]:start[t] + count[t]]) for t in multi.tolist()]
    return dataclasses.replace(layout, rings=rings, packed=tuple(packed))
