"""A packed Ulysses group: several Ulysses sequences on the same ranks run as one group.

FlexSP and DeepSpeed-Ulysses run a group's sequences together: one all-to-all
each way whose message to a peer holds every sequence's rows, and one varlen
attention call over the sequences.  A Plan asks for it with
``Plan.packed_ulysses``; the schedule (``schedule/attention.py``) then has one
group named by its first member, whose messages hold the members' rows back to
back in plan order (``schedule/packed.py: summed_ulysses``).

Here one position of such a group wraps its members' :class:`UlyssesForward` /
:class:`UlyssesBackward`: their pieces, gathers and outputs stay theirs; what a
member receives is its rows of the packed message.  The members' heads are
attended in one ``varlen_forward`` / ``varlen_backward`` call (THD offsets:
one kernel where the backend is fused, its own per-sequence loop otherwise).
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_zeppelin.attention.backends.base import AttentionBackend
from megatron_zeppelin.attention.ulysses import Received, UlyssesBackward, UlyssesForward, UlyssesPosition

Offsets = Callable[[tuple[int, ...], torch.device], torch.Tensor]
"""Lengths -> their int32 ``cu_seqlens`` on the device (the engine's per-plan cache)."""


class PackedUlysses:
    """One position of a packed Ulysses group (see the module docstring)."""

    def __init__(self, index: int, members: list[UlyssesPosition], received: Received, offsets: Offsets) -> None:
        self.index, self.members, self.received, self.offsets = index, members, received, offsets
        self.pos, self.d = members[0].pos, members[0].d
        # Piece b: every member's rows of b's heads, back to back; each member's
        # piece becomes its rows of it (one copy, not two).
        self.pieces = [torch.cat([m.pieces[b] for m in members]) for b in range(self.d)]
        for b, packed in enumerate(self.pieces):
            for m, part in zip(members, packed.split(self._rows_at(self.pos))):
                m.pieces[b] = part
        self._parts: dict[tuple, tuple[torch.Tensor, ...]] = {}
        for j, m in enumerate(members):
            m.received = self._member_received(j)

    def _rows_at(self, pos: int) -> list[int]:
        return [e - s for s, e in (m.rows(pos) for m in self.members)]

    def _rows(self, kind: str, src: int) -> list[int]:
        """Each member's rows in ``src``'s message to this position: ``src``'s rows
        (``a2a_in``: src's rows of my heads) or mine (``a2a_out``: my rows of its heads)."""
        return self._rows_at(src if kind == "a2a_in" else self.pos)

    def _member_received(self, j: int) -> Received:
        def received(binding: tuple) -> torch.Tensor:
            kind, _, src, dst = binding
            key = (kind, src)
            if key not in self._parts:       # split once per message, not once per member
                self._parts[key] = self.received((kind, self.index, src, dst)).split(self._rows(kind, src))
            return self._parts[key][j]
        return received

    def buffer(self, kind: str, src: int) -> torch.Tensor:
        shape = self.members[0].buffer_shape(kind, src)
        return self.pieces[self.pos].new_empty((sum(self._rows(kind, src)), *shape[1:]))

    def out_piece(self, dst: int) -> torch.Tensor:
        return torch.cat([m.out_piece(dst) for m in self.members])

    def _call(self, parts: list[tuple[torch.Tensor, ...]]) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        """The members' tensors of one kind back to back (rows; an LSE's columns), and their lengths."""
        lengths = tuple(p[0].shape[0] for p in parts)
        return tuple(torch.cat(x, dim=1 if x[0].dim() == 2 else 0) for x in zip(*parts)), lengths


class PackedUlyssesForward(PackedUlysses):
    members: list[UlyssesForward]

    def compute(self, backend: AttentionBackend, scale: float) -> None:
        heads = [m.heads() for m in self.members]
        (q, k, v), lengths = self._call(heads)
        out, lse = backend.varlen_forward(q, k, v, cu_seqlens=self.offsets(lengths, q.device),
                                          max_seqlen=max(lengths), scale=scale, lengths=lengths)
        for m, h, o, l in zip(self.members, heads, out.split(lengths), lse.split(lengths, dim=1)):
            m.saved = (*h, o, l)


class PackedUlyssesBackward(PackedUlysses):
    members: list[UlyssesBackward]

    def compute(self, backend: AttentionBackend, scale: float) -> None:
        (dout, q, k, v, out, lse), lengths = self._call([(m.dout_heads(), *m.saved) for m in self.members])
        grads = backend.varlen_backward(dout, q, k, v, out, lse, cu_seqlens=self.offsets(lengths, q.device),
                                        max_seqlen=max(lengths), scale=scale, lengths=lengths)
        for m, *g in zip(self.members, *(x.split(lengths) for x in grads)):
            m.dqkv_h = torch.cat(g, dim=1)
