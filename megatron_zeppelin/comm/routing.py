"""Routed communicator: cross-node messages spread over every NIC of the node.

The routes themselves (dispatch -> NIC -> combine through proxy GPUs) are
pure and live in ``schedule/routing.py``: every rank derives the same hops, and
the schedule makes each hop an op, so a proxy forwards a piece as an op of its
own lanes -- without involving its caller, and without any rank that takes no
part in a transfer waiting for it.  This module is the lane communicator
(``comm/rounds.py``) with routing on, plus the exact byte prediction.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.comm.lanes import CommTimeoutError
from megatron_zeppelin.comm.rounds import LaneCommunicator
from megatron_zeppelin.schedule.routing import Hop, Phase, min_routed_bytes, route_plan
from megatron_zeppelin.topology import Topology

__all__ = ["Hop", "Phase", "RoutedCommError", "RoutedCommunicator", "hop_bytes", "min_routed_bytes",
           "route_plan"]

RoutedCommError = CommTimeoutError
"""A routed transfer did not complete (a peer died, or ranks disagree on a round)."""


def hop_bytes(hops: Sequence[Hop], rank: int) -> ByteCounters:
    """Bytes ``rank`` puts on each link class for ``hops`` (what the communicator
    counts; the simulator and tests use it as the prediction)."""
    out = ByteCounters()
    for h in hops:
        if h.src != rank or h.src == h.dst:
            continue
        if h.nic is None:
            out.intra_node += h.nbytes
        else:
            out.inter_node_per_nic[h.nic] = out.inter_node_per_nic.get(h.nic, 0) + h.nbytes
    return out


class RoutedCommunicator(LaneCommunicator):
    """Routes every cross-node message of at least ``min_routed_bytes`` over all
    NICs of the node (pass the cost model's :func:`min_routed_bytes`)."""

    def __init__(self, group: dist.ProcessGroup | None, topology: Topology,
                 counters: ByteCounters | None = None, min_routed_bytes: float = 0.0, *,
                 dtype: torch.dtype | None = None, device: torch.device | None = None,
                 timeout: timedelta | None = None, **kwargs) -> None:
        super().__init__(group, topology, counters, min_routed_bytes, dtype=dtype, device=device,
                         timeout=timeout, **kwargs)
