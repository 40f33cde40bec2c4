"""A rank's token buffer for one step: tokens, labels and loss mask in layout order.

Sequence ``i`` of a global batch is the sampler's piece ``i`` (tokens
``[start, end)`` of one document).  A rank holds spans of sequences in the
attention layout order; the label of a token is the next token *of the same
sequence*, so the last token of every sequence has no label (masked).  Token
ids come from a :class:`TokenSource`: synthetic ids (``--lengths``) or a
Megatron indexed dataset (``--data``), identical for every strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from megatron_zeppelin.data.indexed import IndexedDocuments
from megatron_zeppelin.data.tokens import synthetic_tokens
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.plan import Span
from megatron_zeppelin.sampler import Piece, load_lengths


class TokenSource(Protocol):
    """Token ids of document pieces."""

    def tokens(self, doc: int, start: int, end: int) -> np.ndarray:
        """Ids of tokens ``[start, end)`` of document ``doc`` (1-D integer array)."""


@dataclass(frozen=True)
class RankBatch:
    """This rank's buffer, in the order of the spans it was built from."""

    tokens: torch.Tensor
    """``[t]`` int64 input ids."""
    labels: torch.Tensor
    """``[t]`` int64 next-token ids (0 where masked)."""
    loss_mask: torch.Tensor
    """``[t]`` float: 1 where the token has a label in its own sequence."""
    pad_tokens: int = 0
    """Masked rows of token 0 after the spans' tokens: one when the rank holds no
    token (Megatron's layers cannot run on an empty tensor), and up to a multiple
    of the TP size under sequence parallelism."""


def build_rank_batch(spans: Sequence[Span], pieces: Sequence[Piece], source: TokenSource,
                     device: torch.device, multiple_of: int = 1) -> RankBatch:
    """Tokens, labels and mask of ``spans`` (spans index ``pieces`` by ``seq``),
    padded with masked rows to :func:`padded_length` (one row when ``spans`` hold
    no token; a multiple of the TP size under sequence parallelism)."""
    held = sum(sp.length for sp in spans)
    pad_tokens = padded_length(held, multiple_of) - held
    tokens, labels, mask = [], [], []
    for sp in spans:
        piece = pieces[sp.seq]
        # One token past the span supplies the last label, unless the span ends the sequence.
        stop = min(sp.end + 1, piece.length)
        ids = np.asarray(source.tokens(piece.doc, piece.start + sp.start, piece.start + stop),
                         dtype=np.int64)
        has_next = stop - sp.start - 1  # tokens of the span whose label exists
        tokens.append(ids[:sp.length])
        labels.append(np.concatenate([ids[1:], np.zeros(sp.length - has_next, np.int64)]))
        mask.append(np.concatenate([np.ones(has_next), np.zeros(sp.length - has_next)]))
    pad = np.zeros(pad_tokens, np.int64)
    tokens.append(pad)
    labels.append(pad)
    mask.append(pad)

    def cat(parts: list[np.ndarray], dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts).astype(dtype)).to(device)
    return RankBatch(tokens=cat(tokens, np.int64), labels=cat(labels, np.int64),
                     loss_mask=cat(mask, np.float32), pad_tokens=pad_tokens)


def padded_length(tokens: int, multiple: int) -> int:
    """Rows of a rank's buffer: its tokens rounded up to ``multiple`` (sequence
    parallelism scatters rows evenly over the TP ranks), and at least one row
    (Megatron's layers cannot run on an empty tensor).  Padding rows carry no loss."""
    return max(-(-tokens // multiple) * multiple, multiple)


def num_label_tokens(seq_lens: Sequence[int]) -> int:
    """Tokens of the global batch that carry a label (the loss denominator)."""
    return sum(n - 1 for n in seq_lens)


@dataclass(frozen=True)
class SyntheticSource:
    """Deterministic ids from (seed, document, position): identical for every strategy."""

    seed: int
    vocab_size: int

    def tokens(self, doc: int, start: int, end: int) -> np.ndarray:
        return synthetic_tokens(self.seed, doc, start, end, self.vocab_size)


@dataclass(frozen=True)
class IndexedSource:
    """Ids read from a Megatron indexed dataset, checked against the vocabulary."""

    documents: IndexedDocuments
    vocab_size: int

    def tokens(self, doc: int, start: int, end: int) -> np.ndarray:
        ids = self.documents.tokens(doc, start, end)
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise ConfigError(f"dataset {self.documents.prefix}: document {doc} holds token id "
                              f"{int(ids.max())}, outside the model's vocabulary of {self.vocab_size}; "
                              "use a model preset whose vocab_size covers the tokenizer")
        return ids


def make_token_source(lengths: str | None, data: str | None, seed: int,
                      vocab_size: int) -> tuple[TokenSource, np.ndarray]:
    """The token source and the document lengths of ``--lengths`` or ``--data``."""
    if data is not None:
        documents = IndexedDocuments(data)
        return IndexedSource(documents, vocab_size), documents.lengths
    return SyntheticSource(seed, vocab_size), load_lengths(lengths)
