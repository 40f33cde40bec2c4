"""A Plan as a few flat integer arrays: how a planning child hands one over.

Pickling a Plan object sends every placement, span and tuple as its own
object, and unpickling rebuilds them all: at 1,024 GPUs ~51k objects, which
the receiving process's cyclic collector then walks in every full pass for as
long as the Plan lives.  A :class:`CompactPlan` pickles as a handful of
arrays, and :meth:`CompactPlan.plan` makes a Plan that keeps them
(``plan/columns.py``): its placements and spans are made when a reader asks
for them, and a training rank asks for its own and the rings' and Ulysses
groups' only (``docs/results/planning_interference.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan.columns import PlacementColumns, Placements, RankSpans, SpanColumns
from megatron_zeppelin.plan.placement import canonical_shards
from megatron_zeppelin.plan.plan import Plan


@dataclass(frozen=True)
class CompactPlan:
    """A validated Plan's fields as flat arrays (``Plan`` documents each field);
    :meth:`of` packs one, :meth:`plan` makes a Plan equal to it, field for field."""

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
    placements: PlacementColumns
    """``Plan.attention`` as columns (shards are not sent: a validated Plan's
    are the canonical ones of its mode, length and size)."""
    spans: SpanColumns
    """``Plan.linear`` as columns."""
    packed_rings: tuple[tuple[int, ...], ...]
    """``Plan.packed_rings`` (a few short tuples)."""
    packed_ulysses: tuple[tuple[int, ...], ...]
    """``Plan.packed_ulysses``."""
    fingerprint: int
    """``Plan.fingerprint()``, computed where the Plan was made (the received Plan
    equals it, so the plan check's all-reduce costs the training thread no JSON)."""
    remap_pairs: np.ndarray
    """``[n, 3]``: ``Plan.remap_pairs()``, computed where the Plan was made (every
    rank's switch numbers its messages by them; making them walks every rank's moves)."""

    @classmethod
    def of(cls, plan: Plan) -> "CompactPlan":
        """``plan`` packed; raises :class:`PlanError` for shards a validated Plan
        cannot hold (they would not survive the trip)."""
        lens = plan.seq_lens
        if not isinstance(plan.attention, Placements):    # a received Plan's are canonical by construction
            for p in plan.attention:
                canonical = canonical_shards(p.mode, lens[p.seq], len(p.ranks))
                if p.shards is not canonical and p.shards != canonical:
                    raise PlanError(f"plan: sequence {p.seq} has non-canonical shards {p.shards}; "
                                    "validate() the Plan before sending it")
        return cls(
            strategy=plan.strategy, world_size=plan.world_size, gpus_per_node=plan.gpus_per_node,
            token_cap=plan.token_cap, routed=plan.routed, seq_lens=np.array(lens, dtype=np.int64),
            placements=plan.placement_columns(), spans=plan.span_columns(),
            packed_rings=plan.packed_rings, packed_ulysses=plan.packed_ulysses, fingerprint=plan.fingerprint(),
            remap_pairs=np.array(plan.remap_pairs(), dtype=np.int64).reshape(-1, 3))

    def plan(self) -> Plan:
        """The Plan, on these arrays (not validated again: it was before :meth:`of`)."""
        lens = tuple(self.seq_lens.tolist())
        plan = Plan(strategy=self.strategy, world_size=self.world_size, gpus_per_node=self.gpus_per_node,
                    seq_lens=lens, attention=Placements(self.placements, lens), linear=RankSpans(self.spans),
                    token_cap=self.token_cap, routed=self.routed, packed_rings=self.packed_rings,
                    packed_ulysses=self.packed_ulysses)
        object.__setattr__(plan, "_fingerprint", self.fingerprint)     # Plan.fingerprint's cache
        object.__setattr__(plan, "_remap_pairs", tuple(map(tuple, self.remap_pairs.tolist())))   # remap_pairs'
        return plan
