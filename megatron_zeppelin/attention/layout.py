"""Where each placement's tokens sit in a rank's attention-layout buffer.

The buffer order is ``Plan.attention_spans(rank)``: placements in plan order,
each placement's shards in order.  The engine slices q/k/v with
:func:`rank_pieces`; tests and the trainer build a rank's buffer from whole
sequences with :func:`shard_sequences` (the production layout function, so a
reference sharded with it lines up row for row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_zeppelin.plan.plan import Plan


@dataclass(frozen=True)
class Piece:
    """One placement's rows in a rank's buffer."""

    index: int
    """Index into ``plan.attention``."""
    pos: int
    """The rank's position in the placement's ``ranks``."""
    rows: slice
    """Rows of the buffer (the rank's shards of that sequence, back to back)."""


def rank_pieces(plan: Plan, rank: int) -> list[Piece]:
    """The placements ``rank`` takes part in, in buffer order."""
    pieces, row = [], 0
    for index, pos in plan.placements_of(rank):
        n = sum(e - s for s, e in plan.attention[index].shards[pos])
        pieces.append(Piece(index, pos, slice(row, row + n)))
        row += n
    return pieces


def shard_sequences(plan: Plan, rank: int, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """``rank``'s attention-layout buffer cut from whole sequences
    (``sequences[i]``: ``[seq_lens[i], ...]``): rows in ``attention_spans`` order."""
    spans = plan.attention_spans(rank)
    if not spans:
        return sequences[0].new_empty((0, *sequences[0].shape[1:]))
    return torch.cat([sequences[sp.seq][sp.start:sp.end] for sp in spans])
