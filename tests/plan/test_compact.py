"""plan/compact.py: a Plan packed into flat arrays, pickled (as the planning
child sends it) and received equals the original, field for field, in every
kind of plan: local, intra- and inter-node rings, Ulysses groups, packed rings
and packed Ulysses groups, remapped linear layouts, routed or not.  Receiving
makes none of the batch's placements and spans; a rank's readers make only
what they read."""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan import Mode, Plan, SeqPlacement, rings_by_ranks, ulysses_by_ranks
from megatron_zeppelin.plan.compact import CompactPlan
from megatron_zeppelin.plan.placement import canonical_shards
from megatron_zeppelin.planner.base import same_layout_linear
from megatron_zeppelin.remap.exchange import build_exchange
from megatron_zeppelin.schedule.attention import attention_schedule
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


def test_a_received_plan_reads_as_the_sent_one_rank_by_rank():
    """Routed, remapped, Ulysses groups and inter-node rings: every rank's view."""
    cases = [c for c in CASES[:20] if c["plan"]["routed"] and c["plan"]["remap"]]
    plans = [Plan.from_dict(c["plan"]).validate() for c in cases]
    assert {t for p in plans for t, n in dataclasses.asdict(p.tier_counts()).items() if n} == {
        "local", "inter", "ulysses"}
    for case, plan in zip(cases, plans):
        got = round_trip(plan)
        assert list(got.attention) == list(plan.attention) and list(got.linear) == list(plan.linear)
        assert got.fingerprint() == Plan.from_json(plan.to_json()).fingerprint()
        assert got.remap_pairs() == plan.remap_pairs() and got.remap_schedule() == plan.remap_schedule()
        assert got.validate() is got and pickle.loads(pickle.dumps(got)) == plan and hash(got) == hash(plan)
        cost = _cost(case)
        shape, transport = step_shape(cost, True).attn, transport_of(cost)
        for rank in range(0, plan.world_size, max(plan.world_size // 4, 1)):
            assert got.placements_of(rank) == plan.placements_of(rank)
            assert got.attention_spans(rank) == plan.attention_spans(rank)
            assert got.linear[rank] == plan.linear[rank]
            assert got.remap_moves(rank) == plan.remap_moves(rank)
            assert build_exchange(got, rank).pairs == build_exchange(plan, rank).pairs
            for backward in (False, True):
                assert (digest(attention_schedule(got, shape, transport, backward, rank))
                        == digest(attention_schedule(plan, shape, transport, backward, rank)))


def _many_local_sequences(world: int = 8, n: int = 2000) -> Plan:
    """``n`` local sequences and one ring over every rank."""
    lens = [64 + i % 50 for i in range(n)] + [4 * world]
    placements = [SeqPlacement(i, Mode.LOCAL, (i % world,), canonical_shards(Mode.LOCAL, lens[i], 1))
                  for i in range(n)]
    placements.append(SeqPlacement(n, Mode.RING, tuple(range(world)), canonical_shards(Mode.RING, lens[n], world)))
    return Plan("test", world, world, tuple(lens), tuple(placements),
                same_layout_linear(world, placements)).validate()


def _tracked_objects_made(work) -> tuple[object, int]:
    gc.collect()
    before = len(gc.get_objects())
    held = work()
    gc.collect()                      # what survives a pass (tuples of ints leave it)
    return held, len(gc.get_objects()) - before


def test_receiving_makes_no_placement_and_a_rank_reads_only_its_own():
    plan = _many_local_sequences()
    blob = pickle.dumps(CompactPlan.of(plan))
    got, made = _tracked_objects_made(lambda: pickle.loads(blob).plan())
    assert made < 20, made            # the Plan and its two sequences, not ~4,000 placements and spans
    assert got == plan and got.fingerprint() == plan.fingerprint()
    shape = step_shape(_cost(CASES[0]), True).attn
    transport = transport_of(_cost(CASES[0])).direct()

    def a_ranks_reads():
        return (got.attention_spans(3), got.remap_moves(3), build_exchange(got, 3),
                attention_schedule(got, shape, transport, False, 3))

    _, made = _tracked_objects_made(a_ranks_reads)
    mine = len(got.placements_of(3))
    assert mine == 2000 // 8 + 1
    assert len(got.attention._kept) == mine and len(got.linear._kept) == 1   # rank 3's only
    assert made < 10 * mine, made     # its placements, spans, schedule: not the batch's 2,001 placements
