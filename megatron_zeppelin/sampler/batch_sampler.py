"""Token-budget global batches over variable-length documents.

A global batch is not a fixed number of samples but a fixed *token budget*
(tokens per GPU x world size), so a batch of one 128K-token book and a batch of
four hundred 300-token web pages cost the same memory.  Documents longer than
``max_seq_len`` are cut into pieces of at most ``max_seq_len`` tokens; pieces are
the sampling units, every token of every document belongs to exactly one piece.

Each epoch visits every piece once, in a permutation drawn from
``(seed, dataset, epoch)``; batches are filled greedily in that order, and a piece
that does not fit closes the batch and opens the next one (no piece is ever cut
to fit, none is skipped).  The order is a pure function of the seed and the
epoch, so every rank computes the same batches without talking to the others,
and the state -- (epoch, pieces consumed in the epoch, batches yielded) -- is
enough to resume exactly where an interrupted run stopped.  A dataset of more
than :data:`LAZY_PIECES` pieces is never tabulated (``long_documents.py``).
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.resources import check_memory


#: Bytes the sampler holds per piece at its peak (the table, an epoch's order and
#: their temporaries; 80 measured with tracemalloc on 10**7 pieces, rounded up).
BYTES_PER_PIECE = 96
#: Datasets with more pieces than this list none (``sampler/long_documents.py``):
#: the table would take 1.5 GiB per sampler.
LAZY_PIECES = 2**24
#: Bytes such a dataset holds per document (its length, first piece, a temporary).
BYTES_PER_DOCUMENT = 24

#: Fraction of the cluster's token capacity (tokens per GPU x GPUs) a global batch
#: fills.  A little slack lets whole-sequence packers (te_cp's THD replicas,
#: packing_dp) place every batch, as their own data loaders would, and leaves
#: the zeppelin planner room for its zigzag chunk granularity; 1.0 fills the
#: memory exactly and often leaves no feasible placement.
DEFAULT_BATCH_FILL = 0.95


def batch_budget(tokens_per_gpu: int, world_size: int, max_seq_len: int,
                 fill: float = DEFAULT_BATCH_FILL) -> int:
    """Global batch token budget: ``fill`` of the cluster's capacity, never below
    one full-length sequence (the sampler must be able to place one)."""
    if not 0 < fill <= 1:
        raise ConfigError(f"--batch-fill must be in (0, 1], got {fill}")
    return max(max_seq_len, int(fill * tokens_per_gpu * world_size))


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of one document: the unit the sampler places in batches."""

    doc: int
    """Index of the document in its dataset (its entry in the lengths array)."""
    start: int
    """First token offset inside the document."""
    end: int
    """One past the last token offset inside the document."""
    dataset: int = 0
    """Index of the dataset in a blend (always 0 for a single dataset)."""

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class GlobalBatch:
    """One optimizer step's worth of pieces, shared by every rank."""

    index: int
    """Global batch number since the start of training (0, 1, 2, ...)."""
    epoch: int
    """Epoch the batch was drawn from."""
    pieces: tuple[Piece, ...]
    """Pieces in sampling order; each becomes one sequence for the planner."""

    @property
    def seq_lens(self) -> list[int]:
        """Sequence lengths in piece order: the planner's input."""
        return [p.end - p.start for p in self.pieces]

    @property
    def num_tokens(self) -> int:
        return sum(p.end - p.start for p in self.pieces)


