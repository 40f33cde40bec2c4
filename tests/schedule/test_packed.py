"""The packed ring / Ulysses closed forms equal the member-by-member sums of the geometry."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.plan import Mode, placement
from megatron_zeppelin.schedule import geometry as geo
from megatron_zeppelin.schedule import packed

KV_NUMEL = 3


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 6), lens=st.lists(st.integers(1, 400), min_size=1, max_size=6), backward=st.booleans())
def test_packed_ring_equals_the_sum_over_members(k, lens, backward):
    members = [placement(i, max(L, 2 * k), Mode.RING, range(k)) for i, L in enumerate(lens)]
    pairs, mean_rows = packed.ring_work(*packed.chunk_rows(members))
    summed = packed.summed_ring(members)
    for step in range(geo.ring_steps(members[0], backward)):
        expected = None
        for q in members:
            msgs = geo.ring_messages(q, step, backward, KV_NUMEL)
            expected = msgs if expected is None else [(kind, s, d, n + m[3]) for (kind, s, d, n), m in
                                                      zip(expected, msgs)]
        assert geo.ring_messages(summed, step, backward, KV_NUMEL) == expected
        for pos in range(k):
            owner = (pos - step) % k
            blocks = [blk for q in members for blk in geo.ring_blocks(q, pos, owner)]
            rows = [q1 - q0 for q0, q1, *_ in blocks]
            assert (pairs[pos][owner], mean_rows[pos][owner]) == (geo.block_pairs(blocks), sum(rows) // len(rows))


@settings(max_examples=40, deadline=None)
@given(d=st.sampled_from([2, 4]), lens=st.lists(st.integers(8, 300), min_size=1, max_size=5))
def test_packed_ulysses_messages_equal_the_sum_over_members(d, lens):
    members = [placement(i, L, Mode.ULYSSES, range(d)) for i, L in enumerate(lens)]
    summed = packed.summed_ulysses(members)
    for step in (0, 2):
        for backward in (False, True):
            expected = None
            for q in members:
                msgs = geo.ulysses_messages(q, step, backward, 8, 4, 2)
                expected = msgs if expected is None else [(s, t, n + m[2]) for (s, t, n), m in
                                                          zip(expected, msgs)]
            assert geo.ulysses_messages(summed, step, backward, 8, 4, 2) == expected
