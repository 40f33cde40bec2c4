"""A rank's attention schedule (``attention_schedule(..., rank=r)``, what the
engine runs) is the projection onto ``r`` of the whole schedule the simulator
replays: the same ops in the same order, with the same waves, message ids and
bindings, bytes and wire tags -- for local sequences, intra- and inter-node
rings (routed through proxies that are no member of the ring), Ulysses groups,
the plan's packed rings and groups, and the recorded plans of every kind."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.plan import Plan, rings_by_ranks, ulysses_by_ranks
from megatron_zeppelin.schedule import COMM, AttnShape, Schedule, attention_schedule
from megatron_zeppelin.schedule.attention import Transport
from megatron_zeppelin.sim.timeline import step_shape, transport_of
from megatron_zeppelin.topology import Topology
from tests.attention.helpers import random_plan
from tests.plan.test_compact import CASES
from tests.schedule.test_schedule_digests import _cost

TOPOS = [Topology(nodes=2, gpus_per_node=2, nics_per_node=1),
         Topology(nodes=2, gpus_per_node=4, nics_per_node=2),
         Topology(nodes=3, gpus_per_node=4, nics_per_node=4)]
SHAPE = AttnShape(q_heads=4, kv_heads=2, head_dim=8, itemsize=2, acc_itemsize=4, local_pack_tokens=16)


def assert_projection(full: Schedule, mine: Schedule, rank: int) -> None:
    ids = [op.id for op in full.ops if op.on(rank)]
    new_id = {i: j for j, i in enumerate(ids)}
    assert len(mine) == len(ids), (rank, len(mine), len(ids))
    waves, tags, my_tags = full.waves(), full.pair_tags(rank), mine.pair_tags(rank)
    for j, i in enumerate(ids):
        op, got = full.ops[i], mine.ops[j]
        assert dataclasses.replace(op, id=j, deps=()) == dataclasses.replace(got, deps=()), (rank, i)
        receive = op.kind == COMM and op.peer == rank
        assert got.deps == tuple(new_id[d] for d in op.deps if not receive or d in new_id), (rank, i)
        assert mine.wave(j) == waves[i]
        if op.kind == COMM:
            assert my_tags[j] == tags[i]
    carried = {full.ops[i].key[0] for i in ids if full.ops[i].kind == COMM}
    assert mine.messages == {m: full.messages[m] for m in carried}
    keys = lambda batches: {lane: [[o.key for o in w] for w in ws] for lane, ws in batches.items()}  # noqa: E731
    assert keys(mine.wave_batches(rank)) == keys(full.wave_batches(rank))


def check_every_rank(plan: Plan, shape: AttnShape, transport: Transport) -> None:
    for backward in (False, True):
        full = attention_schedule(plan, shape, transport, backward)
        for rank in range(plan.world_size):
            assert_projection(full, attention_schedule(plan, shape, transport, backward, rank), rank)


def variants(plan: Plan) -> list[Plan]:
    """The plan, and with its rings and Ulysses groups on the same ranks packed."""
    return [plan, dataclasses.replace(plan, packed_rings=rings_by_ranks(plan.attention),
                                      packed_ulysses=ulysses_by_ranks(plan.attention)).validate()]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(range(len(TOPOS))), st.integers(1, 10), st.booleans(),
       st.booleans())
def test_a_ranks_schedule_is_its_projection_of_the_whole(seed, topo_index, n_seqs, routed, packed):
    topo = TOPOS[topo_index]
    plan = variants(random_plan(random.Random(seed), topo, n_seqs))[packed]
    check_every_rank(plan, SHAPE, Transport(topo, 0 if routed else math.inf))


def test_a_proxy_relays_pieces_of_a_ring_it_is_no_member_of():
    """The projection holds a routed ring's legs through a rank outside the ring."""
    topo = TOPOS[2]
    transport = Transport(topo, 0)
    for seed in range(50):
        plan = random_plan(random.Random(seed), topo, 6)
        full = attention_schedule(plan, SHAPE, transport, True)
        members = {r for p in plan.attention for r in p.ranks}
        proxies = {r for op in full.ops if op.kind == COMM for r in (op.rank, op.peer)} - members
        if proxies:
            rank = min(proxies)
            assert_projection(full, attention_schedule(plan, SHAPE, transport, True, rank), rank)
            assert len(attention_schedule(plan, SHAPE, transport, True, rank)) > 0
            return
    pytest.fail("no random plan routed through a non-member")


@pytest.mark.parametrize("index", [i for i, case in enumerate(CASES) if case["plan"]["world_size"] <= 16])
def test_every_recorded_plan_projects_onto_every_rank(index):
    case = CASES[index]
    cost = _cost(case)
    plan = Plan.from_dict(case["plan"]).validate()
    for p in variants(plan):
        check_every_rank(p, step_shape(cost, True).attn, transport_of(cost))
