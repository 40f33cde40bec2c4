"""Pieces of very long documents, drawn without a table of them.

A dataset cut into more than ``LAZY_PIECES`` (2**24) pieces (one 10**12-token book
at ``max_seq_len`` 256 is 3.9e9 of them) is never listed piece by piece: the
table keeps each document's length and first piece number (memory grows with
the documents, not with their length), an epoch's order is a keyed Feistel
permutation of the piece numbers evaluated on demand, and a batch is found by
walking that order from its first piece.  So the sampler's memory grows with
the batches it serves, and drawing one costs the pieces in it.

The order is a different (equally uniform, equally deterministic) shuffle than
the table path's ``numpy`` permutation, so it is used only where that path
could not run at all; every smaller dataset keeps its batches.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_zeppelin.sampler.batch_sampler import Piece

#: Pieces evaluated at once while walking an order.
_CHUNK = 4096
_ROUNDS = 4


class FeistelPermutation:
    """A keyed bijection of ``[0, n)``: a balanced Feistel network on the
    smallest even bit width holding ``n``, cycle-walked back into range
    (fewer than 4 steps expected: the width holds at most 4n values)."""

    def __init__(self, n: int, key: Sequence[int]) -> None:
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n = n
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = np.random.default_rng(list(key)).integers(0, 2**63, size=_ROUNDS, dtype=np.uint64)

    def __call__(self, index: np.ndarray) -> np.ndarray:
        out = self._encrypt(np.asarray(index, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 arithmetic wraps, as it should here)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class LongPieceTable:
    """One dataset's documents, cut into ``max_seq_len`` pieces on demand."""

    doc_lengths: np.ndarray
    """int64 [docs]: each document's length."""
    first_piece: np.ndarray
    """int64 [docs + 1]: number of the first piece of each document (and the total)."""
    max_seq_len: int
    fingerprint: int
    """CRC32 of the document lengths (as the table path's)."""

    @classmethod
    def from_lengths(cls, lengths: np.ndarray, max_seq_len: int) -> "LongPieceTable":
        counts = -(-lengths // max_seq_len)
        return cls(lengths, np.concatenate([[0], np.cumsum(counts)]), max_seq_len, zlib.crc32(lengths.tobytes()))

    @property
    def num_pieces(self) -> int:
        return int(self.first_piece[-1])

    @property
    def lengths(self) -> np.ndarray:
        """Document lengths (their sum is the pieces' token count, as for the table path)."""
        return self.doc_lengths

    def bounds(self, piece: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Document, start and end of each piece number in ``piece``."""
        doc = np.searchsorted(self.first_piece, piece, side="right") - 1
        start = (piece - self.first_piece[doc]) * self.max_seq_len
        return doc, start, np.minimum(start + self.max_seq_len, self.doc_lengths[doc])


class LongEpochOrder:
    """One epoch of a :class:`LongPieceTable` in sampling order: the interface of
    :class:`~megatron_zeppelin.sampler.batch_sampler.EpochOrder`, evaluated on demand."""

    def __init__(self, table: LongPieceTable, order: FeistelPermutation | None) -> None:
        """``order``: the epoch's shuffle; None: document order."""
        self.table = table
        self.order = order

    @property
    def num_pieces(self) -> int:
        return self.table.num_pieces

    def _bounds(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        positions = np.arange(begin, end, dtype=np.int64)
        return self.table.bounds(positions if self.order is None else self.order(positions))

    def batch_end(self, begin: int, budget: int) -> int:
        """End of the greedy batch starting at position ``begin``: add pieces while they fit."""
        end, total = begin, 0
        chunk = 2 * -(-budget // self.table.max_seq_len) + 1   # a batch of full pieces, twice over
        while end < self.num_pieces:
            stop = min(end + chunk, self.num_pieces)
            _, start, finish = self._bounds(end, stop)
            cum = total + np.cumsum(finish - start)
            fits = int(np.searchsorted(cum, budget, side="right"))
            if fits < stop - end:
                return end + fits
            total, end, chunk = int(cum[-1]), stop, min(4 * chunk, _CHUNK)   # short pieces: look further
        return end

    def tokens(self, begin: int, end: int) -> int:
        _, start, finish = self._bounds(begin, end)
        return int((finish - start).sum())

    def pieces(self, begin: int, end: int) -> tuple[Piece, ...]:
        doc, start, finish = self._bounds(begin, end)
        return tuple(Piece(d, s, e) for d, s, e in zip(doc.tolist(), start.tolist(), finish.tolist()))
