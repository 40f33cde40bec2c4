"""The pieces of a Plan: a sequence's placement, a token span, and the
canonical shards of a placement (what ``Plan.validate`` requires and a Plan
received as columns rebuilds its placements from)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from megatron_zeppelin.plan.shards import Range, contiguous_shards, zigzag_shards


class Mode(str, Enum):
    """How a sequence's attention is computed."""

    LOCAL = "local"
    """Whole sequence on one rank."""
    RING = "ring"
    """Zigzag shards on k ranks, K/V passed around the ring."""
    ULYSSES = "ulysses"
    """Contiguous shards on d ranks, all-to-all over heads."""


@dataclass(frozen=True)
class SeqPlacement:
    """Attention placement of one sequence."""

    seq: int
    """Index into ``Plan.seq_lens``."""
    mode: Mode
    """local, ring or ulysses."""
    ranks: tuple[int, ...]
    """Participating ranks, in ring order for rings."""
    shards: tuple[tuple[Range, ...], ...]
    """``shards[i]``: the token ranges held by ``ranks[i]``."""

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Span:
    """A contiguous token range of one sequence."""

    seq: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


MODES = (Mode.LOCAL, Mode.RING, Mode.ULYSSES)
"""The modes in the order of their codes in columns (``plan/columns.py``, ``plan/compact.py``)."""


@lru_cache(maxsize=1 << 16)
def canonical_shards(mode: Mode, length: int, size: int) -> tuple[tuple[Range, ...], ...]:
    """The shards of a sequence of ``length`` in ``mode`` over ``size`` ranks.
    Cached: a batch repeats lengths (16,384 sequences at 1,024 GPUs hold about
    3,300 distinct ones), and a plan's builder and its validation ask alike."""
    if mode is Mode.LOCAL:
        return (((0, length),),)
    shards = zigzag_shards(length, size) if mode is Mode.RING else contiguous_shards(length, size)
    return tuple(tuple(ranges) for ranges in shards)
