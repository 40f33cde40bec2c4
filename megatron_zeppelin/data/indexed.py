"""Whole documents out of Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``).

Megatron's ``.idx`` stores *sequences* (``sequence_lengths``, ``sequence_pointers``)
and groups them into *documents* with ``document_indices``: document ``d`` is
sequences ``document_indices[d] : document_indices[d + 1]`` (the array starts with
0, so it has one entry more than there are documents).  ``preprocess_data.py``
writes one sequence per document, or one per sentence with ``--split-sentences``;
either way a document's sequences are adjacent in the ``.bin``, so its tokens are
one contiguous read from the pointer of its first sequence.  Zeppelin samples
whole documents (cut into pieces by the sampler), never Megatron's fixed-length
samples, so this module exposes exactly that view.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np

from megatron_zeppelin.errors import ConfigError

PREPARE_HINT = "python -m megatron_zeppelin.data.prepare --input FILE.jsonl --output-prefix {prefix}"


def normalize_prefix(prefix: str | os.PathLike) -> str:
    """Accept ``PREFIX``, ``PREFIX.idx`` or ``PREFIX.bin``; return ``PREFIX``."""
    text = os.fspath(prefix)
    return text[:-4] if text.endswith((".idx", ".bin")) else text


def is_indexed_prefix(prefix: str | os.PathLike) -> bool:
    """Whether ``PREFIX.idx`` exists (the .bin is checked when opening)."""
    return Path(normalize_prefix(prefix) + ".idx").is_file()


def check_prefix(prefix: str | os.PathLike) -> str:
    """``PREFIX`` with both files present, else a ConfigError that says how to make them."""
    prefix = normalize_prefix(prefix)
    for ext in (".idx", ".bin"):
        if not Path(prefix + ext).is_file():
            raise ConfigError(f"dataset prefix {prefix}: missing {prefix}{ext}; run "
                              + PREPARE_HINT.format(prefix=prefix))
    return prefix


def megatron_indexed_dataset() -> ModuleType:
    """``megatron.core.datasets.indexed_dataset``, imported on first use.

    megatron.core is heavy and warns at import that TransformerEngine/Apex are
    missing, which is irrelevant to reading token files: keep CLI output clean.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


#: Megatron's ``.idx`` header: magic, version (<Q), dtype code (<B), sequence
#: count (<Q), document-index count (<Q); then int32 sequence lengths, int64
#: sequence pointers (bytes into the .bin) and int64 document indices.
_MAGIC, _HEADER_BYTES = b"MMIDIDX\x00\x00", 34
#: Megatron's DType codes -> bytes per token.
_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}


def check_index(prefix: str) -> None:
    """Check ``PREFIX.idx`` against itself and ``PREFIX.bin`` by sizes and offsets
    before Megatron maps it: a corrupt index must be one line, never lengths that
    are not in the file (negative, past the end of the .bin)."""
    idx, bin_size = Path(prefix + ".idx"), Path(prefix + ".bin").stat().st_size

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{idx}: {what}; the dataset is corrupt -- rebuild it with "
                           + PREPARE_HINT.format(prefix=prefix))

    raw = idx.read_bytes()
    if len(raw) < _HEADER_BYTES or raw[:9] != _MAGIC:
        raise bad(f"not a Megatron index ({len(raw)} bytes, no MMIDIDX header)")
    code = raw[17]
    n_seq, n_doc = (int(v) for v in np.frombuffer(raw, "<u8", 2, 18))
    if code not in _ITEMSIZE:
        raise bad(f"unknown token dtype code {code}")
    body = 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(raw) not in (_HEADER_BYTES + body, _HEADER_BYTES + body + n_seq):   # + modes if multimodal
        raise bad(f"{len(raw)} bytes, but its header declares {n_seq} sequences and {n_doc} document "
                  f"indices ({_HEADER_BYTES + body} bytes); it is truncated or overwritten")
    lengths = np.frombuffer(raw, "<i4", n_seq, _HEADER_BYTES).astype(np.int64)
    pointers = np.frombuffer(raw, "<i8", n_seq, _HEADER_BYTES + 4 * n_seq)
    docs = np.frombuffer(raw, "<i8", n_doc, _HEADER_BYTES + 12 * n_seq)
    if (lengths < 0).any():
        raise bad(f"sequence {int(np.argmax(lengths < 0))} has a negative length")
    ends = np.cumsum(lengths * _ITEMSIZE[code])
    if n_seq and (pointers[0] != 0 or (pointers[1:] != ends[:-1]).any()):
        raise bad("its sequence offsets do not follow its sequence lengths")
    if n_doc < 1 or docs[0] != 0 or (np.diff(docs) < 0).any() or docs[-1] != n_seq:
        raise bad("its document indices are not 0 .. sequence count in order")
    expected = int(ends[-1]) if n_seq else 0
    if expected != bin_size:
        raise ConfigError(f"{prefix}.bin: {bin_size} bytes, but {idx} describes {expected}; the .bin is "
                          "truncated or belongs to another index -- rebuild it with "
                          + PREPARE_HINT.format(prefix=prefix))


class IndexedDocuments:
    """Document lengths and token slices of a Megatron indexed dataset."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = check_prefix(prefix)
        check_index(self.prefix)
        try:
            self._dataset = megatron_indexed_dataset().IndexedDataset(self.prefix, multimodal=False, mmap=True)
        except (AssertionError, ValueError, OSError) as exc:
            raise ConfigError(f"dataset prefix {self.prefix}: not a readable Megatron indexed dataset "
                              f"({exc or type(exc).__name__}); rebuild it with "
                              + PREPARE_HINT.format(prefix=self.prefix)) from None
        doc_index = np.asarray(self._dataset.document_indices, dtype=np.int64)
        seq_cum = np.concatenate([[0], np.cumsum(self._dataset.sequence_lengths, dtype=np.int64)])
        self._first_sequence = doc_index[:-1]
        self.lengths = seq_cum[doc_index[1:]] - seq_cum[doc_index[:-1]]
        """int64 [documents]: tokens per document (the sampler's input)."""

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def dtype(self) -> np.dtype:
        """Token dtype on disk (uint16 for vocabularies under 65500, else int32)."""
        return np.dtype(self._dataset.index.dtype)

    def tokens(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """Token ids ``[start, end)`` of document ``doc`` as int64 (``end`` defaults to its length)."""
        if not 0 <= doc < len(self):
            raise IndexError(f"document {doc} out of range: {self.prefix} has {len(self)} documents")
        length = int(self.lengths[doc])
        end = length if end is None else end
        if not 0 <= start <= end <= length:
            raise IndexError(f"token range [{start}, {end}) outside document {doc} of length {length}")
        if start == end:
            return np.zeros(0, dtype=np.int64)
        # get() reads `length` tokens from the first sequence's pointer + offset; the
        # document's later sequences follow it in the .bin, so the read may span them.
        part = self._dataset.get(int(self._first_sequence[doc]), offset=start, length=end - start)
        return np.asarray(part, dtype=np.int64)


def document_lengths(prefix: str | os.PathLike) -> np.ndarray:
    """Tokens per document of the indexed dataset at ``prefix`` (int64)."""
    return IndexedDocuments(prefix).lengths
