"""Split one global batch into micro-batches for gradient accumulation.

A global batch (a token budget) larger than the cluster holds at once runs as
``count`` micro-batches, each planned on its own under the per-GPU token cap;
gradients add up across them.  The step time is the sum of the micro-batches'
times, and each micro-batch's time is set by how well its planner can balance it:
a micro-batch of long sequences only must put them on rings (communication), one
of short sequences only has nothing to fill around a long one.

FlexSP's *sequence blaster* (ASPLOS'25, Sec. 5) sorts the batch by length and cuts
the sorted list into contiguous micro-batches, so each micro-batch holds similar
lengths.  Here every micro-batch gets the same modeled work instead -- the
Zeppelin cost model's attention (quadratic) plus linear (per token) seconds of
its sequences -- which spreads the long sequences over the micro-batches, gives
each one its share of short fillers and keeps each under the token cap with the
planner's slack (``benchmarks/micro_batch_split.py``: modeled step time within 2.1%
of the blaster's, and no over-full micro-batch where contiguous cuts leave some):

1. longest-processing-time first: sequences by decreasing work onto the
   micro-batch with the least work that still has token room;
2. local search: move one sequence, or swap two, between the busiest
   micro-batch and another while that lowers the busiest one's work.

Pure Python + numpy and deterministic (ties go to the lowest index), so every
rank computes the same split.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.sampler import GlobalBatch, batch_budget

#: Local-search rounds per micro-batch (each round improves the busiest one or stops).
SEARCH_ROUNDS_PER_MICRO_BATCH = 8

Split = Callable[[Sequence[int]], list[list[int]]]
"""Sequence lengths of a global batch -> sequence indices of each micro-batch."""


def micro_batch_split(count: int, *, tokens_per_gpu: int, data_parallel_size: int, max_seq_len: int,
                      batch_fill: float, cost: CostModel) -> Split:
    """The split of a run with ``count`` micro-batches per global batch: the whole
    batch for one, else equal modeled work under the token room of one Plan (the
    budget with the sampler's ``batch_fill`` slack first, the ranks' full capacity
    when the slack leaves no split)."""
    if count == 1:
        return lambda seq_lens: [list(range(len(seq_lens)))]
    caps = (batch_budget(tokens_per_gpu, data_parallel_size, max_seq_len, batch_fill),
            tokens_per_gpu * data_parallel_size)
    return lambda seq_lens: split_micro_batches(seq_lens, count, caps, cost)


def micro_batches_of(batch: GlobalBatch, split: Split) -> list[GlobalBatch]:
    """``batch``'s micro-batches: same index and epoch, each a subset of its pieces
    (in sampling order)."""
    return [GlobalBatch(batch.index, batch.epoch, tuple(batch.pieces[i] for i in seqs))
            for seqs in split(batch.seq_lens)]


def sequence_work_s(cost: CostModel, seq_lens: Sequence[int]) -> np.ndarray:
    """Modeled seconds of each sequence's attention and linear work (fwd + bwd, all layers)."""
    return np.array([cost.local_attn_s(L) + cost.linear_s(L) for L in seq_lens], dtype=np.float64)


def split_micro_batches(seq_lens: Sequence[int], count: int, token_caps: Sequence[int],
                        cost: CostModel) -> list[list[int]]:
    """``count`` non-empty lists of sequence indices (each ascending) covering
    ``seq_lens`` once, each holding at most a token cap's tokens.

    ``token_caps`` are tried in order (a planner-friendly cap with slack first,
    the hard capacity of one Plan last); the first cap under which every
    sequence fits wins.  Raises :class:`InfeasibleError` when there are fewer
    sequences than micro-batches or no cap admits a split.
    """
    n = len(seq_lens)
    if count < 1:
        raise InfeasibleError(f"micro-batch count must be >= 1, got {count}")
    if n < count:
        raise InfeasibleError(f"{count} micro-batches would leave {count - n} empty: the global batch "
                              f"holds only {n} sequences ({sum(seq_lens)} tokens); use fewer micro-batches "
                              "(--micro-batches; --global-batch-size / DP under --zeppelin)")
    lens = np.asarray(seq_lens, dtype=np.int64)
    work = sequence_work_s(cost, seq_lens)
    for cap in token_caps:
        owner = _longest_first(lens, work, count, cap)
        if owner is not None:
            _improve(lens, work, owner, count, cap)
            return [np.flatnonzero(owner == m).tolist() for m in range(count)]
    raise InfeasibleError(f"the global batch's {n} sequences ({int(lens.sum())} tokens, longest "
                          f"{int(lens.max())}) do not fit {count} micro-batches of at most {max(token_caps)} "
                          "tokens each; raise the micro-batch count or the tokens per GPU, or lower the batch fill")


