"""A Plan as a few flat integer arrays: how a planning child hands one over.

Pickling a Plan object sends every placement, span and tuple as its own
object, and unpickling rebuilds them all.  A :class:`CompactPlan` pickles as
a handful of arrays, and :meth:`CompactPlan.plan` rebuilds the Plan with one
object per placement and per linear span: each shard tuple comes from the
shard cache (``plan._shards``, the canonical shards a validated Plan holds),
each local placement's rank tuple is shared.  At 1,024 GPUs that leaves the
receiving process's garbage collector 35k objects to track instead of 51k and
cuts receiving from 176 to 75 ms of CPU, collector on
(``docs/results/planning_interference.md``); most of what is left is the
collector's full passes, which every surviving object of a Plan pays for.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan.plan import Mode, Plan, SeqPlacement, Span, _shards

_MODES = (Mode.LOCAL, Mode.RING, Mode.ULYSSES)
_MODE_CODE = {mode: code for code, mode in enumerate(_MODES)}


@dataclass(frozen=True)
class CompactPlan:
    """A validated Plan's fields as flat arrays (``Plan`` documents each field);
    :meth:`of` packs one, :meth:`plan` rebuilds it equal, field for field."""

    strategy: str
    """``Plan.strategy``."""
    world_size: int
    """``Plan.world_size``."""
    gpus_per_node: int
    """``Plan.gpus_per_node``."""
    token_cap: int | None
    """``Plan.token_cap``."""
    routed: bool
    """``Plan.routed``."""
    seq_lens: np.ndarray
    """``Plan.seq_lens``."""
    placement_seq: np.ndarray
    """``attention[i].seq``, in plan order."""
    placement_mode: np.ndarray
    """``attention[i].mode``: 0 local, 1 ring, 2 ulysses."""
    placement_size: np.ndarray
    """``len(attention[i].ranks)``."""
    placement_ranks: np.ndarray
    """Every placement's ranks, in order, back to back (shards are not sent: a
    validated Plan's are the canonical ones of its mode, length and size)."""
    linear_count: np.ndarray
    """``len(linear[r])`` for every rank."""
    linear_spans: np.ndarray
    """``[n, 3]``: every rank's linear spans (seq, start, end), ranks in order."""
    packed_rings: tuple[tuple[int, ...], ...]
    """``Plan.packed_rings`` (a few short tuples)."""
    packed_ulysses: tuple[tuple[int, ...], ...]
    """``Plan.packed_ulysses``."""
    fingerprint: int
    """``Plan.fingerprint()``, computed where the Plan was made (the rebuilt Plan
    equals it, so the plan check's all-reduce costs the training thread no JSON)."""
    remap_pairs: np.ndarray
    """``[n, 3]``: ``Plan.remap_pairs()``, computed where the Plan was made (every
    rank's switch numbers its messages by them; making them walks every rank's moves)."""

    @classmethod
    def of(cls, plan: Plan) -> "CompactPlan":
        """``plan`` packed; raises :class:`PlanError` for shards a validated Plan
        cannot hold (they would not survive the trip)."""
        lens = plan.seq_lens
        for p in plan.attention:
            canonical = _shards(p.mode, lens[p.seq], len(p.ranks))
            if p.shards is not canonical and p.shards != canonical:
                raise PlanError(f"plan: sequence {p.seq} has non-canonical shards {p.shards}; "
                                "validate() the Plan before sending it")
        return cls(
            strategy=plan.strategy, world_size=plan.world_size, gpus_per_node=plan.gpus_per_node,
            token_cap=plan.token_cap, routed=plan.routed,
            seq_lens=np.array(lens, dtype=np.int64),
            placement_seq=np.array([p.seq for p in plan.attention], dtype=np.int64),
            placement_mode=np.array([_MODE_CODE[p.mode] for p in plan.attention], dtype=np.int8),
            placement_size=np.array([len(p.ranks) for p in plan.attention], dtype=np.int64),
            placement_ranks=np.array([r for p in plan.attention for r in p.ranks], dtype=np.int64),
            linear_count=np.array([len(spans) for spans in plan.linear], dtype=np.int64),
            linear_spans=np.array([(sp.seq, sp.start, sp.end) for spans in plan.linear for sp in spans],
                                  dtype=np.int64).reshape(-1, 3),
            packed_rings=plan.packed_rings, packed_ulysses=plan.packed_ulysses, fingerprint=plan.fingerprint(),
            remap_pairs=np.array(plan.remap_pairs(), dtype=np.int64).reshape(-1, 3))

    def plan(self) -> Plan:
        """The Plan, rebuilt (not validated again: it was before :meth:`of`)."""
        lens = self.seq_lens.tolist()
        seqs = self.placement_seq.tolist()
        sizes = self.placement_size.tolist()
        modes = list(map(_MODES.__getitem__, self.placement_mode.tolist()))
        flat = self.placement_ranks.tolist()
        starts = [0, *accumulate(sizes)]
        # One shared (r,) per rank for the single-rank placements (most of a batch);
        # the few groups slice theirs.
        single = [(r,) for r in range(self.world_size)]
        ranks = list(map(single.__getitem__, self.placement_ranks[np.asarray(starts[:-1], dtype=np.int64)].tolist()))
        for i in np.flatnonzero(self.placement_size > 1).tolist():
            ranks[i] = tuple(flat[starts[i]:starts[i + 1]])
        shards = map(_shards, modes, map(lens.__getitem__, seqs), sizes)
        attention = tuple(map(SeqPlacement, seqs, modes, ranks, shards))
        q, s, e = self.linear_spans.T.tolist() if len(self.linear_spans) else ([], [], [])
        spans = list(map(Span, q, s, e))
        bounds = [0, *accumulate(self.linear_count.tolist())]
        linear = tuple(tuple(spans[a:b]) for a, b in zip(bounds, bounds[1:]))
        plan = Plan(strategy=self.strategy, world_size=self.world_size, gpus_per_node=self.gpus_per_node,
                    seq_lens=tuple(lens), attention=attention, linear=linear, token_cap=self.token_cap,
                    routed=self.routed, packed_rings=self.packed_rings, packed_ulysses=self.packed_ulysses)
        object.__setattr__(plan, "_fingerprint", self.fingerprint)     # Plan.fingerprint's cache
        object.__setattr__(plan, "_remap_pairs", tuple(map(tuple, self.remap_pairs.tolist())))   # remap_pairs'
        return plan
