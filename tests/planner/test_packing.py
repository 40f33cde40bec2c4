"""The compiled longest-first packing (planner/packing.py, planner/packing_fit.py) on hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan.shards import contiguous_shards, zigzag_shards
from megatron_zeppelin.planner.packing import (Bins, contiguous_or_one_rank, one_rank, pack_in_rounds, pack_longest_first,
                                               zigzag_or_one_rank)


def test_each_sequence_goes_to_the_bin_with_fewest_tokens_and_its_least_loaded_rank():
    # 5 -> bin 0 (tie: lower bin); 4 -> bin 1; 3 -> bin 1 (4 < 5 tokens), its empty rank 1;
    # 3 -> bin 0 (5 < 7), rank 1; 2 -> bin 1 (7 < 8), rank 1 (3 < 4).
    bins = pack_longest_first([5, 4, 3, 3, 2], Bins(2, 2, 6), one_rank, strategy="s", what="group")
    assert bins.items == [[(0, (5, 0)), (3, (0, 3))], [(1, (4, 0)), (2, (0, 3)), (4, (0, 2))]]
    assert bins.loads == [[5, 3], [4, 5]]


def test_a_bin_that_cannot_hold_the_sequence_is_skipped_and_kept_for_later():
    # 6 splits 3/3 over bin 0; 4 splits 2/2 over bin 1; 2 (too short to split over 2 ranks) -> bin 1
    # (4 < 6 tokens), rank 0; the last 2: both bins hold 6 tokens, bin 0 first, but its ranks hold 3
    # and 2 + 3 > 4, so bin 1, rank 1.
    bins = pack_longest_first([6, 4, 2, 2], Bins(2, 2, 4), zigzag_or_one_rank, strategy="s", what="group")
    assert bins.items == [[(0, (3, 3))], [(1, (2, 2)), (2, (2, 0)), (3, (0, 2))]]
    assert bins.loads == [[3, 3], [4, 4]]
    # 8 -> bin 0 (4/4), 6 -> bin 1 (3/3); 3 fits neither (3 + 3 > 5, 4 + 3 > 5).
    with pytest.raises(InfeasibleError, match=r"s: sequence 1 \(length 3\) does not fit on any group: "
                                              r"the emptiest one has room for 2 more tokens per GPU"):
        pack_longest_first([8, 3, 6, 2], Bins(2, 2, 5), zigzag_or_one_rank, strategy="s", what="group")
    # In rounds 3 waits for the second micro-batch, and 2 still fits bin 1's rank 0 in the first.
    rounds = pack_in_rounds([8, 3, 6, 2], lambda: Bins(2, 2, 5), zigzag_or_one_rank, strategy="s", what="group")
    assert [b.items for b in rounds] == [[[(0, (4, 4))], [(2, (3, 3)), (3, (2, 0))]],
                                         [[(1, (3, 0))], []]]


def test_split_shares_are_the_plans_shards():
    """The packing's vectorized tokens per rank equal those of the shards a Plan holds."""
    lengths = np.arange(1, 200)
    for k in (2, 3, 4, 8):
        zigzag = zigzag_or_one_rank.rows(lengths, k)[1]
        contiguous = contiguous_or_one_rank.rows(lengths, k)[1]
        for L, z, c in zip(lengths.tolist(), zigzag.tolist(), contiguous.tolist()):
            assert z == [a[1] - a[0] + b[1] - b[0] for a, b in zigzag_shards(L, k)]
            assert c == [b - a for ((a, b),) in contiguous_shards(L, k)]
            one = [L] + [0] * (k - 1)
            assert list(zigzag_or_one_rank(L, [0] * k)) == (z if L >= 2 * k else one)
            assert list(contiguous_or_one_rank(L, [0] * k)) == (c if L >= 2 * k else one)
