"""Direct communicator: every message is one point-to-point transfer.

A cross-node message leaves through the NIC of the *sender's* GPU
(``Topology.nic_of``), which is where its bytes are counted.  It is the lane
communicator (``comm/rounds.py``) with routing off.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch.distributed as dist

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.comm.lanes import CommTimeoutError
from megatron_zeppelin.comm.rounds import LaneCommunicator
from megatron_zeppelin.topology import Topology

__all__ = ["CommTimeoutError", "DirectCommunicator"]


class DirectCommunicator(LaneCommunicator):
    """Point-to-point transfers with ``torch.distributed``, never routed."""

    def __init__(self, group: dist.ProcessGroup | None, topology: Topology,
                 counters: ByteCounters | None = None, *, timeout: timedelta | None = None, **kwargs) -> None:
        super().__init__(group, topology, counters, math.inf, timeout=timeout, **kwargs)
