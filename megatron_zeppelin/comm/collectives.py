"""Small collectives over the default process group."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.plan.agreement import AllReduceMax


def torch_all_reduce_max(device: torch.device) -> AllReduceMax:
    """All-reduce (MAX) of a few int64 values over the default process group."""
    def reduce(values: Sequence[int]) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()
    return reduce
