"""A packed ring: several zigzag ring sequences on the same ranks run as one ring.

TransformerEngine's THD ring carries every sequence of a CP group in one ring:
each step sends all members' K/V chunks as one message and computes all their
blocks at once.  A Plan asks for it with ``Plan.packed_rings``; the schedule
(``schedule/attention.py``) then has one ring named by its first member, whose
messages hold the members' rows back to back in plan order
(``schedule/packed.py: summed_ring``).

Here one position of such a ring wraps its members' :class:`RingForward` /
:class:`RingBackward`: their queries, outputs, LSE and dQ stay theirs; the K/V
they see at a step, and the dK/dV they add to, are row slices of the packed
message.  A step's blocks are computed in one varlen call per mask kind
(causal diagonals at step 0, full blocks) where the backend takes THD offsets
(:class:`FusedKernels`), else block by block; every member's output is merged
with its own LSE (:func:`update_out_and_lse`), as an unpacked ring merges.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_zeppelin.attention.backends import AutoBackend
from megatron_zeppelin.attention.backends.base import AttentionBackend, FusedKernels
from megatron_zeppelin.attention.merge import update_out_and_lse
from megatron_zeppelin.attention.ring import Received, RingBackward, RingForward, RingPosition, acc_dtype
from megatron_zeppelin.schedule import geometry as geo

Offsets = Callable[[tuple[int, ...], torch.device], torch.Tensor]
"""Lengths -> their int32 ``cu_seqlens`` on the device (the engine's per-plan cache)."""


def _fused(backend: AttentionBackend, q: torch.Tensor) -> FusedKernels | None:
    """The backend's THD kernels for ``q``, or None where it computes block by block."""
    picked = backend.pick(q) if isinstance(backend, AutoBackend) else backend
    return picked if isinstance(picked, FusedKernels) else None


def blocks_forward(backend: AttentionBackend, qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor],
                   vs: Sequence[torch.Tensor], causal: bool, scale: float,
                   offsets: Offsets) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(out, lse)`` of each block pair ``(qs[i], ks[i], vs[i])``, all of one mask kind."""
    fused = _fused(backend, qs[0])
    if fused is None or len(qs) == 1:
        return [backend.forward(q, k, v, causal=causal, scale=scale) for q, k, v in zip(qs, ks, vs)]
    lq, lk = tuple(q.shape[0] for q in qs), tuple(k.shape[0] for k in ks)
    device = qs[0].device
    # q: [sum tq, hq, d], k/v: [sum tk, hk, d]; block i is sequence i of the batch.
    out, lse = fused._forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), offsets(lq, device), offsets(lk, device),
                              max(lq), max(lk), causal, scale)
    return list(zip(out.split(lq), lse.split(lq, dim=1)))


def blocks_backward(backend: AttentionBackend, douts: Sequence[torch.Tensor], qs: Sequence[torch.Tensor],
                    ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                    lses: Sequence[torch.Tensor], causal: bool, scale: float,
                    offsets: Offsets) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(dq, dk, dv)`` of each block pair, against the final ``outs`` and ``lses`` of its query rows."""
    fused = _fused(backend, qs[0])
    if fused is None or len(qs) == 1:
        return [backend.backward(do, q, k, v, o, lse, causal=causal, scale=scale)
                for do, q, k, v, o, lse in zip(douts, qs, ks, vs, outs, lses)]
    lq, lk = tuple(q.shape[0] for q in qs), tuple(k.shape[0] for k in ks)
    device = qs[0].device
    dq, dk, dv = fused._backward(torch.cat(douts), torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(outs),
                                 torch.cat(lses, dim=1), offsets(lq, device), offsets(lk, device), max(lq), max(lk),
                                 causal, scale)
    return list(zip(dq.split(lq), dk.split(lk), dv.split(lk)))


