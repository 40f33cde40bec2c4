"""Zeppelin's hierarchical sequence partitioning (EuroSys'26).

Every sequence of the global batch runs in one of three tiers: ``local`` (one
GPU), an intra-node ring (NVLink) or an inter-node ring (NICs, routed) -- or,
where the cost model prefers it, a Ulysses group.  The planner picks the tier
and size per sequence from the cost model and balances the ranks' modeled
attention time under the per-GPU token cap, at two levels: a group of at most
``gpus_per_node`` ranks goes into one *node bucket* (the node whose GPUs can
take it at the lowest load), then onto that node's least-loaded *GPU buckets*;
larger groups span nodes.

Inside a packing pass a rank's load is ``ulysses totals + max(sum of its
ring totals, ring + local compute)``, i.e. the ring totals plus whatever local
work does not fit into the rings' exposed communication; Ulysses all-to-alls
block.  With the remap layer the linear modules run on the token-balanced
layout of :mod:`.linear_layout`; without it on the attention layout itself, so
attention plus linear time is balanced.  The passes' finished plans are
compared by the replay's surrogate (``planner/surrogate.py``), the clock the
per-batch decision uses: the shortest step wins, ties going to the first
pass.  docs/planner.md explains the choices.
"""
from __future__ import annotations

from megatron_zeppelin.planner.zeppelin.loads import min_ring_size
from megatron_zeppelin.planner.zeppelin.planner import ZeppelinPlanner, check_feasible

__all__ = ["ZeppelinPlanner", "check_feasible", "min_ring_size"]
