"""Zigzag ring attention: what each op of a ring does on one position.

The schedule (``schedule/attention.py``) says when: at step ``s`` position
``i`` computes its blocks against the K/V of owner ``i - s`` (own K/V at step 0,
else what arrived from ``i - 1`` at step ``s - 1``) and forwards those K/V to
``i + 1``.  Backward (``k + 1`` steps, ring-flash-attention's zigzag backward)
adds the dK/dV of each owner travelling one step behind the K/V, accumulating
every position's contribution; the last step hands each owner its complete
dK/dV.  Each rank accumulates its contribution in fp32 (:func:`acc_dtype`);
the dK/dV messages travel in :func:`ring_grad_wire_dtype` (``ring_grad_dtype``:
``model`` rounds the running sum to the K/V dtype once per send, as
TransformerEngine's p2p ring does; ``fp32`` keeps it exact).  Which rows meet
which comes from ``schedule/geometry.py``, shared with the schedule's pair
counts.  Results are merged with the log-sum-exp of each block
(:func:`update_out_and_lse`).
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_zeppelin.attention.backends.base import AttentionBackend
from megatron_zeppelin.attention.merge import update_out_and_lse
from megatron_zeppelin.cost.model import check_ring_grad_dtype
from megatron_zeppelin.plan.plan import SeqPlacement
from megatron_zeppelin.schedule import geometry as geo

Received = Callable[[tuple], torch.Tensor]
"""Message binding -> the tensor it landed in on this rank."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of partial outputs and dK/dV (fp32; fp64 for fp64)."""
    return torch.promote_types(dtype, torch.float32)


def ring_grad_wire_dtype(dtype: torch.dtype, ring_grad_dtype: str) -> torch.dtype:
    """What dK/dV messages of K/V in ``dtype`` travel in under ``ring_grad_dtype``
    (``cost/model.py: RING_GRAD_DTYPES``; its ``ring_grad_itemsize`` is this dtype's size)."""
    return dtype if check_ring_grad_dtype(ring_grad_dtype) == "model" else acc_dtype(dtype)


def _slices(block: geo.Block) -> tuple[slice, slice, bool]:
    q0, q1, k0, k1, causal = block
    return slice(q0, q1), slice(k0, k1), causal


class RingPosition:
    """One position's state of one ring placement over one layer call."""

    def __init__(self, index: int, placement: SeqPlacement, pos: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, received: Received) -> None:
        self.index, self.p, self.pos, self.q = index, placement, pos, q
        self.kv_own = torch.stack([k, v]).contiguous()             # [2, n, hk, d]
        self.received = received
        self.k = placement.size

    @property
    def members(self) -> list["RingPosition"]:
        """The sequences this position runs: itself (a packed ring's are several)."""
        return [self]

    def kv(self, step: int) -> torch.Tensor:
        """The K/V this position holds at ``step`` (those of owner ``pos - step``)."""
        if step == 0:
            return self.kv_own
        return self.received(("kv", self.index, step - 1, (self.pos - 1) % self.k))

    def kv_buffer(self, step: int, src: int) -> torch.Tensor:
        """Where the K/V that ``src`` forwards at ``step`` land (owner ``src - step``)."""
        n = geo.shard_tokens(self.p, (src - step) % self.k)
        return self.kv_own.new_empty((2, n, *self.kv_own.shape[2:]))

    def blocks(self, step: int) -> list[tuple[slice, slice, bool]]:
        return [_slices(b) for b in geo.ring_blocks(self.p, self.pos, (self.pos - step) % self.k)]


class RingForward(RingPosition):
    """Forward: running (out, lse) over the position's rows."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        q = self.q
        # lse = -inf makes the first merge of a row take the block as is
        # (sigmoid(+inf) = 1, logaddexp(-inf, x) = x).
        self.acc = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        self.lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)

    def compute(self, step: int, backend: AttentionBackend, scale: float) -> None:
        kv = self.kv(step)
        for qs, ks, causal in self.blocks(step):
            bo, bl = backend.forward(self.q[qs], kv[0, ks], kv[1, ks], causal=causal, scale=scale)
            update_out_and_lse(self.acc[qs], self.lse[:, qs], bo, bl)          # in place


class RingBackward(RingPosition):
    """Backward: dQ of the position's rows, and per step the dK/dV contribution
    to the owner whose K/V it held; dK/dV messages travel in ``wire``."""

    def __init__(self, index, placement, pos, q, k, v, received, dout, out, lse, wire: torch.dtype) -> None:
        super().__init__(index, placement, pos, q, k, v, received)
        self.dout, self.out, self.lse, self.wire = dout, out, lse, wire
        self.dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        self.contrib: dict[int, torch.Tensor] = {}

    def compute(self, step: int, backend: AttentionBackend, scale: float) -> None:
        kv = self.kv(step)
        contrib = torch.zeros(kv.shape, dtype=acc_dtype(self.q.dtype), device=kv.device)
        for qs, ks, causal in self.blocks(step):
            bq, bk, bv = backend.backward(self.dout[qs], self.q[qs], kv[0, ks], kv[1, ks], self.out[qs],
                                          self.lse[:, qs], causal=causal, scale=scale)
            self.dq[qs] += bq
            contrib[0, ks] += bk
            contrib[1, ks] += bv
        self.contrib[step] = contrib

    def dkv_parts(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What dK/dV sent at ``step`` adds up: this position's fp32 contribution
        of ``step - 1`` (dropped here) and what arrived with it (the earlier
        positions' contributions in ``wire``; None at step 1)."""
        own = self.contrib.pop(step - 1)
        if step - 1 == 0:
            return own, None
        return own, self.received(("dkv", self.index, step - 1, (self.pos - 1) % self.k))

    def dkv_buffer(self, step: int, src: int) -> torch.Tensor:
        n = geo.shard_tokens(self.p, (src - step + 1) % self.k)
        return torch.empty((2, n, *self.kv_own.shape[2:]), dtype=self.wire, device=self.q.device)

    def grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of the position's rows, once the last dK/dV has arrived."""
        dkv = self.received(("dkv", self.index, self.k, (self.pos - 1) % self.k))
        return self.dq.to(self.q.dtype), dkv[0].to(self.q.dtype), dkv[1].to(self.q.dtype)
