"""The numerical oracle: plain data parallelism on the same global batch.

Whole sequences on ranks, token-balanced (longest first onto the least-loaded
rank), no per-rank token cap, plain attention with no communication.  Any other
strategy must reproduce its losses and gradients.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from megatron_zeppelin.plan import Mode, Plan, placement
from megatron_zeppelin.planner.base import same_layout_linear

STRATEGY = "reference"


def reference_plan(seq_lens: Sequence[int], world_size: int, gpus_per_node: int) -> Plan:
    """All-local Plan, sequences greedily balanced by tokens (ties: lowest rank)."""
    loads = [(0, r) for r in range(world_size)]
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    attention = []
    for seq in order:
        load, rank = heapq.heappop(loads)
        attention.append(placement(seq, seq_lens[seq], Mode.LOCAL, [rank]))
        heapq.heappush(loads, (load + seq_lens[seq], rank))
    attention.sort(key=lambda p: p.seq)
    return Plan(strategy=STRATEGY, world_size=world_size, gpus_per_node=gpus_per_node,
                seq_lens=tuple(seq_lens), attention=tuple(attention),
                linear=same_layout_linear(world_size, attention)).validate()
