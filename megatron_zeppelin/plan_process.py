"""Planning in a child process: ``seq_lens -> Plan`` off the interpreter lock.

A planning *thread* (``prefetch.py``) shares the interpreter lock with the thread
that launches the step's kernels: ``benchmarks/planning_interference.py``
measured a launch-bound host loop several times slower while it plans.  A child
process has its own interpreter; the caller's thread only waits on it (the lock
released) and then receives the Plan as a :class:`~megatron_zeppelin.plan.compact.CompactPlan`
(a few flat arrays: a few objects to unpickle, one per placement and span to
rebuild, where a pickled Plan object set off the garbage collector's walks of
this process).

The child is started with ``spawn`` (a forked CUDA context is unusable): it
imports this torch-free module and the planner it names, and, as ``spawn``
does, the parent's main script's imports (torch under ``pretrain_gpt.py``:
1.4 s to the first Plan with a script importing torch, on the shared box);
it builds the planner and its context once, on its first batch.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.plan.compact import CompactPlan
from megatron_zeppelin.planner.base import PlanContext, get_planner
from megatron_zeppelin.planner.surrogate import surrogate_clock
from megatron_zeppelin.sim.timeline import replay_clock


@dataclass(frozen=True)
class PlanFn:
    """``seq_lens -> validated Plan`` (the linear layout is the attention layout
    without remap); picklable, so a child process can run it."""

    planner: str
    """Planner name (``planner.base.get_planner``)."""
    cost: CostModel
    """Cost model of the data-parallel cluster the Plans are for."""
    tokens_per_gpu: int
    """Token cap per rank."""
    remap: bool
    """Remap the linear layers' tokens (else the linear layout is the attention layout)."""
    time_limit_s: float
    """Planner's time limit per batch."""
    tp_size: int = 1
    """Tensor-parallel size (each data-parallel rank is a TP group)."""
    decide: bool = False
    """Pick each batch's plan by the modeled step, as the simulator does
    (``planner/zeppelin_decide.py``): routed or direct crossings, static CP's
    uniform layouts, and with ``remap`` whether this batch remaps; without it
    every batch remaps."""

    @cached_property
    def _planner_and_context(self) -> tuple[Any, PlanContext]:
        # Built on the first call where the function runs (in the child, once).
        ctx = PlanContext(cost=self.cost, tokens_per_gpu=self.tokens_per_gpu, time_limit_s=self.time_limit_s,
                          tp_size=self.tp_size, remap_enabled=self.remap, remap_decided=self.decide,
                          step_model=surrogate_clock(self.cost) if self.decide else None,
                          settle_model=replay_clock(self.cost) if self.decide else None)
        return get_planner(self.planner), ctx

    def __getstate__(self) -> dict:
        # The planner and its context are rebuilt where the function runs.
        return {k: v for k, v in self.__dict__.items() if k != "_planner_and_context"}

    def __call__(self, seq_lens: Sequence[int]) -> Plan:
        impl, ctx = self._planner_and_context
        return impl.plan(list(seq_lens), ctx).validate()


_child_plan_fn: PlanFn | None = None


def _install(plan_fn: PlanFn) -> None:
    global _child_plan_fn
    _child_plan_fn = plan_fn


def _plan_in_child(seq_lens: list[int]) -> CompactPlan:
    return CompactPlan.of(_child_plan_fn(seq_lens))  # type: ignore[misc]


class PlanningProcess:
    """``seq_lens -> Plan`` computed by one child process running ``plan_fn``.

    The child starts on the first call.  An error the planner raises there (e.g.
    ``InfeasibleError``, on which the sampler defers a piece) is raised here as
    the same type; a child that dies raises one clear ``RuntimeError``."""

    def __init__(self, plan_fn: PlanFn) -> None:
        if not isinstance(plan_fn, PlanFn):
            raise TypeError(f"a planning process runs a PlanFn (picklable), not {type(plan_fn).__name__}")
        self.plan_fn = plan_fn
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_install, initargs=(plan_fn,))

    def __call__(self, seq_lens: Sequence[int]) -> Plan:
        try:
            compact = self._pool.submit(_plan_in_child, [int(n) for n in seq_lens]).result()
        except BrokenProcessPool:
            raise RuntimeError("the planning process (--zeppelin-prefetch process) died (killed, or out of "
                               "memory?); rerun with --zeppelin-prefetch thread to plan in this process") from None
        return compact.plan()

    def close(self) -> None:
        """Stop the child (after the batch in flight, if any)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
