"""Greedy packing shared by the baseline planners.

Sequences are placed longest first (ties: lower index first), each onto the
least-loaded bin (ties: lower bin) whose ranks all stay under the per-rank token
cap -- the LPT rule that DP packing and TE CP replicas use to balance work.  A
bin is a group of ``width`` ranks that shares every sequence placed on it; how a
sequence's tokens spread over those ranks is the caller's ``shares`` function
(one rank for DP packing, zigzag chunks for a CP group).
"""

from __future__ import annotations

import heapq
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Callable, Sequence

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode, SeqPlacement, placement
from megatron_zeppelin.plan.shards import chunk_bounds

#: ``shares(length, rank_loads) -> tokens per rank of the bin`` (same order).
Shares = Callable[[int, Sequence[int]], Sequence[int]]


@dataclass
class Bins:
    """``num_bins`` bins of ``width`` ranks each, filled by :func:`pack_longest_first`."""

    num_bins: int
    """Number of bins (DP replicas or ranks)."""
    width: int
    """Ranks per bin."""
    cap: int
    """Per-rank token cap."""
    loads: list[list[int]] = field(init=False)
    """``loads[b][i]``: tokens on rank ``i`` of bin ``b``."""
    items: list[list[tuple[int, tuple[int, ...]]]] = field(init=False)
    """``items[b]``: ``(seq, tokens per rank)`` in placement order."""
    by_tokens: list[tuple[int, int]] = field(init=False)
    """Heap of ``(tokens, b)``: the bins in the order a sequence tries them."""

    def __post_init__(self) -> None:
        self.loads = [[0] * self.width for _ in range(self.num_bins)]
        self.items = [[] for _ in range(self.num_bins)]
        self.by_tokens = [(0, b) for b in range(self.num_bins)]


