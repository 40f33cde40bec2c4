"""A Zeppelin plan with packed rings replays as te_cp's, one with packed Ulysses
groups as flexsp's: the same schedule, so the simulator times what the engine
now runs (under ring_grad_dtype fp32 only TE's bf16 dK/dV differ)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_zeppelin.plan import rings_by_ranks, ulysses_by_ranks
from megatron_zeppelin.sim.timeline import step_parts, step_timeline
from tests.sim.test_timeline import RING, ULYSSES, make_cost, make_plan

LENS = [8192, 4096, 2048, 1000]
PLACES = [(RING, (0, 2)), (RING, (0, 2)), (RING, (2, 0)), (RING, (0, 2))]


def test_packed_rings_replay_as_te_cp_under_the_model_ring_grad_dtype():
    cost = make_cost()
    fp32 = dataclasses.replace(cost, ring_grad_dtype="fp32")
    plan = make_plan(cost, LENS, PLACES)
    packed = dataclasses.replace(plan, strategy="zeppelin", packed_rings=rings_by_ranks(plan.attention)).validate()
    te = dataclasses.replace(plan, strategy="te_cp")
    assert packed.packed_rings == ((0, 1, 3),)           # (2, 0) is another ring order: not packed with them

    def ops(p, c, **kw):
        return [[(o.kind, o.rank, o.peer, o.nbytes, o.pairs, o.block, o.deps) for o in s.ops]
                for _, *segs in step_parts(p, c, **kw) for s in segs]

    # Under ring_grad_dtype model (the default: TE's dK/dV bytes) the engine's
    # packed plan is te_cp's schedule, op for op, and its step.
    assert cost.ring_grad_dtype == "model"
    assert ops(packed, cost) == ops(te, cost, pack=True)
    assert step_timeline(packed, cost).step_s == step_timeline(te, cost).step_s
    # fp32 dK/dV cost the engine more (te_cp keeps TE's); unpacked rings time differently.
    assert ops(te, fp32, pack=True) == ops(te, cost, pack=True)
    assert step_timeline(packed, fp32).step_s > step_timeline(te, fp32).step_s
    assert step_timeline(packed, cost).step_s != pytest.approx(step_timeline(dataclasses.replace(
        packed, packed_rings=()), cost).step_s)


def test_packed_ulysses_groups_replay_as_flexsp():
    cost = make_cost()
    plan = make_plan(cost, LENS, [(ULYSSES, (0, 2)), (ULYSSES, (0, 2)), (ULYSSES, (2, 0)), (ULYSSES, (0, 2))])
    packed = dataclasses.replace(plan, strategy="zeppelin", packed_ulysses=ulysses_by_ranks(plan.attention)).validate()
    flexsp = dataclasses.replace(plan, strategy="flexsp")
    assert packed.packed_ulysses == ((0, 1, 3),)

    def ops(p, **kw):
        return [[(o.kind, o.rank, o.peer, o.nbytes, o.pairs, o.block, o.deps) for o in s.ops]
                for _, *segs in step_parts(p, cost, **kw) for s in segs]

    assert ops(packed) == ops(flexsp, pack=True)
    assert step_timeline(packed, cost).step_s == step_timeline(flexsp, cost).step_s
    unpacked = dataclasses.replace(packed, packed_ulysses=())
    assert ops(unpacked) != ops(packed)
    assert step_timeline(unpacked, cost).step_s != pytest.approx(step_timeline(packed, cost).step_s)