def _longest_first(lens: np.ndarray, work: np.ndarray, count: int, cap: int) -> np.ndarray | None:
    """Owner micro-batch of each sequence, or None when one does not fit anywhere."""
    owner = np.full(lens.size, -1, dtype=np.int64)
    load = np.zeros(count)
    tokens = np.zeros(count, dtype=np.int64)
    # Work ties (equal lengths) keep batch order, so the split is deterministic.
    for seq in sorted(range(lens.size), key=lambda i: (-work[i], i)):
        room = np.flatnonzero(tokens + lens[seq] <= cap)
        if room.size == 0:
            return None
        m = int(room[np.argmin(load[room])])  # argmin: lowest index on ties
        owner[seq] = m
        load[m] += work[seq]
        tokens[m] += lens[seq]
    # The first `count` sequences each opened an empty micro-batch (work > 0).
    return owner


def _improve(lens: np.ndarray, work: np.ndarray, owner: np.ndarray, count: int, cap: int) -> None:
    """Moves and swaps out of the busiest micro-batch while they lower its work (in place)."""
    for _ in range(SEARCH_ROUNDS_PER_MICRO_BATCH * count):
        load = np.bincount(owner, weights=work, minlength=count)
        tokens = np.bincount(owner, weights=lens, minlength=count).astype(np.int64)
        busiest = int(np.argmax(load))
        best = _best_exchange(lens, work, owner, load, tokens, busiest, count, cap)
        if best is None:
            return
        seq_out, target, seq_in = best
        owner[seq_out] = target
        if seq_in >= 0:
            owner[seq_in] = busiest


def _best_exchange(lens: np.ndarray, work: np.ndarray, owner: np.ndarray, load: np.ndarray,
                   tokens: np.ndarray, busiest: int, count: int, cap: int) -> tuple[int, int, int] | None:
    """``(sequence leaving the busiest, its new micro-batch, sequence coming back or -1)``
    that lowers ``max(load of the two)`` the most, or None.  A move never empties
    the busiest micro-batch."""
    out = np.flatnonzero(owner == busiest)
    top = load[busiest]
    best, best_peak = None, top * (1 - 1e-12)  # strictly better, robust to rounding
    for target in range(count):
        if target == busiest:
            continue
        # Moves: a sequence of the busiest goes to `target`.
        if out.size > 1:
            fits = tokens[target] + lens[out] <= cap
            peak = np.maximum(top - work[out], load[target] + work[out])
            peak[~fits] = np.inf
            i = int(np.argmin(peak))
            if peak[i] < best_peak:
                best, best_peak = (int(out[i]), target, -1), float(peak[i])
        # Swaps: [a, b] exchanges out[a] with back[b].
        back = np.flatnonzero(owner == target)
        delta = work[out][:, None] - work[back][None, :]
        dtok = lens[out][:, None] - lens[back][None, :]
        fits = (tokens[busiest] - dtok <= cap) & (tokens[target] + dtok <= cap)
        peak = np.maximum(top - delta, load[target] + delta)
        peak[~fits | (delta <= 0)] = np.inf
        a, b = np.unravel_index(int(np.argmin(peak)), peak.shape)
        if peak[a, b] < best_peak:
            best, best_peak = (int(out[a]), target, int(back[b])), float(peak[a, b])
    return best
