"""A Plan's two layouts as flat integer columns, and the sequences that read them.

A batch at 1,024 GPUs holds ~16k placements and as many linear spans.  As
objects they are ~35k that the cyclic collector walks in every full pass for
as long as the Plan lives: 55 of the 75 ms of CPU that receiving one cost the
training thread (``docs/results/planning_interference.md``).  A training rank
reads its own placements and spans, the rings and Ulysses groups, and nothing
else of the batch.

So a Plan received from a planning child (``plan/compact.py``) keeps its
layouts as the arrays that came (numpy arrays: nothing for the collector) in
:class:`Placements` and :class:`RankSpans`, sequences like the tuples a planner
builds: an item is made when a reader asks for it (and kept, so it is the
same object next time; iteration makes the others without keeping them).  The
Plan's per-rank queries (``Plan.placements_of``, ``Plan.remap_moves``) read
the columns, of either kind of sequence (a planner's tuples are turned into
columns once, on the first such query).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from megatron_zeppelin.plan.placement import MODES, SeqPlacement, Span, canonical_shards


@dataclass(frozen=True, eq=False)
class PlacementColumns:
    """Every placement of a Plan's attention layout, in plan order, as columns."""

    seq: np.ndarray
    """``[n]`` int64: ``attention[i].seq``."""
    mode: np.ndarray
    """``[n]`` int8: ``attention[i].mode`` as its index in ``MODES`` (0 local, 1 ring, 2 ulysses)."""
    starts: np.ndarray
    """``[n + 1]`` int64: placement ``i``'s ranks are ``ranks[starts[i]:starts[i + 1]]``."""
    ranks: np.ndarray
    """int64: every placement's ranks, in order, back to back."""

    @classmethod
    def of(cls, attention: Sequence[SeqPlacement]) -> "PlacementColumns":
        sizes = [len(p.ranks) for p in attention]
        return cls(seq=np.array([p.seq for p in attention], dtype=np.int64),
                   mode=np.array([MODES.index(p.mode) for p in attention], dtype=np.int8),
                   starts=np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))),
                   ranks=np.array([r for p in attention for r in p.ranks], dtype=np.int64))

    def of_rank(self, rank: int) -> list[tuple[int, int]]:
        """``(index, position of rank in its ranks)`` of every placement ``rank``
        takes part in, in plan order."""
        at = np.flatnonzero(self.ranks == rank)
        index = np.searchsorted(self.starts, at, side="right") - 1
        return list(zip(index.tolist(), (at - self.starts[index]).tolist()))

    def index_of_seq(self) -> np.ndarray:
        """``[sequences]``: the placement index of every sequence."""
        index = np.zeros(len(self.seq), dtype=np.int64)
        index[self.seq] = np.arange(len(self.seq))
        return index

    def equals(self, other: "PlacementColumns") -> bool:
        return all(np.array_equal(a, b) for a, b in ((self.seq, other.seq), (self.mode, other.mode),
                                                    (self.starts, other.starts), (self.ranks, other.ranks)))


@dataclass(frozen=True, eq=False)
class SpanColumns:
    """Every rank's linear spans, ranks in order, as columns."""

    counts: np.ndarray
    """``[world]`` int64: ``len(linear[r])``."""
    spans: np.ndarray
    """``[n, 3]`` int64: every rank's spans (seq, start, end), ranks in order."""

    @classmethod
    def of(cls, linear: Sequence[Sequence[Span]]) -> "SpanColumns":
        return cls(counts=np.array([len(spans) for spans in linear], dtype=np.int64),
                   spans=np.array([(sp.seq, sp.start, sp.end) for spans in linear for sp in spans],
                                  dtype=np.int64).reshape(-1, 3))

    def owner(self) -> np.ndarray:
        """``[n]``: the rank holding each span."""
        return np.repeat(np.arange(len(self.counts), dtype=np.int64), self.counts)

    def equals(self, other: "SpanColumns") -> bool:
        return np.array_equal(self.counts, other.counts) and np.array_equal(self.spans, other.spans)


class _Lazy(Sequence):
    """A tuple-like sequence whose items are made from columns on demand: the one
    asked by index is kept (a reader gets the same object again); iteration
    makes the others and keeps none; a slice is a tuple, as a tuple's is.
    Equal to, and hashing as, the tuple of its items; pickles as its columns."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[int, object] = {}

    @abstractmethod
    def _make(self, i: int):
        """Item ``i``, made from the columns."""

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} items")
        i %= n
        item = self._kept.get(i)
        if item is None:
            item = self._kept[i] = self._make(i)
        return item

    def __iter__(self) -> Iterator:
        kept = self._kept
        for i in range(len(self)):
            item = kept.get(i)
            yield item if item is not None else self._make(i)

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, type(self)) and self._same_columns(other):
            return True
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} items)"

    @abstractmethod
    def _same_columns(self, other) -> bool:
        """Whether ``other`` (of this type) holds the same columns."""


class Placements(_Lazy):
    """``Plan.attention`` as columns: placement ``i`` is made (canonical shards
    from the shard cache) when read.  Only for a validated Plan's placements:
    their shards are the canonical ones, which the columns do not hold."""

    __slots__ = ("columns", "seq_lens")

    def __init__(self, columns: PlacementColumns, seq_lens: Sequence[int]) -> None:
        super().__init__()
        self.columns, self.seq_lens = columns, seq_lens

    def __len__(self) -> int:
        return len(self.columns.seq)

    def _make(self, i: int) -> SeqPlacement:
        c = self.columns
        seq, mode = int(c.seq[i]), MODES[c.mode[i]]
        ranks = tuple(c.ranks[c.starts[i]:c.starts[i + 1]].tolist())
        return SeqPlacement(seq, mode, ranks, canonical_shards(mode, self.seq_lens[seq], len(ranks)))

    def _same_columns(self, other: "Placements") -> bool:
        return self.columns.equals(other.columns) and tuple(self.seq_lens) == tuple(other.seq_lens)

    def __reduce__(self):
        return Placements, (self.columns, self.seq_lens)


class RankSpans(_Lazy):
    """``Plan.linear`` as columns: rank ``r``'s tuple of spans is made when read."""

    __slots__ = ("columns", "_bounds")

    def __init__(self, columns: SpanColumns) -> None:
        super().__init__()
        self.columns = columns
        self._bounds = np.concatenate(([0], np.cumsum(columns.counts))).tolist()

    def __len__(self) -> int:
        return len(self.columns.counts)

    def _make(self, rank: int) -> tuple[Span, ...]:
        rows = self.columns.spans[self._bounds[rank]:self._bounds[rank + 1]].tolist()
        return tuple(Span(q, s, e) for q, s, e in rows)

    def _same_columns(self, other: "RankSpans") -> bool:
        return self.columns.equals(other.columns)

    def __reduce__(self):
        return RankSpans, (self.columns,)
