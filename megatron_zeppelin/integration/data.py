"""The Zeppelin data path for Megatron-LM: whole documents of indexed datasets.

Megatron's ``GPTDataset`` concatenates documents into fixed-length samples;
Zeppelin instead samples *whole documents* (cut into ``--seq-length`` pieces) into
token-budget global batches.  This module turns Megatron's ``--data-path`` /
``--split`` into one :class:`DocumentBlend` per split (datasets, document ranges,
weights) and the sampler over it.  No torch, no Megatron import beyond the
indexed-dataset reader, so it is testable on any machine.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_zeppelin.data.indexed import IndexedDocuments
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler import (
    BlendedSampler,
    Piece,
    TokenBudgetSampler,
    ZeppelinBatchSampler,
    load_lengths,
)

SPLITS = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: ``P1 P2 ...`` or ``W1 P1 W2 P2 ...`` -> (prefixes, weights)."""
    items = list(data_path)
    if not items:
        raise ConfigError("--data-path is empty; pass PREFIX or WEIGHT PREFIX [WEIGHT PREFIX ...]")
    try:
        float(items[0])
    except ValueError:
        return items, None
    if len(items) % 2:
        raise ConfigError(f"--data-path {' '.join(items)}: weights and prefixes must alternate "
                          "(WEIGHT PREFIX WEIGHT PREFIX ...)")
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError as exc:
        raise ConfigError(f"--data-path: {exc}; weights and prefixes must alternate") from None
    return items[1::2], weights


def split_bounds(split: str, num_docs: int) -> list[tuple[int, int]]:
    """Document ranges ``[begin, end)`` of train/valid/test for Megatron's ``--split 99,1,0``."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split {split!r}: expected comma-separated numbers like 99,1,0") from None
    parts = (parts + [0.0, 0.0, 0.0])[:3]
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"--split {split!r}: shares must be >= 0 and not all 0")
    cum = np.cumsum([0.0] + parts) / sum(parts)
    edges = [int(round(c * num_docs)) for c in cum]
    return [(edges[i], edges[i + 1]) for i in range(3)]


@dataclass(frozen=True)
class DocumentBlend:
    """One split's documents: per dataset a contiguous document range, plus weights."""

    documents: tuple[IndexedDocuments, ...]
    """Opened indexed datasets, in ``--data-path`` order."""
    ranges: tuple[tuple[int, int], ...]
    """``ranges[d]``: documents ``[begin, end)`` of dataset ``d`` in this split."""
    lengths: tuple[np.ndarray, ...]
    """``lengths[d]``: token counts of those documents (the sampler's input)."""
    weights: tuple[float, ...] | None
    """Token shares of the datasets (None: a single dataset)."""

    @functools.cached_property
    def offsets(self) -> list[int]:
        """Blend document id of each dataset's first document (ids run through the datasets)."""
        return np.concatenate([[0], np.cumsum([x.size for x in self.lengths])]).tolist()

    def blend_pieces(self, pieces: Sequence[Piece]) -> list[Piece]:
        """Sampler pieces renumbered to blend document ids, for :meth:`tokens`."""
        offsets = self.offsets
        return [dataclasses.replace(p, doc=offsets[p.dataset] + p.doc, dataset=0) for p in pieces]

    def tokens(self, doc: int, start: int, end: int) -> np.ndarray:
        """Token ids ``[start, end)`` of blend document ``doc`` (a ``TokenSource``)."""
        offsets = self.offsets
        d = bisect.bisect_right(offsets, doc) - 1
        return self.documents[d].tokens(self.ranges[d][0] + doc - offsets[d], start, end)

    def sampler(self, *, max_seq_len: int, tokens_per_batch: int, seed: int) -> TokenBudgetSampler:
        """Token-budget sampler over this split (drop_last off: every document is seen)."""
        if self.weights is None:
            return ZeppelinBatchSampler(self.lengths[0], max_seq_len=max_seq_len,
                                        tokens_per_batch=tokens_per_batch, seed=seed)
        return BlendedSampler(list(self.lengths), list(self.weights), max_seq_len=max_seq_len,
                              tokens_per_batch=tokens_per_batch, seed=seed)


def open_blends(data_path: Sequence[str], split: str,
                lengths_file: str | None = None) -> dict[str, DocumentBlend | None]:
    """Train/valid/test blends of ``--data-path``; None for an empty split.

    Without weights the datasets are mixed by their token counts (what Megatron's
    unweighted concatenation amounts to).  ``lengths_file`` (one length per
    document, datasets concatenated) must equal the lengths in the ``.idx`` files:
    it pins the run to the data a simulation (``python -m megatron_zeppelin.sim
    --lengths FILE``) was made with.
    """
    prefixes, weights = parse_data_path(data_path)
    documents = tuple(IndexedDocuments(p) for p in prefixes)
    all_lengths = [d.lengths for d in documents]
    if lengths_file is not None:
        check_lengths_file(load_lengths(lengths_file), all_lengths, lengths_file)
    blends: dict[str, DocumentBlend | None] = {}
    for i, name in enumerate(SPLITS):
        ranges = tuple(split_bounds(split, len(d))[i] for d in documents)
        keep = [k for k, (b, e) in enumerate(ranges) if e > b]
        if not keep:
            blends[name] = None
            continue
        if len(keep) == 1 and len(documents) == 1:
            w = None
        else:
            base = weights or [float(all_lengths[k].sum()) for k in range(len(documents))]
            w = tuple(base[k] for k in keep)
        blends[name] = DocumentBlend(
            documents=tuple(documents[k] for k in keep), ranges=tuple(ranges[k] for k in keep),
            lengths=tuple(all_lengths[k][ranges[k][0]:ranges[k][1]] for k in keep), weights=w)
    return blends


def check_lengths_file(lengths: np.ndarray, per_dataset: list[np.ndarray], path: str) -> None:
    """Raise ConfigError unless ``lengths`` equals the datasets' lengths concatenated."""
    actual = np.concatenate(per_dataset)
    if lengths.size != actual.size:
        raise ConfigError(f"--zeppelin-data-lengths {path} lists {lengths.size} documents, but --data-path "
                          f"holds {actual.size}; regenerate it with python -m megatron_zeppelin.data.lengths")
    bad = np.flatnonzero(lengths != actual)
    if bad.size:
        raise ConfigError(f"--zeppelin-data-lengths {path}: document {bad[0]} has length {lengths[bad[0]]} "
                          f"there but {actual[bad[0]]} in --data-path ({bad.size} differ); the file "
                          "belongs to other data: regenerate it or drop the flag")
