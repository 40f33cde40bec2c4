"""Tiny Megatron indexed datasets of whole documents, with known token ids."""

import numpy as np

from megatron_zeppelin.data.indexed import megatron_indexed_dataset


def doc_tokens(dataset: int, doc: int, length: int) -> np.ndarray:
    """Token ids of one test document: unique per (dataset, doc) and position, < 256."""
    return (np.arange(length) * 7 + doc * 13 + dataset * 101) % 251 + 1


def write_dataset(prefix: str, lengths, dataset: int = 0) -> str:
    """Write ``prefix.{bin,idx}`` with one sequence per document."""
    megatron = megatron_indexed_dataset()
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d, n in enumerate(lengths):
        builder.add_document(doc_tokens(dataset, d, int(n)).astype(np.uint16), [int(n)])
    builder.finalize(prefix + ".idx")
    return prefix
