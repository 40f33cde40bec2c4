"""Geometry of a packed ring or Ulysses group, summed over its sequences at once.

TransformerEngine's THD ring and FlexSP / DeepSpeed-Ulysses groups carry all
their sequences in one collective (``add_attention(pack=True)``): a message is
the sum of every member's message, a ring step's kernel the sum of every
member's blocks.  Summing member by member is O(members x k^2) Python calls per
layer (a 64-rank ring of 500 sequences: millions); these closed forms give the
same integers from per-position token sums and numpy products.

Ring positions hold two zigzag chunks, ``a[pos]`` then ``b[pos]`` rows
(``geometry.ring_blocks``): against an earlier owner both query chunks meet
the owner's first chunk (one fused block of ``a + b`` rows), against a later
owner the second query chunk meets both of the owner's chunks (one block of
``b`` rows), against itself three blocks (``a`` causal, ``b`` x ``a``, ``b``
causal).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_zeppelin.plan.plan import SeqPlacement


def chunk_rows(members: Sequence[SeqPlacement]) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)``: rows of each member's first and second chunk per position,
    shape ``(members, k)``."""
    a = np.array([[s[0][1] - s[0][0] for s in p.shards] for p in members], dtype=np.int64)
    b = np.array([[s[1][1] - s[1][0] for s in p.shards] for p in members], dtype=np.int64)
    return a, b


def summed_ring(members: Sequence[SeqPlacement]) -> SeqPlacement:
    """A placement whose chunk ``i`` of every position holds the members' chunk
    ``i`` rows together: its ring messages are the packed ring's."""
    a, b = (x.sum(axis=0) for x in chunk_rows(members))
    first = members[0]
    return SeqPlacement(first.seq, first.mode, first.ranks,
                        tuple(((0, int(x)), (int(x), int(x + y))) for x, y in zip(a, b)))


def summed_ulysses(members: Sequence[SeqPlacement]) -> SeqPlacement:
    """A placement whose every position holds the members' rows together (one
    span each): its all-to-all messages are the packed group's."""
    rows = np.array([[s[0][1] - s[0][0] for s in p.shards] for p in members], dtype=np.int64).sum(axis=0)
    first = members[0]
    return SeqPlacement(first.seq, first.mode, first.ranks, tuple(((0, int(n)),) for n in rows))


def ring_work(a: np.ndarray, b: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """``(pairs, rows)``: ``pairs[pos][owner]`` and ``rows[pos][owner]`` of position
    ``pos`` against ``owner``'s K/V, summed over the members (``geometry.block_pairs``
    of every member's ``ring_blocks``, and their rows' integer mean), for every
    pair of positions at once."""
    n, k = a.shape
    both = a + b
    owner_first = np.arange(k)[None, :] < np.arange(k)[:, None]      # [pos, owner]: owner < pos
    pairs = np.where(owner_first, both.T @ a, b.T @ both)
    rows = np.where(owner_first, both.sum(axis=0)[:, None] // n, b.sum(axis=0)[:, None] // n)
    own = np.arange(k)
    pairs[own, own] = (a * (a + 1) // 2 + b * a + b * (b + 1) // 2).sum(axis=0)
    rows[own, own] = (a + 2 * b).sum(axis=0) // (3 * n)
    return pairs.tolist(), rows.tolist()
