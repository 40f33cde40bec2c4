"""plan_process.py: the child's Plans are the in-process Plans, a planner's
InfeasibleError crosses as InfeasibleError, a dead child is one clear error."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan_process import PlanFn, PlanningProcess
from megatron_zeppelin.topology import load_cluster, plan_topology

BATCHES = ([400, 120, 90, 60], [300, 300, 300, 100], [1000, 50], [70] * 12)


@pytest.fixture(scope="module")
def plan_fn():
    cluster = load_cluster("cpu-sim")
    cluster = dataclasses.replace(cluster, topology=plan_topology(cluster.topology, 4, 1, 0))
    return PlanFn("zeppelin", CostModel(cluster, load_model("tiny")), 300, remap=True, time_limit_s=5.0, decide=True)


@pytest.fixture(scope="module")
def child(plan_fn):
    planning = PlanningProcess(plan_fn)   # one spawned child (~2 s) for the module's tests
    yield planning
    planning.close()


def test_the_childs_plans_are_the_in_process_plans(plan_fn, child):
    for lens in BATCHES:
        got, want = child(lens), plan_fn(lens)
        assert got == want and got.to_json() == want.to_json()


def test_infeasible_in_the_child_is_infeasible_here_and_the_child_plans_on(child):
    with pytest.raises(InfeasibleError, match="more than the whole cluster holds"):
        child([5000])
    assert list(child(BATCHES[0]).seq_lens) == BATCHES[0]


def test_a_killed_child_is_one_clear_error_not_a_hang(plan_fn):
    planning = PlanningProcess(plan_fn)
    planning(BATCHES[0])
    (pid,) = planning._pool._processes
    os.kill(pid, signal.SIGKILL)
    for _ in range(2):    # the call that finds it dead, and every later one
        with pytest.raises(RuntimeError, match=r"planning process \(--zeppelin-prefetch process\) died"):
            planning(BATCHES[0])
    planning.close()


def test_only_a_picklable_plan_fn_runs_in_a_child():
    with pytest.raises(TypeError, match="runs a PlanFn"):
        PlanningProcess(lambda lens: None)
