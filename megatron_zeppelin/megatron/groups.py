"""The communicator's groups beside Megatron-Core's data-parallel group."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from megatron_zeppelin.comm.groups import LaneGroups, data_parallel_lane_groups
from megatron_zeppelin.errors import ConfigError


def data_parallel_comm_groups(tp: int, dp: int, timeout: timedelta | None = None, pp: int = 1) -> LaneGroups:
    """Copies of this rank's data-parallel group for the communicator's lanes
    (collective), after checking that Megatron's data-parallel group has the
    TP-fastest order the copies assume.  ``pp > 1``: the data-parallel ranks of
    this rank's pipeline stage (Megatron's order puts PP slowest)."""
    from megatron.core import parallel_state as mpu

    groups = data_parallel_lane_groups(tp, dp, timeout) if pp == 1 else _stage_lane_groups(tp, dp, pp, timeout)
    if dist.get_process_group_ranks(mpu.get_data_parallel_group()) != groups.ranks():
        raise ConfigError("Megatron's data-parallel group is not ordered tensor-parallel-fastest; run "
                          "with the default --rank-order / parallelism order (tp-cp-ep-dp-pp)")
    return groups


def _stage_lane_groups(tp: int, dp: int, pp: int, timeout: timedelta | None) -> LaneGroups:
    """:func:`~megatron_zeppelin.comm.groups.data_parallel_lane_groups` for every
    pipeline stage (ranks ``stage * dp * tp + d * tp + t``), this rank's returned.
    Collective: every rank creates every group, in the same order."""
    stage, t = dist.get_rank() // (dp * tp), dist.get_rank() % tp

    def mine() -> dist.ProcessGroup:
        groups = {(s, r): dist.new_group([s * dp * tp + d * tp + r for d in range(dp)], timeout=timeout)
                  for s in range(pp) for r in range(tp)}
        return groups[stage, t]

    intra = mine()
    return LaneGroups(intra, mine() if dist.get_backend() == "nccl" else None)