def pack_longest_first(seq_lens: Sequence[int], bins: Bins, shares: Shares, *, strategy: str,
                       what: str) -> Bins:
    """Place every sequence on the bin with the fewest tokens where it fits.

    Raises :class:`InfeasibleError` naming the first sequence that fits nowhere."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)   # stable: ties by index
    for seq in order:
        L = seq_lens[seq]
        if not _place(bins, seq, L, shares):
            free = max((bins.cap - max(ld) for ld in bins.loads), default=0)
            raise InfeasibleError(
                f"{strategy}: sequence {seq} (length {L}) does not fit on any {what}: the emptiest "
                f"one has room for {free} more tokens per GPU under the cap of {bins.cap} "
                f"({sum(seq_lens)} tokens on {bins.num_bins * bins.width} GPUs); raise "
                f"--tokens-per-gpu or use a strategy that splits sequences")
    return bins


def pack_in_rounds(seq_lens: Sequence[int], make_bins: Callable[[], Bins], shares: Shares, *,
                   strategy: str, what: str) -> list[Bins]:
    """Micro-batches of a batch that does not fit at once: each round packs the
    remaining sequences longest first (:func:`pack_longest_first`), and those
    that fit no bin wait for the next round, as gradient accumulation would run
    them.  Returns the bins of every round (items hold batch-wide sequence
    indices).  A sequence that fits no empty bin raises."""
    remaining = list(range(len(seq_lens)))
    rounds = []
    while remaining:
        bins, placed, deferred = make_bins(), [], []
        for seq in sorted(remaining, key=seq_lens.__getitem__, reverse=True):   # stable: ties by index
            if _place(bins, seq, seq_lens[seq], shares):
                placed.append(seq)
            else:
                deferred.append(seq)
        if not placed:
            seq = deferred[0]
            raise InfeasibleError(
                f"{strategy}: sequence {seq} (length {seq_lens[seq]}) does not fit on an empty {what} "
                f"under the cap of {bins.cap} tokens per GPU; raise --tokens-per-gpu or use a "
                "larger group")
        rounds.append(bins)
        remaining = sorted(deferred)
    return rounds


def _place(bins: Bins, seq: int, length: int, shares: Shares) -> bool:
    """Put ``seq`` on the bin with the fewest tokens (ties: lower bin) where it
    fits; False if none.  Bins leave the heap in that order until one fits, and
    those that did not go back: a sequence costs ``log`` of the bins, not a sort
    of them (1,024 bins, 16,384 sequences)."""
    tried = []
    placed = False
    while bins.by_tokens:
        tokens, b = heapq.heappop(bins.by_tokens)
        share = tuple(shares(length, bins.loads[b]))
        if all(load + s <= bins.cap for load, s in zip(bins.loads[b], share)):
            bins.loads[b] = [load + s for load, s in zip(bins.loads[b], share)]
            bins.items[b].append((seq, share))
            tried.append((tokens + sum(share), b))
            placed = True
            break
        tried.append((tokens, b))
    for entry in tried:
        heapq.heappush(bins.by_tokens, entry)
    return placed


def one_rank(length: int, loads: Sequence[int]) -> list[int]:
    """Whole sequence on the least-loaded rank of the bin (ties: first rank)."""
    share = [0] * len(loads)
    share[min(range(len(loads)), key=lambda i: (loads[i], i))] = length
    return share


def zigzag_or_one_rank(length: int, loads: Sequence[int]) -> Sequence[int]:
    """Zigzag shares over the whole bin (a CP ring); a sequence too short for ``2k``
    chunks stays on one rank, because a Plan cannot express the padding TE and
    Megatron add to reach ``2k`` tokens."""
    k = len(loads)
    if k == 1 or length < 2 * k:
        return one_rank(length, loads)
    return _zigzag_tokens(length, k)


def contiguous_or_one_rank(length: int, loads: Sequence[int]) -> Sequence[int]:
    """Contiguous Ulysses shares over the whole bin; a sequence too short for
    ``2k`` tokens stays on one rank (as in :func:`zigzag_or_one_rank`)."""
    k = len(loads)
    if k == 1 or length < 2 * k:
        return one_rank(length, loads)
    return _contiguous_tokens(length, k)


# Cached: a batch repeats lengths, and a sequence's shares are asked of every bin it tries.
@lru_cache(maxsize=1 << 16)
def _zigzag_tokens(length: int, k: int) -> tuple[int, ...]:
    """Tokens per rank of :func:`~megatron_zeppelin.plan.shards.zigzag_shards`:
    rank ``i`` holds chunks ``i`` and ``2k-1-i``."""
    b = chunk_bounds(length, 2 * k)
    return tuple(b[i + 1] - b[i] + b[2 * k - i] - b[2 * k - 1 - i] for i in range(k))


@lru_cache(maxsize=1 << 16)
def _contiguous_tokens(length: int, k: int) -> tuple[int, ...]:
    """Tokens per rank of :func:`~megatron_zeppelin.plan.shards.contiguous_shards`."""
    b = chunk_bounds(length, k)
    return tuple(b[i + 1] - b[i] for i in range(k))


def placements(bins: Bins, seq_lens: Sequence[int], mode: Mode,
               first_rank: Callable[[int], int] = lambda b: b) -> list[SeqPlacement]:
    """Placements of packed bins: bin ``b`` holds ranks ``first_rank(b) + [0, width)``;
    a sequence held by one rank is local there, any other is split in ``mode``."""
    out = []
    for b, items in enumerate(bins.items):
        ranks = tuple(first_rank(b) + i for i in range(bins.width))
        for seq, share in items:
            if len(ranks) > 1 and 0 not in share:     # every rank holds a part (the usual split)
                out.append(placement(seq, seq_lens[seq], mode, ranks))
                continue
            holders = [r for r, s in zip(ranks, share) if s]
            if len(holders) == 1:
                out.append(placement(seq, seq_lens[seq], Mode.LOCAL, holders))
            else:
                out.append(placement(seq, seq_lens[seq], mode, ranks))
    return out


def check_lengths(seq_lens: Sequence[int]) -> tuple[int, ...]:
    """The batch as a tuple of positive ints (a Plan cannot hold empty sequences)."""
    lens = tuple(int(L) for L in seq_lens)
    bad = [i for i, L in enumerate(lens) if L < 1]
    if bad:
        raise InfeasibleError(f"sequence {bad[0]} has length {lens[bad[0]]}; every sequence "
                              "needs at least one token (drop empty documents)")
    return lens
