"""Index maps of one layout switch: which buffer rows go where.

A rank's *attention buffer* holds ``plan.attention_spans(rank)`` in order, its
*linear buffer* ``plan.linear[rank]`` in order.  Switching layouts is one
all-to-all-v: the moves of ``Plan.remap_schedule()`` merged into one message
per (src, dst) pair (``Plan.remap_pairs``; a rank makes only its own moves,
``Plan.remap_moves``), plus a local copy of the tokens a rank keeps.  Pure
functions of the Plan; cached per (plan, rank) because every layer of a step
switches with the same maps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan import Plan, Span


@dataclass(frozen=True)
class RemapExchange:
    """One rank's part of the attention -> linear switch (reverse it for the way back)."""

    attn_tokens: int
    """Tokens in this rank's attention buffer."""
    linear_tokens: int
    """Tokens in this rank's linear buffer."""
    pairs: tuple[tuple[int, int, int], ...]
    """Every rank's messages, ``(src, dst, tokens)`` by message id (global, same on all ranks)."""
    send_rows: dict[int, torch.Tensor]
    """Message id -> attention-buffer rows this rank sends, in message order."""
    recv_rows: dict[int, torch.Tensor]
    """Message id -> linear-buffer rows this rank receives, in message order."""
    keep_attn: torch.Tensor
    """Attention-buffer rows of the tokens this rank holds in both layouts..."""
    keep_linear: torch.Tensor
    """...and their linear-buffer rows, element for element."""
    round_messages: dict[tuple[bool, int], tuple] = field(default_factory=dict, repr=False, compare=False)
    """(to the linear layout, elements per row) -> the round's messages, built by
    the first switch of the step that needs them: the communicator recognizes the
    same tuple and reuses its prepared round."""
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)

    def to(self, device: torch.device) -> "RemapExchange":
        """The same maps with index tensors on ``device`` (cached)."""
        if device.type == "cpu":
            return self
        if device not in self._on_device:
            # Pinned and non-blocking: uploading the maps never waits for the GPU.
            up = lambda t: t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)  # noqa: E731
            move = lambda d: {k: up(v) for k, v in d.items()}  # noqa: E731
            self._on_device[device] = RemapExchange(
                self.attn_tokens, self.linear_tokens, self.pairs, move(self.send_rows),
                move(self.recv_rows), up(self.keep_attn), up(self.keep_linear))
        return self._on_device[device]


class _RowIndex:
    """Buffer row of any token of a rank's span list."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self.by_seq: dict[int, list[tuple[int, int, int]]] = {}
        offset = 0
        for sp in spans:
            self.by_seq.setdefault(sp.seq, []).append((sp.start, sp.end, offset))
            offset += sp.length
        for pieces in self.by_seq.values():
            pieces.sort()
        self.tokens = offset

    def rows(self, seq: int, lo: int, hi: int) -> np.ndarray:
        """Rows of tokens ``[lo, hi)`` of ``seq``; they lie inside one span by construction
        (the schedule cuts moves at both layouts' span boundaries)."""
        pieces = self.by_seq.get(seq, [])
        i = bisect.bisect_right(pieces, (lo, float("inf"), 0)) - 1
        if i < 0 or pieces[i][1] < hi:
            raise PlanError(f"plan: tokens [{lo}, {hi}) of sequence {seq} are not held where the remap "
                            "schedule says; call plan.validate() to find the broken layout")
        start, _, offset = pieces[i]
        return np.arange(offset + lo - start, offset + hi - start, dtype=np.int64)

    def overlap(self, other: "_RowIndex", spans: Sequence[Span]) -> tuple[list, list]:
        """Rows (in self, in other) of the tokens both hold; ``spans`` are other's spans."""
        mine, theirs = [], []
        for sp in spans:
            for start, end, _ in self.by_seq.get(sp.seq, []):
                lo, hi = max(start, sp.start), min(end, sp.end)
                if lo < hi:
                    mine.append(self.rows(sp.seq, lo, hi))
                    theirs.append(other.rows(sp.seq, lo, hi))
        return mine, theirs


def _cat(rows: list[np.ndarray]) -> torch.Tensor:
    # numpy, single-threaded: torch's arange and cat of a rank's ~10^5 rows run on
    # the intra-op threads, which on a loaded host spin for 10x the work (measured:
    # 53 ms CPU against 4 at 1,024 GPUs, 245K tokens per rank).
    return torch.from_numpy(np.concatenate(rows)) if rows else torch.empty(0, dtype=torch.long)


def build_exchange(plan: Plan, rank: int) -> RemapExchange:
    """The index maps of ``rank`` for ``plan`` (``remap_tokens`` caches them on the step context)."""
    attn = _RowIndex(plan.attention_spans(rank))
    linear = _RowIndex(plan.linear[rank])
    # The moves are sorted by (src, dst, seq, start): both ends of a pair see its
    # transfers in the same order, so rows line up without sending indices.  Only
    # this rank's are made; the pairs (message ids) come with the Plan.
    grouped: dict[tuple[int, int], list] = {}
    for t in plan.remap_moves(rank):
        grouped.setdefault((t.src, t.dst), []).append(t)
    pairs = plan.remap_pairs()
    send_rows, recv_rows = {}, {}
    for (src, dst), moves in grouped.items():
        mid = bisect.bisect_left(pairs, (src, dst))       # pairs are sorted by (src, dst)
        if mid == len(pairs) or pairs[mid][:2] != (src, dst):
            raise PlanError(f"plan: its remap pairs lack {src} -> {dst}, which rank {rank}'s moves need; "
                            "rebuild the Plan (remap_pairs must come from the same layouts)")
        if src == rank:
            send_rows[mid] = _cat([attn.rows(t.seq, t.start, t.end) for t in moves])
        if dst == rank:
            recv_rows[mid] = _cat([linear.rows(t.seq, t.start, t.end) for t in moves])
    keep_attn, keep_linear = attn.overlap(linear, plan.linear[rank])
    ex = RemapExchange(attn.tokens, linear.tokens, pairs, send_rows, recv_rows,
                       _cat(keep_attn), _cat(keep_linear))
    kept = ex.keep_attn.numel()
    if (kept + sum(r.numel() for r in send_rows.values()) != attn.tokens
            or kept + sum(r.numel() for r in recv_rows.values()) != linear.tokens):
        raise PlanError(f"plan: rank {rank}'s linear layout does not hold every token of the batch "
                        "exactly once; call plan.validate() to find the broken sequence")
    return ex
