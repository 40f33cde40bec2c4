"""The surrogate prices packed rings (``Plan.packed_rings``: static CP's layouts
run as TransformerEngine's THD ring) and packed Ulysses groups
(``Plan.packed_ulysses``: Ulysses SP's and FlexSP's layouts run as they run
them) near the replay, above its floor."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_zeppelin.plan import rings_by_ranks, ulysses_by_ranks
from megatron_zeppelin.planner.baseline_candidates import flexsp_greedy_drafts, static_ulysses_drafts, uniform_cp_drafts
from megatron_zeppelin.planner.plan_arrays import plan_arrays
from megatron_zeppelin.planner.surrogate import StepSurrogate, step_floor
from megatron_zeppelin.sim.timeline import step_timeline
from tests.planner.test_surrogate import BOUND, CASES, candidates


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}")
def test_packed_candidates_stay_near_the_replay_and_above_the_floor(case):
    cost, _, _, plans = candidates(*case)
    clock = StepSurrogate(cost)
    packed = [p for p in plans if p.packed_rings or p.packed_ulysses]
    for p in packed:
        priced, replayed = clock.step_s(p), step_timeline(p, cost).step_s
        assert abs(priced / replayed - 1) <= BOUND, (priced, replayed)
        assert step_floor(cost, p) <= priced


def test_a_packed_drafts_arrays_are_its_plans():
    cost, lens, ctx, _ = candidates(*CASES[1])
    drafts = [d for d in uniform_cp_drafts(lens, ctx) if d.unpacked is not None]
    assert drafts
    for d in drafts:
        plan = d.plan()
        assert plan.packed_rings == rings_by_ranks(plan.attention) != ()
        assert plan.attention == d.unpacked.plan().attention and not d.unpacked.plan().packed_rings
        mine, theirs = d.arrays(), plan_arrays(plan)
        assert len(mine.packed) == len(theirs.packed) == len(plan.packed_rings)
        for (r1, l1), (r2, l2) in zip(mine.packed, theirs.packed):
            assert np.array_equal(r1, r2) and np.array_equal(l1, l2)
        # Packed members are not priced again as rings of their own.
        ringed = sum(len(lens) for _, lens in mine.rings.values()) + sum(len(lens) for _, lens in mine.packed)
        assert ringed == sum(p.mode.value == "ring" for p in plan.attention)


def test_a_packed_ulysses_drafts_arrays_are_its_plans():
    """A Ulysses layout's packed copy: its plan packs every group's sequences,
    its arrays (read from the columns) are its plan's, one group per pack with
    the members' summed length, pairs and pair-weighted block."""
    cost, lens, ctx, _ = candidates(*CASES[2])
    drafts = [d for d in static_ulysses_drafts(lens, ctx) + flexsp_greedy_drafts(lens, ctx) if d.unpacked is not None]
    assert drafts
    for d in drafts:
        plan = d.plan()
        assert plan.packed_ulysses == ulysses_by_ranks(plan.attention) != ()
        assert plan.attention == d.unpacked.plan().attention and not d.unpacked.plan().packed_ulysses
        mine, theirs, unpacked = d.arrays(), plan_arrays(plan), d.unpacked.arrays()
        for name in ("group_ranks", "group_size", "group_len", "group_pairs", "group_block"):
            assert np.array_equal(getattr(mine, name), getattr(theirs, name)), name
        groups = sum(p.mode.value == "ulysses" for p in plan.attention)
        assert len(mine.group_len) == groups - sum(len(m) - 1 for m in plan.packed_ulysses) < len(unpacked.group_len)
        assert mine.group_len.sum() == unpacked.group_len.sum() and mine.group_pairs.sum() == unpacked.group_pairs.sum()
