"""One schedule, two executors.

From a Plan (plus head shapes, dtypes and the topology) every rank derives the
same :class:`Schedule`: per rank, ordered ops on a compute lane and a
communication lane, each with explicit dependencies.  The attention engine
(``attention/executor.py``) executes it with real overlap; the simulator
(``sim/replay.py``) replays the very same ops with cost-model durations and link
contention.  Pure Python: no torch, so ``sim/`` stays importable without it.
"""

from megatron_zeppelin.schedule.ops import COMM, COMPUTE, Op, Schedule, ScheduleBuilder, ScheduleError
from megatron_zeppelin.schedule.routing import Hop, Phase, route_message, route_plan
from megatron_zeppelin.schedule.attention import AttnShape, attention_schedule
from megatron_zeppelin.schedule.step import StepShape, step_schedule

__all__ = ["COMM", "COMPUTE", "AttnShape", "Hop", "Op", "Phase", "Schedule", "ScheduleBuilder",
           "ScheduleError", "StepShape", "attention_schedule", "route_message", "route_plan",
           "step_schedule"]
