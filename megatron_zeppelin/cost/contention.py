"""Links of concurrent inter-node rings: who shares which NIC.

Every rank runs its inter-node rings first, so the rings that cross nodes
transfer at the same time.  A ring step crosses each node boundary once; the
boundary's sender uses its own NIC (direct) or all NICs of its node (routed).
Rings whose crossings share a NIC (direct) or a node's NICs (routed) split
that bandwidth: a ring gets the share of its most contended crossing.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from megatron_zeppelin.cost.model import CostModel
from megatron_zeppelin.topology import LinkSpec


def crossings(cost: CostModel, ranks: Sequence[int]) -> list[int]:
    """Senders of the ring steps over ``ranks`` that leave their node."""
    topo = cost.cluster.topology
    k = len(ranks)
    return [ranks[i] for i in range(k) if not topo.same_node(ranks[i], ranks[(i + 1) % k])]


def ring_links(cost: CostModel, rings: Sequence[tuple[Sequence[int], float]]) -> list[LinkSpec]:
    """Link of each ring ``(ranks, bytes one rank sends per step)``, all running
    at once: NVLink inside a node; across nodes the faster of direct and routed
    (:meth:`CostModel.crossing_link`) under the ring's worst NIC sharing."""
    topo = cost.cluster.topology
    senders = [crossings(cost, ranks) for ranks, _ in rings]
    per_nic = Counter((topo.node_of(s), topo.nic_of(s)) for ss in senders for s in ss)
    per_node = Counter(topo.node_of(s) for ss in senders for s in ss)
    links = []
    for (ranks, step_bytes), ss in zip(rings, senders):
        if not ss:
            links.append(cost.cluster.nvlink)
            continue
        direct = max(per_nic[(topo.node_of(s), topo.nic_of(s))] for s in ss)
        routed = max(per_node[topo.node_of(s)] for s in ss)
        links.append(cost.crossing_link(step_bytes, direct, routed))
    return links
