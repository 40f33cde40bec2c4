"""Small collectives over the default process group."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.plan.agreement import AllReduceMax


def warm_up_nccl(group: dist.ProcessGroup | None) -> None:
    """Create ``group``'s NCCL communicator with every rank present (collective on NCCL).

    ``batch_isend_irecv``'s first call on a group must involve every rank of it: a
    first round between only some ranks would hang.  Every rank builds a
    communicator, so a barrier there is such a call.  Nothing to do on gloo."""
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group)


def torch_all_reduce_max(device: torch.device) -> AllReduceMax:
    """All-reduce (MAX) of a few int64 values over the default process group."""
    def reduce(values: Sequence[int]) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()
    return reduce
