"""Ulysses (DeepSpeed sequence parallelism): what each op of a group does on one position.

Position ``p`` holds contiguous rows ``[b_p, b_{p+1})`` of every head.  An
all-to-all over heads gives position ``p`` the *whole* sequence for heads
``p*h/d .. (p+1)*h/d``; it runs plain causal attention on them, and a second
all-to-all returns the output rows.  Query heads and key/value heads are split
the same way, so a query head's GQA key head lands on the same position.
Message sizes come from ``schedule/geometry.py``.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_zeppelin.attention.backends.base import AttentionBackend
from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan.plan import SeqPlacement

Received = Callable[[tuple], torch.Tensor]


def check_heads(placement: SeqPlacement, q_heads: int, kv_heads: int) -> None:
    d = placement.size
    if q_heads % d or kv_heads % d:
        raise PlanError(f"plan: sequence {placement.seq} runs Ulysses on {d} ranks but "
                        f"{q_heads} query / {kv_heads} key-value heads do not split "
                        f"{d} ways; use a group size dividing both head counts")


class UlyssesPosition:
    """One position of one Ulysses placement over one layer call."""

    def __init__(self, index: int, placement: SeqPlacement, pos: int, received: Received) -> None:
        self.index, self.p, self.pos, self.received = index, placement, pos, received
        self.d = placement.size

    @property
    def members(self) -> list["UlyssesPosition"]:
        """The sequences this position runs: itself (a packed group's are several)."""
        return [self]

    def rows(self, pos: int) -> tuple[int, int]:
        return self.p.shards[pos][0]

    def _gather(self, kind: str, own: torch.Tensor, dim: int) -> torch.Tensor:
        """The pieces of every position (own in place), concatenated along ``dim``."""
        parts = [own if a == self.pos else self.received((kind, self.index, a, self.pos))
                 for a in range(self.d)]
        return torch.cat(parts, dim=dim)

    out_heads: int
    """Heads per position of what the second all-to-all carries."""

    def buffer_shape(self, kind: str, src: int) -> tuple[int, ...]:
        """Shape of ``src``'s piece: its rows of my heads (``a2a_in``), or my rows
        of its heads (``a2a_out``)."""
        if kind == "a2a_in":
            s, e = self.rows(src)
            return (e - s, *self.pieces[src].shape[1:])
        s, e = self.rows(self.pos)
        return (e - s, self.out_heads, self.pieces[self.pos].shape[2])

    def buffer(self, kind: str, src: int) -> torch.Tensor:
        """Receive buffer of ``src``'s piece (:meth:`buffer_shape`)."""
        return self.pieces[self.pos].new_empty(self.buffer_shape(kind, src))


class UlyssesForward(UlyssesPosition):
    def __init__(self, index, placement, pos, received, q, k, v) -> None:
        super().__init__(index, placement, pos, received)
        check_heads(placement, q.shape[1], k.shape[1])
        self.hq = self.out_heads = q.shape[1] // self.d
        # [n, hq + 2hk, d] -> piece b: rows of mine, heads of b (q heads, k heads, v heads)
        self.pieces = [torch.cat(parts, dim=1).contiguous() for parts in
                       zip(q.chunk(self.d, dim=1), k.chunk(self.d, dim=1), v.chunk(self.d, dim=1))]
        self.saved: tuple | None = None

    def heads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` of the whole sequence, my heads (once every piece has arrived)."""
        qkv = self._gather("a2a_in", self.pieces[self.pos], dim=0)   # [L, hq/d + 2hk/d, d]
        hk = (qkv.shape[1] - self.hq) // 2
        return qkv.split([self.hq, hk, hk], dim=1)

    def compute(self, backend: AttentionBackend, scale: float) -> None:
        qh, kh, vh = self.heads()
        out_h, lse_h = backend.forward(qh, kh, vh, causal=True, scale=scale)
        self.saved = (qh, kh, vh, out_h, lse_h)

    def out_piece(self, dst: int) -> torch.Tensor:
        s, e = self.rows(dst)
        return self.saved[3][s:e].contiguous()

    def output(self) -> torch.Tensor:
        """``[n, hq, d]``: my rows of every head, once every piece has arrived."""
        return self._gather("a2a_out", self.out_piece(self.pos), dim=1)


class UlyssesBackward(UlyssesPosition):
    def __init__(self, index, placement, pos, received, dout, saved) -> None:
        super().__init__(index, placement, pos, received)
        self.saved = saved
        self.pieces = [x.contiguous() for x in dout.chunk(self.d, dim=1)]
        self.out_heads = saved[0].shape[1] + 2 * saved[1].shape[1]     # dQ, dK, dV heads
        self.dqkv_h: torch.Tensor | None = None

    def dout_heads(self) -> torch.Tensor:
        """``[L, hq/d, d]``: the output gradient of the whole sequence, my heads."""
        return self._gather("a2a_in", self.pieces[self.pos], dim=0)

    def compute(self, backend: AttentionBackend, scale: float) -> None:
        qh, kh, vh, out_h, lse_h = self.saved
        grads = backend.backward(self.dout_heads(), qh, kh, vh, out_h, lse_h, causal=True, scale=scale)
        self.dqkv_h = torch.cat(grads, dim=1)                             # [L, hq/d + 2hk/d, d]

    def out_piece(self, dst: int) -> torch.Tensor:
        s, e = self.rows(dst)
        return self.dqkv_h[s:e].contiguous()

    def grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dqkv = self._gather("a2a_out", self.out_piece(self.pos), dim=1)
        # [n, d * (hq/d + 2hk/d), d]: per source position its (dq, dk, dv) heads
        hq, hk = self.saved[0].shape[1], self.saved[1].shape[1]
        per_pos = dqkv.split([hq + 2 * hk] * self.d, dim=1)
        dq = torch.cat([x[:, :hq] for x in per_pos], dim=1)
        dk = torch.cat([x[:, hq:hq + hk] for x in per_pos], dim=1)
        dv = torch.cat([x[:, hq + hk:] for x in per_pos], dim=1)
        return dq, dk, dv
