"""plan/compact.py: a Plan packed into flat arrays, pickled (as the planning
child sends it) and rebuilt equals the original, field for field, in every
kind of plan: local, intra- and inter-node rings, Ulysses groups, packed rings
and packed Ulysses groups, remapped linear layouts, routed or not."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan import Mode, Plan, SeqPlacement, rings_by_ranks, ulysses_by_ranks
from megatron_zeppelin.plan.compact import CompactPlan
from megatron_zeppelin.planner.base import same_layout_linear
from megatron_zeppelin.schedule.step import step_schedule
from megatron_zeppelin.sim.timeline import step_shape, transport_of
from tests.plan.test_plan import random_plan
from tests.schedule.test_schedule_digests import _cost, digest

TESTS = Path(__file__).resolve().parent.parent
CASES = (json.loads((TESTS / "sim" / "golden" / "replay_steps.json").read_text())["cases"]
         + list(json.loads((TESTS / "schedule" / "golden" / "schedule_digests.json").read_text())["plans"].values()))


def round_trip(plan: Plan) -> Plan:
    return pickle.loads(pickle.dumps(CompactPlan.of(plan))).plan()


def assert_identical(got: Plan, plan: Plan) -> None:
    for f in dataclasses.fields(Plan):
        assert getattr(got, f.name) == getattr(plan, f.name), f.name
    assert got == plan and got.to_json() == plan.to_json()     # JSON: Python ints, not numpy's
    assert got.fingerprint() == Plan.from_json(plan.to_json()).fingerprint()     # the carried one is the Plan's
    assert all(type(n) is int for n in got.seq_lens)
    assert all(type(r) is int and type(p.seq) is int for p in got.attention for r in p.ranks)


def variants(plan: Plan) -> list[Plan]:
    """The plan, not routed, and with its rings and Ulysses groups on the same ranks packed."""
    packed = dataclasses.replace(plan, packed_rings=rings_by_ranks(plan.attention),
                                 packed_ulysses=ulysses_by_ranks(plan.attention)).validate()
    return [plan, dataclasses.replace(plan, routed=False), packed]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_every_recorded_plan_survives_the_trip(index):
    case = CASES[index]
    plan = Plan.from_dict(case["plan"]).validate()
    cost = _cost(case)
    shape = dataclasses.replace(step_shape(cost, True), num_layers=2)
    for p in variants(plan):
        got = round_trip(p)
        assert_identical(got, p)
        if plan.world_size <= 32:   # the same step, op for op
            assert (digest(step_schedule(got, shape, transport_of(cost)).schedule)
                    == digest(step_schedule(p, shape, transport_of(cost)).schedule))


def test_the_recorded_plans_hold_every_kind():
    plans = [v for case in CASES for v in variants(Plan.from_dict(case["plan"]))]
    kinds = {t for p in plans for t, n in dataclasses.asdict(p.tier_counts()).items() if n}
    assert kinds == {"local", "intra", "inter", "ulysses"}
    assert any(p.packed_rings for p in plans) and any(p.packed_ulysses for p in plans)
    assert any(not p.routed for p in plans) and any(p.token_cap is None for p in plans)
    assert any(p.remap_schedule() for p in plans)     # a remapped linear layout


@st.composite
def plans(draw):
    world = draw(st.sampled_from([2, 4, 8]))
    lens, placements = random_plan(draw, world, 2)
    plan = Plan("test", world, 2, tuple(lens), tuple(placements), same_layout_linear(world, placements))
    return draw(st.sampled_from(variants(plan)))


@settings(max_examples=60, deadline=None)
@given(plans())
def test_random_plans_survive_the_trip(plan):
    assert_identical(round_trip(plan), plan)


def test_a_plan_with_non_canonical_shards_is_refused():
    plan = Plan("test", 2, 2, (8,), (SeqPlacement(0, Mode.RING, (0, 1), (((0, 4),), ((4, 8),))),),
                (((),) * 2))
    with pytest.raises(PlanError, match="non-canonical shards"):
        CompactPlan.of(plan)
