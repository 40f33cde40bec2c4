"""How a sequence is cut among the ranks that share it.

Pure functions of (length, group size) so the planner, ``Plan.validate()`` and
the attention engine agree on every boundary.  Ranges are half-open token
offsets in the sequence's own coordinates.
"""

from __future__ import annotations

import numpy as np

Range = tuple[int, int]


def chunk_bounds(length: int, chunks: int) -> list[int]:
    """``chunks + 1`` boundaries cutting ``length`` tokens into near-equal chunks
    (sizes differ by at most one token, larger ones last)."""
    return [j * length // chunks for j in range(chunks + 1)]


def zigzag_shards(length: int, ring_size: int) -> list[tuple[Range, Range]]:
    """Zigzag (DualChunkSwap) shards of a causal ring: the sequence is cut into
    ``2k`` chunks and rank ``i`` holds chunks ``i`` and ``2k-1-i``.  Pairing an
    early chunk (few keys before it) with a late one (many) gives every rank the
    same number of causal query-key pairs."""
    b = chunk_bounds(length, 2 * ring_size)
    return [((b[i], b[i + 1]), (b[2 * ring_size - 1 - i], b[2 * ring_size - i]))
            for i in range(ring_size)]


def contiguous_shards(length: int, group_size: int) -> list[tuple[Range]]:
    """Contiguous equal shards, as Ulysses groups hold them (the all-to-all gathers
    the whole sequence per head, so placement does not affect balance)."""
    b = chunk_bounds(length, group_size)
    return [((b[i], b[i + 1]),) for i in range(group_size)]


def chunk_sizes(lengths: int | np.ndarray, chunks: int) -> np.ndarray:
    """Sizes of :func:`chunk_bounds`' chunks: one row per length of ``lengths``
    (a single length: one row, 1-D), for planners that count tokens of many
    sequences at once."""
    bounds = np.arange(chunks + 1, dtype=np.int64) * np.asarray(lengths, dtype=np.int64)[..., None] // chunks
    return np.diff(bounds, axis=-1)


def zigzag_shard_tokens(lengths: int | np.ndarray, ring_size: int) -> np.ndarray:
    """Tokens each rank of :func:`zigzag_shards` holds (rank ``i``: chunks ``i``
    and ``2k-1-i``), per length as :func:`chunk_sizes`."""
    k = ring_size
    sizes = chunk_sizes(lengths, 2 * k)
    return sizes[..., :k] + sizes[..., ::-1][..., :k]


def contiguous_shard_tokens(lengths: int | np.ndarray, group_size: int) -> np.ndarray:
    """Tokens each rank of :func:`contiguous_shards` holds, per length as :func:`chunk_sizes`."""
    return chunk_sizes(lengths, group_size)


def causal_pairs(start: int, end: int) -> int:
    """Causal (query, key) pairs, diagonal included, of queries ``[start, end)``
    against all keys before them: sum of (p + 1) for p in [start, end)."""
    return (end * (end + 1) - start * (start + 1)) // 2
