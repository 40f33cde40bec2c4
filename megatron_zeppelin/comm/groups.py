"""The process groups a data-parallel rank's communicator runs on.

The engine's transfers get groups of their own, apart from Megatron's data-parallel
group, so that its worker threads never interleave with the gradient all-reduce.
On NCCL each lane (``comm/lanes.py``) gets its own group too: a communicator runs
its transfers on one internal stream in posting order, so with one group an
intra-node wave would queue behind an inter-node one.  Gloo has no such stream,
and both lanes share one group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class LaneGroups:
    """This rank's groups over its data-parallel ranks (those of its TP rank)."""

    intra: dist.ProcessGroup
    """The communicator's group: intra-node transfers, and everything on gloo."""
    inter: dist.ProcessGroup | None
    """NCCL: a second communicator over the same ranks for inter-node transfers
    (None on gloo)."""

    def ranks(self) -> list[int]:
        """The group's global ranks, data-parallel rank order."""
        return dist.get_process_group_ranks(self.intra)


def data_parallel_lane_groups(tp: int, dp: int, timeout: timedelta | None = None) -> LaneGroups:
    """Groups over the data-parallel ranks of each TP rank (TP-fastest rank order),
    this rank's returned.  Collective: every rank calls it, in the same order.
    ``timeout``: the groups' own (``new_group``'s default is 30 minutes, not the world's)."""
    def groups() -> list[dist.ProcessGroup]:
        return [dist.new_group([d * tp + t for d in range(dp)], timeout=timeout) for t in range(tp)]

    mine = dist.get_rank() % tp
    intra = groups()[mine]
    inter = groups()[mine] if dist.get_backend() == "nccl" else None
    return LaneGroups(intra, inter)
