"""Plan geometry, validate() and JSON round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan import (Mode, Plan, SeqPlacement, Span, Transfer, attention_buffers, causal_pairs,
                                    chunk_bounds, placement, zigzag_shards)
from megatron_zeppelin.planner.base import same_layout_linear


def make_plan(seq_lens, placements, linear=None, world=4, gpn=2, cap=None):
    attention = tuple(placements)
    return Plan(strategy="test", world_size=world, gpus_per_node=gpn, seq_lens=tuple(seq_lens),
                attention=attention, linear=linear or same_layout_linear(world, attention), token_cap=cap)


def test_zigzag_pairs_rank_i_with_2k_minus_1_minus_i():
    assert zigzag_shards(16, 4) == [((0, 2), (14, 16)), ((2, 4), (12, 14)), ((4, 6), (10, 12)), ((6, 8), (8, 10))]
    # Uneven lengths: chunks differ by at most one token and still tile [0, L).
    b = chunk_bounds(13, 4)
    assert b[0] == 0 and b[-1] == 13 and max(y - x for x, y in zip(b, b[1:])) - min(
        y - x for x, y in zip(b, b[1:])) <= 1


@given(st.integers(8, 5000), st.integers(2, 16))
def test_zigzag_balances_causal_pairs(length, k):
    if length < 2 * k:
        return
    pairs = [sum(causal_pairs(s, e) for s, e in shard) for shard in zigzag_shards(length, k)]
    assert sum(pairs) == causal_pairs(0, length)
    # Chunk sizes differ by <= 1 token; one extra token at position p adds p + 1
    # pairs, so ranks differ by at most about one sequence length.
    assert max(pairs) - min(pairs) <= length


def test_causal_pairs_counts_diagonal():
    assert causal_pairs(0, 1) == 1
    assert causal_pairs(0, 4) == 10
    assert causal_pairs(2, 4) == 3 + 4


def random_plan(draw, world, gpn):
    n = draw(st.integers(1, 12))
    lens = [draw(st.integers(1, 400)) for _ in range(n)]
    placements = []
    for i, L in enumerate(lens):
        k = draw(st.integers(1, min(world, max(1, L // 2))))
        ranks = draw(st.permutations(range(world)))[:k]
        mode = Mode.LOCAL if k == 1 else draw(st.sampled_from([Mode.RING, Mode.ULYSSES]))
        placements.append(placement(i, L, mode, ranks))
    return lens, placements


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([(2, 1), (4, 2), (8, 4), (8, 8)]))
def test_valid_plans_roundtrip_and_remap_schedule_covers_moves(data, topo):
    world, gpn = topo
    lens, placements = random_plan(data.draw, world, gpn)
    plan = make_plan(lens, placements, world=world, gpn=gpn).validate()
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.fingerprint() == plan.fingerprint()
    assert sum(plan.attention_tokens_per_rank()) == sum(lens)
    # One rank's spans (what a training process asks for) are its entry of every rank's.
    assert [plan.attention_spans(r) for r in range(world)] == attention_buffers(world, plan.attention)
    assert plan.remap_schedule() == []  # same layout: nothing moves
    # Rotate the linear layout by one rank: every token moves exactly once.
    rotated = plan.linear[1:] + plan.linear[:1]
    moved = make_plan(lens, placements, linear=rotated, world=world, gpn=gpn).validate()
    moves = moved.remap_schedule()
    assert all(t.src != t.dst for t in moves)
    owner = {}
    for r, spans in enumerate(moved.linear):
        for sp in spans:
            for p in range(sp.start, sp.end):
                owner[(sp.seq, p)] = r
    attn_owner = {}
    for r in range(world):
        for sp in moved.attention_spans(r):
            for p in range(sp.start, sp.end):
                attn_owner[(sp.seq, p)] = r
    expected = {key for key in owner if owner[key] != attn_owner[key]}
    got = {(t.seq, p) for t in moves for p in range(t.start, t.end)}
    assert got == expected
    for t in moves:
        assert attn_owner[(t.seq, t.start)] == t.src and owner[(t.seq, t.start)] == t.dst


def test_validate_names_the_offending_sequence():
    lens = [10, 12]
    good = [placement(0, 10, Mode.LOCAL, [0]), placement(1, 12, Mode.RING, [1, 2])]
    make_plan(lens, good).validate()
    bad_shards = SeqPlacement(1, Mode.RING, (1, 2), (((0, 6),), ((6, 12),)))
    with pytest.raises(PlanError, match="sequence 1 .*expected"):
        make_plan(lens, [good[0], bad_shards], linear=make_plan(lens, good).linear).validate()
    with pytest.raises(PlanError, match="sequence 1 has no attention placement"):
        make_plan(lens, good[:1], linear=make_plan(lens, good).linear).validate()
    with pytest.raises(PlanError, match="sequence 0 is placed twice"):
        make_plan(lens, good + [good[0]], linear=make_plan(lens, good).linear).validate()
    with pytest.raises(PlanError, match="invalid ranks"):
        make_plan(lens, [good[0], placement(1, 12, Mode.RING, [1, 9])],
                  linear=make_plan(lens, good).linear).validate()


def test_validate_linear_coverage_and_cap():
    lens = [10, 12]
    att = [placement(0, 10, Mode.LOCAL, [0]), placement(1, 12, Mode.RING, [1, 2])]
    lin = [[Span(0, 0, 5)], [Span(0, 5, 10)], [Span(1, 0, 12)], []]
    make_plan(lens, att, linear=tuple(map(tuple, lin))).validate()
    gap = [[Span(0, 0, 4)], [Span(0, 5, 10)], [Span(1, 0, 12)], []]
    with pytest.raises(PlanError, match="misses tokens of sequence 0 at offset 4"):
        make_plan(lens, att, linear=tuple(map(tuple, gap))).validate()
    overlap = [[Span(0, 0, 6)], [Span(0, 5, 10)], [Span(1, 0, 12)], []]
    with pytest.raises(PlanError, match="overlaps tokens of sequence 0"):
        make_plan(lens, att, linear=tuple(map(tuple, overlap))).validate()
    short = [[Span(0, 0, 5)], [Span(0, 5, 10)], [Span(1, 0, 11)], []]
    with pytest.raises(PlanError, match="covers sequence 1 up to 11 of 12"):
        make_plan(lens, att, linear=tuple(map(tuple, short))).validate()
    with pytest.raises(PlanError, match="rank 2 holds 12 tokens in the linear layout, over the cap of 10"):
        make_plan(lens, att, linear=tuple(map(tuple, lin)), cap=10).validate()


def test_ring_needs_two_chunks_per_rank():
    bad = SeqPlacement(0, Mode.RING, (0, 1, 2), tuple(tuple(s) for s in zigzag_shards(5, 3)))
    with pytest.raises(PlanError, match="enough tokens for 2k chunks"):
        make_plan([5], [bad]).validate()


def test_tiers_and_pairs():
    lens = [8, 16, 32, 12]
    att = [placement(0, 8, Mode.LOCAL, [3]), placement(1, 16, Mode.RING, [0, 1]),
           placement(2, 32, Mode.RING, [0, 1, 2, 3]), placement(3, 12, Mode.ULYSSES, [2, 3])]
    plan = make_plan(lens, att).validate()
    assert plan.tier_counts().__dict__ == {"local": 1, "intra": 1, "inter": 1, "ulysses": 1}
    pairs = plan.attn_pairs_per_rank()
    assert sum(pairs) == sum(causal_pairs(0, L) for L in lens) - causal_pairs(0, 12) + 2 * (causal_pairs(0, 12) // 2)


def test_malformed_json_is_a_plan_error():
    with pytest.raises(PlanError, match="malformed"):
        Plan.from_dict({"strategy": "x"})
    d = json.loads(make_plan([4], [placement(0, 4, Mode.LOCAL, [0])]).to_json())
    assert set(d) >= {"strategy", "world_size", "gpus_per_node", "seq_lens", "attention", "linear", "remap"}
    assert d["attention"][0] == {"seq": 0, "mode": "local", "ranks": [0], "shards": [[[0, 4]]]}
    assert Transfer(0, 1, 0, 0, 3).length == 3


def _packable(packed_rings=()):
    lens = [8, 12, 9, 4]
    att = [placement(0, 8, Mode.RING, [0, 1]), placement(3, 4, Mode.LOCAL, [2]),
           placement(1, 12, Mode.RING, [0, 1]), placement(2, 9, Mode.RING, [1, 0])]
    plan = make_plan(lens, att)
    return dataclasses.replace(plan, packed_rings=tuple(map(tuple, packed_rings)))


def test_packed_rings_round_trip_and_name_their_first_member():
    plan = _packable([[1, 0]]).validate()
    assert plan.packed_leads() == {0: 0, 2: 0}          # placement indices, lead first in plan order
    d = json.loads(plan.to_json())
    assert d["packed_rings"] == [[1, 0]]
    back = Plan.from_json(plan.to_json()).validate()
    assert back == plan and back.fingerprint() == plan.fingerprint()
    # Agreement sees them: the same layouts unpacked are another plan.
    assert _packable().fingerprint() != plan.fingerprint()


def test_a_plan_without_packed_rings_dumps_as_before():
    plan = _packable().validate()
    assert "packed_rings" not in plan.to_dict()
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


@pytest.mark.parametrize("rings, message", [
    ([[0]], "packed ring 0 lists 1 sequence"),
    ([[0, 1], [1, 2]], "sequence 1 is in two packs"),
    ([[0, 3]], "lists sequence 3, placed local; only ring placements"),
    ([[0, 2]], r"mixes ranks \[0, 1\] and \[1, 0\] \(sequence 2\)"),
    ([[0, 7]], "packed ring 0 of the attention layout names sequence 7"),
])
def test_invalid_packed_rings_are_named(rings, message):
    with pytest.raises(PlanError, match=message):
        _packable(rings).validate()


def _ulysses_packable(packed_ulysses=(), packed_rings=()):
    lens = [8, 12, 6, 10, 4]
    att = [placement(0, 8, Mode.ULYSSES, [2, 3]), placement(1, 12, Mode.RING, [0, 1]),
           placement(2, 6, Mode.ULYSSES, [2, 3]), placement(3, 10, Mode.ULYSSES, [3, 2]),
           placement(4, 4, Mode.LOCAL, [0])]
    plan = make_plan(lens, att)
    return dataclasses.replace(plan, packed_ulysses=tuple(map(tuple, packed_ulysses)),
                               packed_rings=tuple(map(tuple, packed_rings)))


def test_packed_ulysses_round_trip_and_name_their_first_member():
    plan = _ulysses_packable([[2, 0]]).validate()
    assert plan.packed_leads() == {0: 0, 2: 0}
    d = json.loads(plan.to_json())
    assert d["packed_ulysses"] == [[2, 0]] and "packed_rings" not in d
    back = Plan.from_json(plan.to_json()).validate()
    assert back == plan and back.fingerprint() == plan.fingerprint()
    assert _ulysses_packable().fingerprint() != plan.fingerprint()
    assert "packed_ulysses" not in _ulysses_packable().to_dict()


@pytest.mark.parametrize("groups, rings, message", [
    ([[0]], [], "packed Ulysses group 0 lists 1 sequence"),
    ([[0, 1]], [], "lists sequence 1, placed ring; only ulysses placements"),
    ([[0, 3]], [], r"mixes ranks \[2, 3\] and \[3, 2\] \(sequence 3\)"),
    ([[0, 2], [2, 0]], [], "sequence 2 is in two packs"),
    ([[0, 9]], [], "packed Ulysses group 0 of the attention layout names sequence 9"),
    ([[0, 2]], [[1, 0]], "packed ring 0 lists sequence 0, placed ulysses"),
])
def test_invalid_packed_ulysses_are_named(groups, rings, message):
    with pytest.raises(PlanError, match=message):
        _ulysses_packable(groups, rings).validate()


def test_a_packed_member_still_needs_two_chunks_per_rank():
    """TE packs short sequences into its ring too; here a ring member must hold
    2k chunks (a shorter one is placed local, as te_cp's planner places it)."""
    bad = SeqPlacement(1, Mode.RING, (0, 1), tuple(tuple(s) for s in zigzag_shards(3, 2)))
    plan = make_plan([8, 3], [placement(0, 8, Mode.RING, [0, 1]), bad])
    with pytest.raises(PlanError, match="enough tokens for 2k chunks"):
        dataclasses.replace(plan, packed_rings=((0, 1),)).validate()