class PackedRing:
    """One position of a packed ring (see the module docstring)."""

    def __init__(self, index: int, members: list[RingPosition], received: Received, offsets: Offsets) -> None:
        self.index, self.members, self.received, self.offsets = index, members, received, offsets
        self.pos, self.k = members[0].pos, members[0].k
        # The position's own K/V, members back to back ([2, n, hk, d]); each
        # member's own K/V becomes its rows of it (one copy of the K/V, not two).
        self.kv_own = torch.cat([m.kv_own for m in members], dim=1)
        for m, own in zip(members, self._split(self.kv_own, self.pos)):
            m.kv_own = own
        for j, m in enumerate(members):
            m.received = self._member_received(j)

    def _rows(self, owner: int) -> list[int]:
        return [geo.shard_tokens(m.p, owner) for m in self.members]

    def _split(self, packed: torch.Tensor, owner: int) -> tuple[torch.Tensor, ...]:
        """Each member's rows of ``owner``'s packed K/V (or dK/dV): views."""
        return packed.split(self._rows(owner), dim=1)

    def _member_received(self, j: int) -> Received:
        def received(binding: tuple) -> torch.Tensor:
            kind, _, step, src = binding
            # A step-s message from src holds owner src - s's K/V, or owner
            # src - s + 1's dK/dV (they travel one step behind).
            owner = (src - step) % self.k if kind == "kv" else (src - step + 1) % self.k
            return self._split(self.received((kind, self.index, step, src)), owner)[j]
        return received

    def kv(self, step: int) -> torch.Tensor:
        """The packed K/V this position holds at ``step``."""
        if step == 0:
            return self.kv_own
        return self.received(("kv", self.index, step - 1, (self.pos - 1) % self.k))

    def kv_buffer(self, step: int, src: int) -> torch.Tensor:
        n = sum(self._rows((src - step) % self.k))
        return self.kv_own.new_empty((2, n, *self.kv_own.shape[2:]))

    def _blocks(self, step: int) -> dict[bool, list[tuple[RingPosition, slice, torch.Tensor, slice]]]:
        """The step's blocks by mask kind: (member, query rows, member's K/V, key rows)."""
        kinds: dict[bool, list] = {True: [], False: []}
        parts = self._split(self.kv(step), (self.pos - step) % self.k)
        for m, kv in zip(self.members, parts):
            for qs, ks, causal in m.blocks(step):
                kinds[causal].append((m, qs, kv, ks))
        return {causal: blocks for causal, blocks in kinds.items() if blocks}


def _keys_values(blocks: list[tuple]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The key and value rows of each block of :meth:`PackedRing._blocks`."""
    return [kv[0, ks] for _, _, kv, ks in blocks], [kv[1, ks] for _, _, kv, ks in blocks]


class PackedRingForward(PackedRing):
    """Forward: each member keeps its running (out, lse)."""

    members: list[RingForward]

    def compute(self, step: int, backend: AttentionBackend, scale: float) -> None:
        for causal, blocks in self._blocks(step).items():
            ks, vs = _keys_values(blocks)
            results = blocks_forward(backend, [m.q[qs] for m, qs, _, _ in blocks], ks, vs, causal, scale, self.offsets)
            for (m, qs, _, _), (bo, bl) in zip(blocks, results):
                update_out_and_lse(m.acc[qs], m.lse[:, qs], bo, bl)          # in place


class PackedRingBackward(PackedRing):
    """Backward: each member's dQ; per step one packed dK/dV contribution for
    the owner whose K/V the position held."""

    members: list[RingBackward]

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.contrib: dict[int, torch.Tensor] = {}

    def compute(self, step: int, backend: AttentionBackend, scale: float) -> None:
        kv = self.kv(step)
        contrib = torch.zeros(kv.shape, dtype=acc_dtype(self.members[0].q.dtype), device=kv.device)
        share = dict(zip(map(id, self.members), self._split(contrib, (self.pos - step) % self.k)))
        for causal, blocks in self._blocks(step).items():
            ks, vs = _keys_values(blocks)
            rows = [(m, qs) for m, qs, _, _ in blocks]
            grads = blocks_backward(backend, [m.dout[qs] for m, qs in rows], [m.q[qs] for m, qs in rows], ks, vs,
                                    [m.out[qs] for m, qs in rows], [m.lse[:, qs] for m, qs in rows], causal, scale,
                                    self.offsets)
            for (m, qs, _, ks), (bq, bk, bv) in zip(blocks, grads):
                m.dq[qs] += bq
                mine = share[id(m)]
                mine[0, ks] += bk
                mine[1, ks] += bv
        self.contrib[step] = contrib

    def dkv_parts(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`RingBackward.dkv_parts`, every member's rows in one tensor (the
        fp32 contribution, and what arrived in the members' ``wire`` dtype)."""
        own = self.contrib.pop(step - 1)
        if step - 1 == 0:
            return own, None
        return own, self.received(("dkv", self.index, step - 1, (self.pos - 1) % self.k))

    def dkv_buffer(self, step: int, src: int) -> torch.Tensor:
        n = sum(self._rows((src - step + 1) % self.k))
        first = self.members[0]          # every member's dK/dV travel in the same wire dtype
        return torch.empty((2, n, *self.kv_own.shape[2:]), dtype=first.wire, device=first.q.device)