@dataclass(frozen=True)
class PieceTable:
    """One dataset's documents cut into pieces of at most ``max_seq_len`` tokens."""

    doc: np.ndarray
    """int64 [pieces]: document of each piece (pieces of a document are adjacent)."""
    start: np.ndarray
    """int64 [pieces]: first token offset of each piece in its document."""
    end: np.ndarray
    """int64 [pieces]: one past the last token offset."""
    fingerprint: int
    """CRC32 of the document lengths: tells a checkpoint which data it was made on."""

    @classmethod
    def from_lengths(cls, doc_lengths: Any, max_seq_len: int, name: str = "doc_lengths") -> "PieceTable":
        if max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        lengths = validate_lengths(doc_lengths, name)
        # Vectorised split: document d gives ceil(L_d / max_seq_len) pieces whose
        # starts are multiples of max_seq_len; only the last piece is shorter.
        counts = -(-lengths // max_seq_len)
        doc = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
        first_piece = np.cumsum(counts) - counts
        start = (np.arange(doc.size, dtype=np.int64) - np.repeat(first_piece, counts)) * max_seq_len
        end = np.minimum(start + max_seq_len, lengths[doc])
        return cls(doc, start, end, zlib.crc32(lengths.tobytes()))

    @property
    def num_pieces(self) -> int:
        return int(self.doc.size)

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start


def piece_count(lengths: np.ndarray, max_seq_len: int) -> int:
    """Pieces ``lengths`` cut into at ``max_seq_len`` tokens (Python ints: no overflow)."""
    return int((-(-lengths // max_seq_len)).sum(dtype=object))


def check_piece_memory(lengths: np.ndarray, max_seq_len: int, name: str = "doc_lengths", copies: int = 1,
                       long_documents: bool = True) -> None:
    """The piece tables of ``copies`` samplers over ``lengths`` fit this machine's
    memory, or one line with the numbers (before any table is built).
    ``long_documents``: over :data:`LAZY_PIECES` pieces the sampler keeps only
    the documents (``sampler/long_documents.py``)."""
    pieces = piece_count(lengths, max_seq_len)
    held = (f"{lengths.size} documents" if long_documents and pieces > LAZY_PIECES else f"{pieces} pieces")
    need = lengths.size * BYTES_PER_DOCUMENT if long_documents and pieces > LAZY_PIECES else pieces * BYTES_PER_PIECE
    copies_said = f" in each of {copies} ranks" if copies > 1 else ""
    check_memory(need * copies,
                 f"{name}: {int(lengths.sum(dtype=object))} tokens cut at --max-seq-len {max_seq_len} make "
                 f"{pieces} pieces; the sampler's tables of {held}{copies_said}",
                 "raise --max-seq-len, or use fewer or shorter documents")


def make_piece_table(doc_lengths: Any, max_seq_len: int, name: str, long_documents: bool) -> Any:
    """A :class:`PieceTable`, or over :data:`LAZY_PIECES` pieces (``long_documents``)
    a ``LongPieceTable`` that lists no piece; its size checked first."""
    if max_seq_len <= 0:
        raise ConfigError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    lengths = validate_lengths(doc_lengths, name)
    check_piece_memory(lengths, max_seq_len, name, long_documents=long_documents)
    if long_documents and piece_count(lengths, max_seq_len) > LAZY_PIECES:
        from megatron_zeppelin.sampler.long_documents import LongPieceTable   # it imports Piece from here
        return LongPieceTable.from_lengths(lengths, max_seq_len)
    return PieceTable.from_lengths(lengths, max_seq_len, name)


def validate_lengths(doc_lengths: Any, name: str = "doc_lengths") -> np.ndarray:
    """Document lengths as a 1-D int64 array: non-negative, at least one token in all.

    Zero-length documents are allowed here (they yield no piece) so that an indexed
    dataset with empty documents keeps its document numbering.
    """
    lengths = np.asarray(doc_lengths)
    if lengths.ndim != 1 or lengths.size == 0:
        raise ConfigError(f"{name}: expected a non-empty 1-D array of document lengths, got shape "
                          f"{lengths.shape}")
    if lengths.dtype.kind not in "iu":
        raise ConfigError(f"{name}: document lengths must be integers, got dtype {lengths.dtype}")
    lengths = lengths.astype(np.int64)
    if (lengths < 0).any():
        i = int(np.flatnonzero(lengths < 0)[0])
        raise ConfigError(f"{name}: document {i} has negative length {lengths[i]}")
    if not lengths.any():
        raise ConfigError(f"{name}: every document is empty; nothing to sample")
    return lengths


def pass_order(table: PieceTable, seed: int, dataset: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Piece indices of ``table`` in the order of one pass (epoch) over it."""
    if not shuffle:
        return np.arange(table.num_pieces, dtype=np.int64)
    return np.random.default_rng([seed, dataset, epoch]).permutation(table.num_pieces)


@dataclass(frozen=True)
class EpochOrder:
    """Every piece of one epoch, in sampling order (parallel arrays)."""

    dataset: np.ndarray
    """int64 [n]: dataset of each piece."""
    doc: np.ndarray
    """int64 [n]: document of each piece."""
    start: np.ndarray
    """int64 [n]: first token offset."""
    end: np.ndarray
    """int64 [n]: one past the last token offset."""
    cum: np.ndarray = field(init=False, repr=False)
    """int64 [n + 1]: tokens in pieces ``[0, i)``, so a batch boundary is one searchsorted."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cum", np.concatenate([[0], np.cumsum(self.end - self.start)]))

    @property
    def num_pieces(self) -> int:
        return int(self.doc.size)

    def batch_end(self, begin: int, budget: int) -> int:
        """End of the greedy batch starting at piece ``begin``: add pieces while they fit."""
        return int(np.searchsorted(self.cum, self.cum[begin] + budget, side="right")) - 1

    def tokens(self, begin: int, end: int) -> int:
        return int(self.cum[end] - self.cum[begin])

    def pieces(self, begin: int, end: int) -> tuple[Piece, ...]:
        cols = (a[begin:end].tolist() for a in (self.doc, self.start, self.end, self.dataset))
        return tuple(Piece(*row) for row in zip(*cols))


class TokenBudgetSampler(ABC):
    """Greedy token-budget batching, iteration and exact resume over an epoch order.

    Subclasses say which pieces an epoch holds and in which order
    (:meth:`epoch_order`); everything else -- budget, drop_last, state -- lives here.
    ``datasets`` holds one document-lengths array per dataset.
    """

    long_documents = False
    """The subclass orders a ``LongPieceTable`` (datasets of over :data:`LAZY_PIECES` pieces)."""

    def __init__(self, datasets: Sequence[Any], *, max_seq_len: int, tokens_per_batch: int, seed: int,
                 shuffle: bool, drop_last: bool, num_batches: int | None) -> None:
        for name, value in (("max_seq_len", max_seq_len), ("tokens_per_batch", tokens_per_batch)):
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if tokens_per_batch < max_seq_len:
            raise ConfigError(f"tokens_per_batch ({tokens_per_batch}) is smaller than max_seq_len "
                              f"({max_seq_len}): a full-length piece could never be placed; raise "
                              "tokens per GPU x world size or lower max_seq_len")
        if num_batches is not None and num_batches < 0:
            raise ConfigError(f"num_batches must be >= 0 or None, got {num_batches}")
        self.tables = tuple(make_piece_table(lengths, max_seq_len, f"dataset {i} lengths", self.long_documents)
                            for i, lengths in enumerate(datasets))
        self.max_seq_len = max_seq_len
        self.tokens_per_batch = tokens_per_batch
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_batches = num_batches
        self._epoch = 0
        self._offset = 0  # pieces of the current epoch already yielded
        self._index = 0  # batches yielded since the start of training
        self._cache: tuple[int, EpochOrder] | None = None

    @abstractmethod
    def epoch_order(self, epoch: int) -> EpochOrder:
        """Every piece of ``epoch`` in sampling order (a pure function of the config)."""

    def _order(self, epoch: int) -> EpochOrder:
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self.epoch_order(epoch))
        return self._cache[1]

    @property
    def min_full_batch(self) -> int:
        """Fewest tokens a greedy batch holds unless it is an epoch's last one.

        A batch closes only when the next piece (<= max_seq_len tokens) does not fit,
        so it holds more than ``tokens_per_batch - max_seq_len`` tokens.
        """
        return self.tokens_per_batch - self.max_seq_len + 1

    def _is_dropped(self, order: EpochOrder, begin: int, end: int) -> bool:
        return (self.drop_last and end == order.num_pieces
                and order.tokens(begin, end) < self.min_full_batch)

    def batch_bounds(self, epoch: int) -> list[tuple[int, int]]:
        """``(begin, end)`` piece ranges of every batch of ``epoch`` (from its start)."""
        order = self._order(epoch)
        bounds, begin = [], 0
        while begin < order.num_pieces:
            end = order.batch_end(begin, self.tokens_per_batch)
            if not self._is_dropped(order, begin, end):
                bounds.append((begin, end))
            begin = end
        return bounds

    def __len__(self) -> int:
        """Batches in the current epoch (epochs differ slightly: the order changes the packing)."""
        return len(self.batch_bounds(self._epoch))

    def __iter__(self) -> Iterator[GlobalBatch]:
        """Yield batches from the current state on; forever unless ``num_batches`` is set.

        The state advances *before* a batch is yielded, so a :meth:`state_dict` taken
        after consuming batch ``k`` resumes at batch ``k + 1``.
        """
        while self.num_batches is None or self._index < self.num_batches:
            epoch, begin = self._epoch, self._offset
            order = self._order(epoch)
            end = order.batch_end(begin, self.tokens_per_batch)
            if end >= order.num_pieces:
                self._epoch, self._offset = epoch + 1, 0
            else:
                self._offset = end
            if self._is_dropped(order, begin, end):
                if begin == 0:
                    raise ConfigError(f"drop_last drops every batch: an epoch holds only "
                                      f"{order.tokens(0, end)} tokens, fewer than a full batch of "
                                      f"{self.tokens_per_batch}; lower tokens_per_batch or disable drop_last")
                continue
            batch = GlobalBatch(self._index, epoch, order.pieces(begin, end))
            self._index += 1
            yield batch

    def _fingerprint(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "max_seq_len": self.max_seq_len,
                "datasets": [t.fingerprint for t in self.tables]}

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler stands, plus what it was built on (checked on load)."""
        return {"epoch": self._epoch, "offset": self._offset, "index": self._index, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`.

        The data, seed, shuffle and max_seq_len must match (else the pieces differ and
        the position is meaningless).  ``tokens_per_batch`` may change (a new world
        size): the sampler resumes at the first piece not yet consumed, so no piece is
        lost or repeated, though batch boundaries then differ from the old run's.
        """
        if not isinstance(state, dict):
            raise ConfigError(f"sampler checkpoint: a {type(state).__name__}, not a state; the checkpoint is damaged")
        for key, want in self._fingerprint().items():
            if state.get(key) != want:
                raise ConfigError(f"sampler checkpoint was made with {key}={state.get(key)!r}, this run has "
                                  f"{key}={want!r}; resume with the same data, seed, shuffle and max_seq_len")
        try:
            epoch, offset, index = (int(state[k]) for k in ("epoch", "offset", "index"))
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ConfigError("sampler checkpoint: epoch, offset and index must be whole numbers; the checkpoint "
                              "is damaged") from None
        if epoch < 0 or index < 0 or not 0 <= offset < max(1, self._order(epoch).num_pieces):
            raise ConfigError(f"sampler checkpoint position (epoch {epoch}, offset {offset}) is out of range")
        self._epoch, self._offset, self._index = epoch, offset, index


class ZeppelinBatchSampler(TokenBudgetSampler):
    """Token-budget global batches over one dataset's documents.

    ``ZeppelinBatchSampler(lengths, max_seq_len=32768, tokens_per_batch=8 * 65536)``
    then ``for batch in sampler: plan = planner.plan(batch.seq_lens, ctx)``.
    """

    def __init__(self, doc_lengths: Any, *, max_seq_len: int, tokens_per_batch: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, num_batches: int | None = None) -> None:
        super().__init__([doc_lengths], max_seq_len=max_seq_len, tokens_per_batch=tokens_per_batch, seed=seed,
                         shuffle=shuffle, drop_last=drop_last, num_batches=num_batches)

    long_documents = True

    def epoch_order(self, epoch: int) -> EpochOrder:
        table = self.tables[0]
        if not isinstance(table, PieceTable):   # a LongPieceTable: the order is evaluated on demand
            from megatron_zeppelin.sampler.long_documents import FeistelPermutation, LongEpochOrder
            shuffle = FeistelPermutation(table.num_pieces, (self.seed, 0, epoch)) if self.shuffle else None
            return LongEpochOrder(table, shuffle)
        perm = pass_order(table, self.seed, 0, epoch, self.shuffle)
        return EpochOrder(np.zeros(perm.size, dtype=np.int64), table.doc[perm], table.start[perm],
                          table.end[perm])
