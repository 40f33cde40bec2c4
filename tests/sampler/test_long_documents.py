"""Datasets of over LAZY_PIECES pieces: no piece table, the same batching rules."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler import ZeppelinBatchSampler, batch_sampler
from megatron_zeppelin.sampler.batch_sampler import EpochOrder, PieceTable
from megatron_zeppelin.sampler.long_documents import FeistelPermutation, LongPieceTable


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_the_feistel_order_is_a_permutation(n):
    perm = FeistelPermutation(n, (5, 0, 1))(np.arange(n))
    assert sorted(perm.tolist()) == list(range(n))
    if n > 16:
        assert perm.tolist() != list(range(n))                               # it shuffles
        assert perm.tolist() != FeistelPermutation(n, (5, 0, 2))(np.arange(n)).tolist()   # per epoch


LENGTHS = [1000, 3, 77, 512, 1, 260, 9, 1999]


def epochs(sampler, count: int) -> list:
    it = iter(sampler)
    return [next(it) for _ in range(count)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_an_epoch_covers_every_token_once_in_greedy_batches(monkeypatch, shuffle):
    monkeypatch.setattr(batch_sampler, "LAZY_PIECES", 10)     # these lengths make 393 pieces
    sampler = ZeppelinBatchSampler(LENGTHS, max_seq_len=10, tokens_per_batch=57, seed=4, shuffle=shuffle)
    assert isinstance(sampler.tables[0], LongPieceTable)
    order = sampler.epoch_order(0)
    batches = []
    for batch in iter(sampler):
        if batch.epoch:
            break
        batches.append(batch)
    covered = sorted((p.doc, t) for b in batches for p in b.pieces for t in range(p.start, p.end))
    assert covered == sorted((d, t) for d, n in enumerate(LENGTHS) for t in range(n))
    # Greedy: the same batches as the table path's rule walking the same order.
    pieces = order.pieces(0, order.num_pieces)
    table_order = EpochOrder(*(np.array(c) for c in zip(*((p.dataset, p.doc, p.start, p.end) for p in pieces))))
    begin, expected = 0, []
    while begin < table_order.num_pieces:
        end = table_order.batch_end(begin, 57)
        expected.append(table_order.pieces(begin, end))
        begin = end
    assert [b.pieces for b in batches] == expected
    assert any(len(b.pieces) > 1 for b in batches) and max(b.num_tokens for b in batches) <= 57


def test_resume_continues_with_the_same_batches(monkeypatch):
    monkeypatch.setattr(batch_sampler, "LAZY_PIECES", 10)
    make = lambda: ZeppelinBatchSampler(LENGTHS, max_seq_len=10, tokens_per_batch=57, seed=4)  # noqa: E731
    whole = epochs(make(), 40)
    first = make()
    epochs(first, 23)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert epochs(resumed, 17) == whole[23:]


def test_one_huge_document_samples_in_memory_that_grows_with_the_batches():
    """The issue's case: a 10**12-token document under the 2**40 cap (3.9e9 pieces at 256)."""
    tracemalloc.start()
    try:
        sampler = ZeppelinBatchSampler(np.array([10**12, 300]), max_seq_len=256, tokens_per_batch=1000, seed=0)
        batches = epochs(sampler, 200)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sampler.tables[0].num_pieces == 3906250000 + 2
    assert peak < 2**20, peak                                    # a table would be 360 GiB
    assert all(b.num_tokens > 1000 - 256 for b in batches)       # greedy batches, 3 full pieces each
    assert len({p for b in batches for p in b.pieces}) == 600    # none drawn twice


def test_many_pieces_of_short_documents_keep_the_table_and_its_memory_check(monkeypatch):
    monkeypatch.setattr(batch_sampler, "check_memory", _refuse_over(10 * 2**20))
    with pytest.raises(ConfigError, match=r"lengths: 3000000 tokens cut at --max-seq-len 1 make 3000000 pieces; "
                                          r"the sampler's tables of 3000000 pieces would take about 0.3 GiB"):
        ZeppelinBatchSampler(np.ones(3_000_000, dtype=np.int64), max_seq_len=1, tokens_per_batch=8)
    assert isinstance(ZeppelinBatchSampler([5, 6], max_seq_len=4, tokens_per_batch=8).tables[0], PieceTable)


def _refuse_over(limit: int):
    def check(need: int, what: str, fix: str) -> None:
        if need > limit:
            raise ConfigError(f"{what} would take about {need / 2**30:.1f} GiB; {fix}")
    return check
