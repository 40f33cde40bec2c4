"""Routes of the routing layer, as every rank derives them (pure).

Without routing, a message from a GPU on node A to a GPU on node B leaves
through the one NIC next to the sender; an inter-node ring therefore loads the
one or two NICs at its node boundary while the others idle.  Routed, such a
message is cut into ``P`` pieces (``P`` = NICs per node) and piece ``j`` travels
in three hops::

    dispatch   src    -> proxy_j   intra-node (skipped when src is on NIC j)
    nic        proxy_j -> peer_j   through NIC j (peer_j: proxy_j's local index on dst's node)
    combine    peer_j -> dst       intra-node (skipped when peer_j is dst)

Messages inside a node, and messages too small for the two extra hops to pay
(:func:`min_routed_bytes`), go direct.  The schedule turns every hop into a
transfer op, so proxies carry their forwarding as ops of their own lanes and
the simulator prices each leg on the link it uses.
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import NamedTuple, Sequence

from megatron_zeppelin.cost.model import CostModel
from megatron_zeppelin.plan.shards import chunk_bounds
from megatron_zeppelin.topology import Topology


class Phase(IntEnum):
    """Which leg of its route a hop is."""

    DIRECT = 0
    DISPATCH = 1
    NIC = 2
    COMBINE = 3


class Hop(NamedTuple):
    """One point-to-point transfer (a whole direct message or one leg of a piece).
    A named tuple: a schedule makes one per transfer op, 10^5 for a 64-GPU step."""

    msg: int
    """Message id."""
    piece: int
    """Piece index (0 for direct messages)."""
    phase: Phase
    """Leg of the route."""
    src: int
    """Sending rank."""
    dst: int
    """Receiving rank."""
    offset: int
    """First element of the message this hop carries."""
    numel: int
    """Elements carried."""
    nic: int | None
    """Sender's local NIC index when the hop leaves the node; None inside a node."""
    itemsize: int
    """Bytes per element of the message."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def min_routed_bytes(cost: CostModel) -> float:
    """Smallest message for which routing beats a direct NIC send under ``cost``.

    Routing adds two intra-node hops of latency and raises the bandwidth from
    one NIC to all of them (capped by the sender's NVLink dispatch); it pays
    once the bytes saved outweigh the latency: ``b * (1/B_direct - 1/B_routed)
    > lat_routed - lat_direct``.  ``inf`` when routing never pays (one NIC)."""
    gpn = cost.cluster.topology.gpus_per_node
    pair = [0, gpn]  # any two ranks on different nodes
    direct, routed = cost.routed(False).link_for(pair), cost.routed(True).link_for(pair)
    gain = 1 / (direct.bandwidth_GBps * 1e9) - 1 / (routed.bandwidth_GBps * 1e9)
    if gain <= 0:
        return math.inf
    return max(routed.latency_us - direct.latency_us, 0.0) * 1e-6 / gain


def route_message(msg: int, src: int, dst: int, numel: int, itemsize: int, topology: Topology,
                  min_routed_bytes: float) -> list[Hop]:
    """The hops of one message, each piece's chain in order (dispatch, nic, combine).

    Pieces are cut on element boundaries with :func:`chunk_bounds`; empty pieces
    and empty messages produce no hop.  (Node and NIC arithmetic inline: a
    64-GPU step routes 10^5 messages.)"""
    if numel == 0:
        return []
    P, gpn = topology.nics_per_node, topology.gpus_per_node
    node, dst_node = src // gpn, dst // gpn
    cross = node != dst_node
    if not cross or P == 1 or numel * itemsize < min_routed_bytes:
        return [Hop(msg, 0, Phase.DIRECT, src, dst, 0, numel, topology.nic_affinity[src % gpn] if cross else None,
                    itemsize)]
    hops = []
    bounds = chunk_bounds(numel, P)
    for j in range(P):
        lo, n = bounds[j], bounds[j + 1] - bounds[j]
        if n == 0:
            continue
        proxy = _proxy(topology, msg, src, dst, j)
        peer = dst_node * gpn + proxy % gpn
        if proxy != src:
            hops.append(Hop(msg, j, Phase.DISPATCH, src, proxy, lo, n, None, itemsize))
        hops.append(Hop(msg, j, Phase.NIC, proxy, peer, lo, n, j, itemsize))
        if peer != dst:
            hops.append(Hop(msg, j, Phase.COMBINE, peer, dst, lo, n, None, itemsize))
    return hops


def route_plan(messages: Sequence, topology: Topology, min_routed_bytes: float, *,
               itemsize: int) -> list[Hop]:
    """Every hop of a list of messages (objects with ``id, src, dst, numel,
    itemsize``; ``itemsize`` 0 takes the default ``itemsize``)."""
    hops: list[Hop] = []
    for m in messages:
        hops += route_message(m.id, m.src, m.dst, m.numel, m.itemsize or itemsize, topology,
                              min_routed_bytes)
    return hops


def _proxy(topology: Topology, msg: int, src: int, dst: int, nic: int) -> int:
    """The GPU of the sender's node that pushes piece ``nic`` through NIC ``nic``.

    The sender itself when it sits on that NIC (no dispatch hop); else the GPU
    whose twin on the destination node is the receiver (no combine hop); else
    one of the NIC's GPUs, rotated by message id so that concurrent messages
    share the proxies' NVLink ports."""
    gpn = topology.gpus_per_node
    base = src - src % gpn                     # the node's first rank
    on_nic = [base + local for local, n in enumerate(topology.nic_affinity) if n == nic]
    twin = base + dst % gpn
    for preferred in (src, twin):
        if preferred in on_nic:
            return preferred
    return on_nic[msg % len(on_nic)]
