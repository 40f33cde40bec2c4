"""Synthetic token ids: the same data for every strategy, from (seed, document, offset).

Each token is a hash of ``(seed, doc, position)`` -- a counter-based generator in the
style of Philox/SplitMix -- so the tokens of a piece ``[start, end)`` are computed
directly, equal the slice of the whole document, and a 1M-token document never has
to be generated to read its last piece.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: SplitMix64's Weyl increment
_MASK = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (uint64 -> uint64, a bijection with full avalanche)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _document_key(seed: int, doc: int) -> np.uint64:
    # Two mixing rounds keep (seed, doc) and (seed', doc') streams unrelated even
    # when the integers are close.
    key = _mix(np.array([(seed * _GOLDEN) & _MASK], dtype=np.uint64))[0]
    return _mix(np.array([(int(key) + (doc + 1) * _GOLDEN) & _MASK], dtype=np.uint64))[0]


def synthetic_tokens(seed: int, doc: int, start: int, end: int, vocab_size: int) -> np.ndarray:
    """Token ids ``[start, end)`` of synthetic document ``doc``: int64 in ``[0, vocab_size)``."""
    if not 0 <= start <= end:
        raise ValueError(f"bad token range [{start}, {end}) of document {doc}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    positions = np.arange(start, end, dtype=np.uint64)
    z = _mix(_document_key(seed, doc) + positions * np.uint64(_GOLDEN))
    # The high 32 bits scaled by vocab_size: a near-uniform id without modulo bias.
    return ((z >> np.uint64(32)) * np.uint64(vocab_size) >> np.uint64(32)).astype(np.int64)
