"""Point-to-point transfers of ``torch.distributed``, posted a batch at a time.

A lane posts the transfers of one wave together (``comm/lanes.py``).  On NCCL
they go through ``batch_isend_irecv`` on the group's own communicator: plain
``isend``/``irecv`` would lazily build a 2-rank communicator per peer pair, a
blocking initialisation inside the lane (and O(DP) of them), and would run each
transfer on its own.  Gloo has no such communicators and posts them one by one.
Completion is the backend's: ``work.wait()`` blocks the host on gloo, and orders
the caller's current stream after the transfer on NCCL.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist


class Transfer(NamedTuple):
    """One side of one transfer, as a lane posts it."""

    send: bool
    """True: ``tensor`` goes to ``peer``; False: it is filled from ``peer``."""
    tensor: torch.Tensor
    peer: int
    """The peer's rank in the lane's group."""
    tag: int


class TorchP2P:
    """Transfers between ranks of ``group`` (None: the world)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._global = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(dist.get_world_size(group))]
        self._batched = dist.get_backend(group) == "nccl"

    def post(self, transfers: Sequence[Transfer]) -> list:
        """Post ``transfers`` together; one work per transfer, in order."""
        if self._batched:
            ops = [dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, self._global[t.peer], self.group,
                              t.tag) for t in transfers]
            works = dist.batch_isend_irecv(ops)
            # A coalesced batch may hand back one work for all its transfers.
            return works if len(works) == len(ops) else [works[-1]] * len(ops)
        return [(dist.isend if t.send else dist.irecv)(t.tensor, self._global[t.peer], self.group, t.tag)
                for t in transfers]
