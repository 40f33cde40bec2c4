"""Greedy packing shared by the baseline planners.

Sequences are placed longest first (ties: lower index first), each onto the
least-loaded bin (ties: lower bin) whose ranks all stay under the per-rank token
cap -- the LPT rule that DP packing and TE CP replicas use to balance work.  A
bin is a group of ``width`` ranks that shares every sequence placed on it; how a
sequence's tokens spread over those ranks is the caller's :class:`Shares` (one
rank for DP packing, zigzag chunks for a CP group).  The placement loop is
compiled (:func:`~megatron_zeppelin.planner.packing_fit.place_in_order`).
"""

from __future__ import annotations

from functools import lru_cache
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode, SeqPlacement, placement
from megatron_zeppelin.plan.shards import contiguous_shard_tokens, zigzag_shard_tokens
from megatron_zeppelin.planner.packing_fit import place_in_order
from megatron_zeppelin.planner.plan_arrays import MODE_CODE, Placements


@dataclass(frozen=True)
class Shares:
    """How a sequence's tokens spread over the ``k`` ranks of a bin: the whole
    sequence on the bin's least-loaded rank (ties: first rank) where ``k`` is
    1, the sequence has fewer than ``2k`` tokens (a Plan cannot express the
    padding TE and Megatron add to reach ``2k``) or there is no ``split``;
    else ``split`` tokens per rank over the whole bin."""

    split: Callable[[np.ndarray, int], np.ndarray] | None
    """``split(lengths, k)``: tokens per rank (a row per length) of sequences split over a whole bin."""

    def rows(self, lengths: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Per sequence of ``lengths``: whether it goes on one rank, and its
        tokens per rank where it does not."""
        if self.split is None or k == 1:
            return np.ones(len(lengths), dtype=np.bool_), np.zeros((len(lengths), k), dtype=np.int64)
        return lengths < 2 * k, self.split(lengths, k)

    def __call__(self, length: int, loads: Sequence[int]) -> Sequence[int]:
        """Tokens per rank of the sequence on a bin whose ranks hold ``loads``."""
        k = len(loads)
        if self.split is not None and k > 1 and length >= 2 * k:
            return _split_one(self.split, length, k)
        share = [0] * k
        share[min(range(k), key=lambda i: (loads[i], i))] = length
        return share


# Cached: a batch repeats lengths, and a sequence's shares are asked of every bin it tries.
@lru_cache(maxsize=1 << 16)
def _split_one(split: Callable[[np.ndarray, int], np.ndarray], length: int, k: int) -> tuple[int, ...]:
    return tuple(split(np.array([length], dtype=np.int64), k)[0].tolist())


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

    def __post_init__(self) -> None:
        self.loads = [[0] * self.width for _ in range(self.num_bins)]
        self.items = [[] for _ in range(self.num_bins)]


def _longest_first(seq_lens: Sequence[int]) -> np.ndarray:
    """Sequence indices, longest first (ties: lower index)."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable")


