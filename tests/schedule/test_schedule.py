"""The schedule as pure data: what every op covers, what it waits for, and that
it fails at build time -- never as a hang -- when it cannot be run."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.schedule import (COMM, COMPUTE, AttnShape, Op, Schedule, ScheduleBuilder, ScheduleError,
                                        StepShape, attention_schedule, step_schedule)
from megatron_zeppelin.schedule.attention import Transport
from megatron_zeppelin.sim.replay import replay_schedule
from megatron_zeppelin.topology import Topology, load_cluster
from tests.attention.helpers import random_plan

TOPOS = [Topology(nodes=2, gpus_per_node=2, nics_per_node=1),
         Topology(nodes=2, gpus_per_node=4, nics_per_node=2),
         Topology(nodes=3, gpus_per_node=2, nics_per_node=2)]
SHAPE = AttnShape(q_heads=4, kv_heads=2, head_dim=8, itemsize=2, acc_itemsize=4, local_pack_tokens=1)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(range(len(TOPOS))), st.integers(1, 10), st.booleans(),
       st.booleans())
def test_ops_cover_every_pair_and_wait_only_backwards(seed, topo_index, n_seqs, backward, routed):
    topo = TOPOS[topo_index]
    plan = random_plan(random.Random(seed), topo, n_seqs)
    transport = Transport(topo, 0 if routed else math.inf)
    sched = attention_schedule(plan, SHAPE, transport, backward)
    assert all(d < op.id for op in sched.ops for d in op.deps)          # topological global order
    pairs = [0] * plan.world_size
    for op in sched.ops:
        if op.kind == COMPUTE:
            pairs[op.rank] += op.pairs
    assert pairs == plan.attn_pairs_per_rank()                          # exact coverage
    for rank in range(plan.world_size):
        lanes = sched.lanes(rank)
        for op in lanes.compute:                                        # a compute op waits only for
            for d in op.deps:                                           # what lands on its own rank
                dep = sched.ops[d]
                assert dep.kind == COMM and dep.peer == rank
        for op in lanes.comm:
            if op.rank == rank:                                         # a send waits only for its rank
                assert all(sched.ops[d].on(rank) for d in op.deps)
    if not routed:
        assert all(op.nic is None or op.nic == topo.nic_of(op.rank) for op in sched.ops if op.kind == COMM)


def test_ring_messages_travel_in_the_dtypes_they_are_sent_in():
    topo = TOPOS[1]
    from megatron_zeppelin.plan import Mode, placement
    from tests.attention.helpers import make_plan
    plan = make_plan(8, 4, [40], [placement(0, 40, Mode.RING, [0, 1, 4, 5])])
    kv_numel = SHAPE.kv_heads * SHAPE.head_dim
    fwd = attention_schedule(plan, SHAPE, Transport(topo), False)
    bwd = attention_schedule(plan, SHAPE, Transport(topo), True)
    kv = [op for op in fwd.ops if op.name == "kv"]
    dkv = [op for op in bwd.ops if op.name == "dkv"]
    # forward: 3 steps x 4 positions, each the K/V of 10 tokens in bf16
    assert len(kv) == 12 and all(op.nbytes == 2 * 10 * kv_numel * 2 for op in kv)
    # backward: K/V again, and dK/dV 4 steps behind in fp32
    assert len(dkv) == 16 and all(op.nbytes == 2 * 10 * kv_numel * 4 for op in dkv)
    # step s's compute on a position waits for the K/V that arrived at step s-1
    compute = {op.key: op for op in fwd.ops if op.kind == COMPUTE}
    for (_, index, pos, step), op in compute.items():
        srcs = {fwd.ops[d].rank for d in op.deps}
        assert srcs == (set() if step == 0 else {plan.attention[0].ranks[(pos - 1) % 4]})


@pytest.mark.parametrize("routed", [False, True])
def test_a_backward_ring_posts_its_next_kv_before_the_dkv_that_waits_for_the_kernel(routed):
    """A lane posts a wave as one batch, all of it once every send has its data:
    the K/V a step forwards must not share a wave with the dK/dV that waits for
    that step's kernel, or it would leave only after the kernel (no overlap)."""
    topo = Topology(nodes=2, gpus_per_node=4, nics_per_node=4)
    from megatron_zeppelin.plan import Mode, placement
    from tests.attention.helpers import make_plan
    plan = make_plan(8, 4, [80], [placement(0, 80, Mode.RING, [0, 1, 4, 5])])
    sched = attention_schedule(plan, SHAPE, Transport(topo, 0 if routed else math.inf), True)
    waves, ops = sched.waves(), sched.ops
    first_leg = {sched.messages[op.key[0]]: op for op in reversed(ops) if op.is_comm}   # the sender's own
    checked = 0
    for (kind, _, step, pos), op in first_leg.items():
        # The dK/dV a position sends at step s waits for its kernel of step s - 1, which
        # needs what the K/V it forwards at step s - 1 needs: that K/V goes in an earlier wave.
        kv = first_leg.get(("kv", 0, step - 1, pos))
        if kind == "dkv" and kv is not None:
            assert any(ops[d].kind == COMPUTE for d in op.deps)
            assert waves[kv.id] < waves[op.id]
            checked += 1
    assert checked == 4 * 3                          # dK/dV steps 1..3 of 4 positions


