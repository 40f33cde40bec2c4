"""The communicator's groups beside Megatron-Core's data-parallel group."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from megatron_zeppelin.comm.groups import LaneGroups, data_parallel_lane_groups
from megatron_zeppelin.errors import ConfigError


def data_parallel_comm_groups(tp: int, dp: int, timeout: timedelta | None = None) -> LaneGroups:
    """Copies of this rank's data-parallel group for the communicator's lanes
    (collective), after checking that Megatron's data-parallel group has the
    TP-fastest order the copies assume."""
    from megatron.core import parallel_state as mpu

    groups = data_parallel_lane_groups(tp, dp, timeout)
    if dist.get_process_group_ranks(mpu.get_data_parallel_group()) != groups.ranks():
        raise ConfigError("Megatron's data-parallel group is not ordered tensor-parallel-fastest; run "
                          "with the default --rank-order / parallelism order (tp-cp-ep-dp-pp)")
    return groups
