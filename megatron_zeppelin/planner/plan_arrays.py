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

from dataclasses import dataclass
from itertools import chain

import numpy as np

from megatron_zeppelin.plan import Mode, Plan

_MODE_CODE = {Mode.LOCAL: 0, Mode.RING: 1, Mode.ULYSSES: 2}


@dataclass(frozen=True)
class PlanArrays:
    """One plan's layouts, placements in plan order within each kind."""

    local_rank: np.ndarray
    """Rank of each local sequence."""
    local_len: np.ndarray
    """Length of each local sequence (float64)."""
    rings: dict[int, tuple[np.ndarray, np.ndarray]]
    """Ring size ``k`` -> ((rings, k) ranks by position, (rings,) lengths), sizes in order of first appearance."""
    group_ranks: np.ndarray
    """The Ulysses groups' ranks, group after group."""
    group_size: np.ndarray
    """Ranks of each Ulysses group."""
    group_len: np.ndarray
    """Length of each Ulysses group's sequence."""
    remap: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    """(sender, receiver, tokens) of the remap to the linear layout, one row per
    pair in (sender, receiver) order; None when it moves nothing."""
    linear_tokens: np.ndarray
    """Tokens per rank in the linear layout (float64)."""


def _slices(start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Indices ``start[i] .. start[i] + size[i] - 1``, slice after slice."""
    ends = np.cumsum(size)
    return np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(start - (ends - size), size)


def plan_arrays(plan: Plan) -> PlanArrays:
    w, att = plan.world_size, plan.attention
    n = len(att)
    seq_len = np.asarray(plan.seq_lens, np.int64)
    seq = np.fromiter((p.seq for p in att), np.int64, n)
    mode = np.fromiter((_MODE_CODE[p.mode] for p in att), np.int8, n)
    size = np.fromiter((len(p.ranks) for p in att), np.int64, n)
    flat = np.fromiter(chain.from_iterable(p.ranks for p in att), np.int64, int(size.sum()))
    first = np.cumsum(size) - size
    L = seq_len[seq]

    local = np.flatnonzero(mode == 0)
    ring = np.flatnonzero(mode == 1)
    rings = {}
    sizes, at = np.unique(size[ring], return_index=True)
    for k in sizes[np.argsort(at)].tolist():
        of = ring[size[ring] == k]
        rings[k] = (flat[first[of][:, None] + np.arange(k)], L[of])
    group = np.flatnonzero(mode == 2)

    # The attention layout as chunks: a ring of k cuts its sequence into 2k
    # chunks, position i holding chunks i and 2k - 1 - i; a Ulysses group of d
    # (or a local sequence, d = 1) into d, position i holding chunk i.
    chunks = np.where(mode == 1, 2 * size, size)
    of = np.repeat(np.arange(n), chunks)
    c = np.arange(len(of)) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    pos = np.where(c < size[of], c, chunks[of] - 1 - c)
    seq_start = np.cumsum(seq_len) - seq_len
    a_lo = seq_start[seq[of]] + c * L[of] // chunks[of]
    a_hi = seq_start[seq[of]] + (c + 1) * L[of] // chunks[of]
    a_owner = flat[first[of] + pos]

    spans = np.array([(sp.seq, sp.start, sp.end) for spans in plan.linear for sp in spans], np.int64).reshape(-1, 3)
    b_owner = np.repeat(np.arange(w), [len(spans) for spans in plan.linear])
    b_lo = seq_start[spans[:, 0]] + spans[:, 1]
    linear_tokens = np.bincount(b_owner, weights=spans[:, 2] - spans[:, 1], minlength=w)
    return PlanArrays(local_rank=flat[first[local]], local_len=L[local].astype(np.float64), rings=rings,
                      group_ranks=flat[_slices(first[group], size[group])], group_size=size[group],
                      group_len=L[group], remap=_moves(a_lo[a_hi > a_lo], a_owner[a_hi > a_lo], b_lo, b_owner,
                                                       int(seq_len.sum()), w),
                      linear_tokens=linear_tokens)


def _moves(a_lo: np.ndarray, a_owner: np.ndarray, b_lo: np.ndarray, b_owner: np.ndarray, total: int,
           w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Tokens per (owner in a, owner in b) pair that differ, of two partitions of
    ``[0, total)`` given by their pieces' starts and owners."""
    a, b = np.argsort(a_lo), np.argsort(b_lo)
    a_lo, a_owner, b_lo, b_owner = a_lo[a], a_owner[a], b_lo[b], b_owner[b]
    cuts = np.union1d(a_lo, b_lo)
    src = a_owner[np.searchsorted(a_lo, cuts, "right") - 1]
    dst = b_owner[np.searchsorted(b_lo, cuts, "right") - 1]
    moved = src != dst
    if not moved.any():
        return None
    length = np.diff(np.r_[cuts, total])[moved]
    pair, of = np.unique(src[moved] * w + dst[moved], return_inverse=True)
    return pair // w, pair % w, np.bincount(of, weights=length).astype(np.int64)