def _fit(bins: Bins, seqs: np.ndarray, seq_lens: Sequence[int], shares: Shares,
         stop_at_miss: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Place ``seqs`` in order, each on the bin with the fewest tokens (ties: lower
    bin) where it fits, updating ``bins.loads``.  Returns every sequence's bin
    (-1: none), its tokens per rank of the bin, and how many were tried
    (:func:`~megatron_zeppelin.planner.packing_fit.place_in_order`)."""
    lens = np.asarray(seq_lens, dtype=np.int64)[seqs]
    distinct, row = np.unique(lens, return_inverse=True)     # batches repeat lengths
    one_rank, split = shares.rows(distinct, bins.width)
    loads = np.array(bins.loads, dtype=np.int64).reshape(bins.num_bins, bins.width)
    bin_of, tokens, tried = place_in_order(lens, one_rank[row], split[row], loads, bins.cap, stop_at_miss)
    bins.loads = loads.tolist()
    return bin_of, tokens, tried


def _place(bins: Bins, seqs: np.ndarray, seq_lens: Sequence[int], shares: Shares,
           stop_at_miss: bool) -> tuple[np.ndarray, int]:
    """:func:`_fit`, each placed sequence listed in its bin's ``items``."""
    bin_of, tokens, tried = _fit(bins, seqs, seq_lens, shares, stop_at_miss)
    for seq, b, share in zip(seqs[:tried].tolist(), bin_of[:tried].tolist(), tokens[:tried].tolist()):
        if b >= 0:
            bins.items[b].append((seq, tuple(share)))
    return bin_of, tried


def fit_in_one_pass(seq_lens: Sequence[int], bins: Bins, shares: Shares, mode: Mode) -> Placements | None:
    """The placements of :func:`pack_longest_first` on bins of consecutive ranks
    (bin ``b`` on ranks ``b * width + [0, width)``, as :func:`placements` lays
    them out), as columns, or None when a sequence fits no bin: what a
    candidate of the per-batch decision needs, without a Python object per
    sequence."""
    order = _longest_first(seq_lens)
    bin_of, tokens, tried = _fit(bins, order, seq_lens, shares, stop_at_miss=True)
    if tried and bin_of[tried - 1] < 0:
        return None
    # Bin by bin, each bin's sequences in placement order.
    by_bin = np.argsort(bin_of, kind="stable")
    held = tokens[by_bin] > 0
    local = held.sum(axis=1) == 1           # one rank holds it all: local there
    first = bin_of[by_bin] * bins.width + np.where(local, held.argmax(axis=1), 0)
    return Placements.of_blocks(order[by_bin], np.where(local, 0, MODE_CODE[mode]), first,
                                np.where(local, 1, bins.width))


def pack_longest_first(seq_lens: Sequence[int], bins: Bins, shares: Shares, *, strategy: str,
                       what: str) -> Bins:
    """Place every sequence on the bin with the fewest tokens where it fits.

    Raises :class:`InfeasibleError` naming the first sequence that fits nowhere."""
    order = _longest_first(seq_lens)
    bin_of, tried = _place(bins, order, seq_lens, shares, stop_at_miss=True)
    if tried and bin_of[tried - 1] < 0:
        seq = int(order[tried - 1])
        free = max((bins.cap - max(ld) for ld in bins.loads), default=0)
        raise InfeasibleError(
            f"{strategy}: sequence {seq} (length {seq_lens[seq]}) does not fit on any {what}: the emptiest "
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
    remaining = _longest_first(seq_lens)
    rounds = []
    while len(remaining):
        bins = make_bins()
        bin_of, _ = _place(bins, remaining, seq_lens, shares, stop_at_miss=False)
        if (bin_of < 0).all():
            seq = int(remaining[0])
            raise InfeasibleError(
                f"{strategy}: sequence {seq} (length {seq_lens[seq]}) does not fit on an empty {what} "
                f"under the cap of {bins.cap} tokens per GPU; raise --tokens-per-gpu or use a "
                "larger group")
        rounds.append(bins)
        remaining = remaining[bin_of < 0]     # still longest first
    return rounds


#: The whole sequence on the bin's least-loaded rank (ties: first rank).
one_rank = Shares(None)
#: Zigzag shares over the whole bin (a CP ring), else one rank.
zigzag_or_one_rank = Shares(zigzag_shard_tokens)
#: Contiguous Ulysses shares over the whole bin, else one rank.
contiguous_or_one_rank = Shares(contiguous_shard_tokens)


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
    lens = tuple(map(int, seq_lens))
    if lens and min(lens) < 1:     # (builtins, not a generator: every baseline checks the batch)
        bad = next(i for i, L in enumerate(lens) if L < 1)
        raise InfeasibleError(f"sequence {bad} has length {lens[bad]}; every sequence "
                              "needs at least one token (drop empty documents)")
    return lens