def test_routed_message_becomes_dispatch_nic_combine_hops():
    topo = Topology(nodes=2, gpus_per_node=4, nics_per_node=4)
    from megatron_zeppelin.plan import Mode, placement
    from tests.attention.helpers import make_plan
    plan = make_plan(8, 4, [16], [placement(0, 16, Mode.RING, [1, 6])])
    sched = attention_schedule(plan, SHAPE, Transport(topo, 0), False)
    assert {op.name for op in sched.ops if op.kind == COMM} == {"kv.dispatch", "kv.nic", "kv.combine"}
    for src in (1, 6):                                                  # each way, every NIC carries a piece
        nic_legs = [op for op in sched.ops if op.name == "kv.nic" and topo.node_of(op.rank) == topo.node_of(src)]
        assert sorted(op.nic for op in nic_legs) == [0, 1, 2, 3]
    for op in sched.ops:                                                # each leg waits for the one before
        if op.name == "kv.combine":
            (dep,) = op.deps
            assert sched.ops[dep].name == "kv.nic" and sched.ops[dep].peer == op.rank


def test_a_dependency_on_a_later_op_fails_at_build_time_with_the_ids():
    ops = (Op(0, COMPUTE, "local", "local_fwd", rank=0, deps=(1,)),
           Op(1, COMPUTE, "local", "local_fwd", rank=0, deps=(0,)))
    with pytest.raises(ScheduleError, match=r"op 0 \(local_fwd on rank 0\) depends on op\(s\) \[1\]"):
        Schedule(1, ops)
    with pytest.raises(ScheduleError, match="sends from rank 1 to itself"):
        Schedule(2, (Op(0, COMM, "intra", "kv", rank=1, peer=1),))
    b = ScheduleBuilder(2)
    a = b.add((1,), kind=COMPUTE, tier="local", name="x", rank=0)
    b.add((0,), [a], kind=COMPUTE, tier="local", name="y", rank=1)    # sorts before what it waits for
    with pytest.raises(ScheduleError, match=r"op 0 \(y on rank 1\) depends on op\(s\) \[1\]"):
        b.build()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(range(len(TOPOS))), st.integers(1, 10))
def test_step_segments_number_their_ops_like_the_engine(seed, topo_index, n_seqs):
    topo = TOPOS[topo_index]
    plan = random_plan(random.Random(seed), topo, n_seqs)
    transport = Transport(topo, 0)
    step = step_schedule(plan, StepShape(num_layers=2, attn=SHAPE, hidden_size=16), transport)
    for backward in (False, True):
        layer = attention_schedule(plan, SHAPE, transport, backward)
        base = step.segment_offsets[(1, backward, "attn")]
        for op in layer.ops:
            twin = step.schedule.ops[base + op.id]
            assert (twin.name, twin.rank, twin.peer, twin.key[1:] if op.kind == COMM else twin.key) == \
                (op.name, op.rank, op.peer, op.key[1:] if op.kind == COMM else op.key)
            assert {d + base for d in op.deps} <= set(twin.deps)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(range(len(TOPOS))), st.integers(1, 10))
def test_every_schedule_replays_to_the_end(seed, topo_index, n_seqs):
    # The lane rules can always make progress (no deadlock) whatever the durations.
    topo = TOPOS[topo_index]
    plan = random_plan(random.Random(seed), topo, n_seqs)
    cluster = load_cluster("cpu-sim")
    cost = CostModel(dataclasses.replace(cluster, topology=topo), load_model("tiny"))
    for backward in (False, True):
        sched = attention_schedule(plan, SHAPE, Transport(topo, 0), backward)
        assert replay_schedule(sched, cost).step_s > 0


def test_planning_packages_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import megatron_zeppelin.schedule, megatron_zeppelin.sim.replay, megatron_zeppelin.sim.cli\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_engine_imports_without_numba():
    # The engine reads schedules on the GPU machine, which carries no compiler
    # wheels (docs/gpu-check.md): only the simulator and the planners compile.
    code = ("import sys; sys.modules['numba'] = None\n"
            "import megatron_zeppelin.schedule, megatron_zeppelin.attention.engine, megatron_zeppelin.remap\n")
    subprocess.run([sys.executable, "-c", code], check=True)
