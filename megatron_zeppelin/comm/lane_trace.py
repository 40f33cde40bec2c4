"""Executed times of a rank's ops, per call, for ``--dump-trace``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megatron_zeppelin.schedule.ops import Schedule


@dataclass
class OpTrace:
    """Executed times of this rank's ops in one call (monotonic nanoseconds: one
    clock for every process of a machine), for ``--dump-trace``.  On CUDA these
    are the host's enqueue and completion-seen times, not kernel times."""

    ops: int
    """This rank's ops in the call's schedule (what the step schedule's segment
    must hold on this rank)."""
    start_ns: dict[int, int] = field(default_factory=dict)
    """Op's index among this rank's ops of the call, in op order (its id in the
    rank's projection, ``Schedule.own_index``) -> when it started here
    (compute: kernel start; send: post)."""
    end_ns: dict[int, int] = field(default_factory=dict)
    """The same index -> when it ended here (compute: kernel end; receive: landed)."""
    begin_ns: int = 0
    """When the call began on this rank."""
    finish_ns: int = 0
    """When the call returned on this rank (every lane done)."""


class StepRecorder:
    """Every call of one step, in call order, with the times of this rank's ops."""

    def __init__(self) -> None:
        self.calls: list[OpTrace] = []
        self.marks: dict[str, int] = {}
        """Named instants of the step (e.g. ``backward_begin``), monotonic ns."""

    def new_call(self, schedule: Schedule, rank: int) -> OpTrace:
        trace = OpTrace(len(schedule.own_index(rank)), begin_ns=time.monotonic_ns())
        self.calls.append(trace)
        return trace

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic_ns()
