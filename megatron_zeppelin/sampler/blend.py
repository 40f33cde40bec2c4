"""Blends: several datasets' pieces interleaved by weight, in token-budget batches.

Weights are shares of *tokens* (what a token-budget batch spends), not of
documents.  The interleave is weighted fair queueing on a virtual clock: dataset
``d`` reads its own endless stream of passes (each a permutation of its pieces,
drawn from ``(seed, d, pass)``), and the piece that brings its cumulative token
count to ``C`` finishes at virtual time ``C / w_d``.  Merging every stream by
finish time gives each dataset ``w_d * T`` tokens (within one piece) by virtual
time ``T``: the shares hold at every prefix, not only on average.

A blend epoch is the virtual-time window ``(e V, (e+1) V]`` with
``V = max_d tokens_d / w_d``: the dataset that is scarcest for its weight is read
exactly once per epoch, the others are read in proportion (upsampled past their
pass boundaries).  With a single dataset the window is exactly one pass, so the
blend reduces to :class:`ZeppelinBatchSampler`.  Batching, drop_last and exact
resume are shared with it through :class:`TokenBudgetSampler`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler.batch_sampler import EpochOrder, PieceTable, TokenBudgetSampler, pass_order


def normalize_weights(weights: Sequence[float], num_datasets: int) -> tuple[float, ...]:
    """Positive finite weights, scaled to sum to 1."""
    if len(weights) != num_datasets:
        raise ConfigError(f"a blend of {num_datasets} datasets needs {num_datasets} weights, got {len(weights)}")
    values = [float(w) for w in weights]
    if not all(math.isfinite(w) and w > 0 for w in values):
        raise ConfigError(f"blend weights must be positive numbers, got {list(weights)}")
    total = sum(values)
    return tuple(w / total for w in values)


def _window(table: PieceTable, dataset: int, weight: float, seed: int, shuffle: bool,
            lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of ``dataset`` finishing in virtual time ``(lo, hi]``: (finish times, piece rows).

    Finish times are computed by one formula, ``(p * tokens + cum) / weight``, whatever
    the window, so a piece on a window edge falls in exactly one epoch.
    """
    total = int(table.lengths.sum())
    times, rows = [], []
    p = max(0, math.floor(lo * weight / total) - 1)
    # Pass p's finish times lie in [(p*total + 1)/w, (p*total + total)/w]: skip the
    # passes wholly before the window, stop at the first wholly after it.
    while (p * total + 1) / weight <= hi:
        if (p * total + total) / weight > lo:
            order = pass_order(table, seed, dataset, p, shuffle)
            finish = (p * total + np.cumsum(table.lengths[order])) / weight
            keep = (finish > lo) & (finish <= hi)
            times.append(finish[keep])
            rows.append(order[keep])
        p += 1
    return np.concatenate(times), np.concatenate(rows)


class BlendedSampler(TokenBudgetSampler):
    """Token-budget global batches over several datasets mixed by token weight.

    ``BlendedSampler([code_lengths, web_lengths], [0.3, 0.7], max_seq_len=..., tokens_per_batch=...)``;
    each :class:`~megatron_zeppelin.sampler.batch_sampler.Piece` carries its ``dataset``.
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], *, max_seq_len: int,
                 tokens_per_batch: int, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 num_batches: int | None = None) -> None:
        if len(datasets) == 0:
            raise ConfigError("a blend needs at least one dataset")
        self.weights = normalize_weights(weights, len(datasets))
        super().__init__(datasets, max_seq_len=max_seq_len, tokens_per_batch=tokens_per_batch, seed=seed,
                         shuffle=shuffle, drop_last=drop_last, num_batches=num_batches)
        self.epoch_span = max(int(t.lengths.sum()) / w for t, w in zip(self.tables, self.weights))
        """Virtual time covered by one blend epoch (V in the module docstring)."""

    def epoch_order(self, epoch: int) -> EpochOrder:
        lo, hi = epoch * self.epoch_span, (epoch + 1) * self.epoch_span
        times, datasets, docs, starts, ends = [], [], [], [], []
        for d, (table, weight) in enumerate(zip(self.tables, self.weights)):
            t, rows = _window(table, d, weight, self.seed, self.shuffle, lo, hi)
            times.append(t)
            datasets.append(np.full(rows.size, d, dtype=np.int64))
            docs.append(table.doc[rows])
            starts.append(table.start[rows])
            ends.append(table.end[rows])
        dataset = np.concatenate(datasets)
        # By finish time; ties go to the lower dataset index (lexsort's last key is primary).
        merged = np.lexsort((dataset, np.concatenate(times)))
        return EpochOrder(dataset[merged], np.concatenate(docs)[merged], np.concatenate(starts)[merged],
                          np.concatenate(ends)[merged])

    def _fingerprint(self) -> dict[str, Any]:
        return {**super()._fingerprint(), "weights": list(self.weights)}
