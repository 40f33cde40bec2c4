"""ZeppelinBatchSampler: coverage, budget, determinism and exact resume."""

import copy
import itertools
import json

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler import GlobalBatch, Piece, ZeppelinBatchSampler


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def epoch_batches(sampler, epoch):
    """All batches of one epoch, iterating a fresh copy of ``sampler`` from its start."""
    out = []
    fresh = copy.deepcopy(sampler)
    fresh.load_state_dict({**sampler.state_dict(), "epoch": 0, "offset": 0, "index": 0})
    for batch in fresh:
        if batch.epoch > epoch:
            return out
        if batch.epoch == epoch:
            out.append(batch)
    raise AssertionError("sampler stopped")


def reference_batches(lengths, max_seq_len, budget, order_of_pieces):
    """Greedy batching written the slow obvious way."""
    batches, current, used = [], [], 0
    for piece in order_of_pieces:
        if used + piece.length > budget:
            batches.append(current)
            current, used = [], 0
        current.append(piece)
        used += piece.length
    batches.append(current)
    return batches


def test_small_example_by_hand():
    # no shuffle: pieces in document order; doc 1 (20 tokens) -> 8, 8, 4
    sampler = ZeppelinBatchSampler([5, 20, 3], max_seq_len=8, tokens_per_batch=16, shuffle=False)
    got = [b.pieces for b in take(sampler, 3)]
    assert got == [
        (Piece(0, 0, 5), Piece(1, 0, 8)),
        (Piece(1, 8, 16), Piece(1, 16, 20), Piece(2, 0, 3)),
        (Piece(0, 0, 5), Piece(1, 0, 8)),  # epoch 1, same order without shuffle
    ]
    assert [b.epoch for b in take(ZeppelinBatchSampler([5, 20, 3], max_seq_len=8, tokens_per_batch=16,
                                                       shuffle=False), 3)] == [0, 0, 1]


@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=60).filter(any),
       max_seq_len=st.integers(1, 64), extra=st.integers(0, 200), seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_epoch_covers_every_token_once_within_budget(lengths, max_seq_len, extra, seed):
    budget = max_seq_len + extra
    sampler = ZeppelinBatchSampler(lengths, max_seq_len=max_seq_len, tokens_per_batch=budget, seed=seed)
    for epoch in (0, 1):
        batches = epoch_batches(sampler, epoch)
        assert len(batches) == len(sampler.batch_bounds(epoch))
        covered = [np.zeros(n, dtype=int) for n in lengths]
        for i, batch in enumerate(batches):
            assert 0 < batch.num_tokens <= budget
            if i + 1 < len(batches):  # greedy: the next batch's first piece did not fit
                assert batch.num_tokens + batches[i + 1].pieces[0].length > budget
            for p in batch.pieces:
                assert 0 < p.length <= max_seq_len and p.dataset == 0
                covered[p.doc][p.start:p.end] += 1
        assert all((c == 1).all() for c in covered)
        # same batches as the obvious greedy loop over the same piece order
        flat = [p for b in batches for p in b.pieces]
        assert [list(b.pieces) for b in batches] == reference_batches(lengths, max_seq_len, budget, flat)


def test_pieces_cut_at_max_seq_len():
    sampler = ZeppelinBatchSampler([10, 25], max_seq_len=10, tokens_per_batch=100, shuffle=False)
    assert take(sampler, 1)[0].pieces == (Piece(0, 0, 10), Piece(1, 0, 10), Piece(1, 10, 20), Piece(1, 20, 25))


def test_deterministic_and_seed_dependent():
    lengths = np.random.default_rng(0).integers(1, 5000, 500)
    kw = dict(max_seq_len=1024, tokens_per_batch=4096)
    a = take(ZeppelinBatchSampler(lengths, seed=3, **kw), 40)
    b = take(ZeppelinBatchSampler(lengths, seed=3, **kw), 40)
    c = take(ZeppelinBatchSampler(lengths, seed=4, **kw), 40)
    assert a == b
    assert [x.pieces for x in a] != [x.pieces for x in c]
    assert [x.index for x in a] == list(range(40))
    # epochs are reshuffled
    sampler = ZeppelinBatchSampler(lengths, seed=3, **kw)
    e0, e1 = epoch_batches(sampler, 0), epoch_batches(sampler, 1)
    assert [p for b in e0 for p in b.pieces] != [p for b in e1 for p in b.pieces]


@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=40), max_seq_len=st.integers(1, 50),
       extra=st.integers(0, 100), stop=st.integers(0, 30), drop_last=st.booleans(), seed=st.integers(0, 99))
@settings(max_examples=60, deadline=None)
def test_resume_is_exact(lengths, max_seq_len, extra, stop, drop_last, seed):
    kw = dict(max_seq_len=max_seq_len, tokens_per_batch=max_seq_len + extra, seed=seed, drop_last=drop_last)
    # drop_last refuses data smaller than one full batch (tested below)
    assume(not drop_last or sum(lengths) > extra)  # an epoch must reach tokens_per_batch - max_seq_len + 1
    full = take(ZeppelinBatchSampler(lengths, **kw), stop + 10)
    first = ZeppelinBatchSampler(lengths, **kw)
    assert take(first, stop) == full[:stop]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints go through JSON/pickle
    resumed = ZeppelinBatchSampler(lengths, **kw)
    resumed.load_state_dict(state)
    assert take(resumed, 10) == full[stop:stop + 10]


def test_resume_with_new_budget_loses_and_repeats_nothing():
    lengths = np.random.default_rng(1).integers(1, 300, 200)
    a = ZeppelinBatchSampler(lengths, max_seq_len=64, tokens_per_batch=256, seed=5)
    seen = [p for b in take(a, 7) for p in b.pieces]
    b = ZeppelinBatchSampler(lengths, max_seq_len=64, tokens_per_batch=1000, seed=5)
    b.load_state_dict(a.state_dict())
    for batch in b:
        if batch.epoch > 0:
            break
        assert batch.num_tokens <= 1000
        seen += batch.pieces
    assert sorted(seen, key=lambda p: (p.doc, p.start)) == sorted(set(seen), key=lambda p: (p.doc, p.start))
    assert sum(p.length for p in seen) == lengths.sum()


def test_drop_last_and_num_batches():
    # 10 docs of 10 tokens, budget 30 -> 3 full batches and a 10-token tail
    kw = dict(max_seq_len=10, tokens_per_batch=30, seed=0)
    keep = ZeppelinBatchSampler([10] * 10, num_batches=8, **kw)
    assert len(keep) == 4
    assert [b.num_tokens for b in keep] == [30, 30, 30, 10, 30, 30, 30, 10]
    drop = ZeppelinBatchSampler([10] * 10, num_batches=6, drop_last=True, **kw)
    assert len(drop) == 3
    got = list(drop)
    assert [b.num_tokens for b in got] == [30] * 6 and [b.epoch for b in got] == [0, 0, 0, 1, 1, 1]
    assert [b.index for b in got] == list(range(6))
    # a tail that is as full as greedy batches get is kept: 21 > 30 - 10
    assert len(ZeppelinBatchSampler([7] * 3, max_seq_len=10, tokens_per_batch=30, drop_last=True)) == 1
    with pytest.raises(ConfigError, match="drop_last drops every batch"):
        take(ZeppelinBatchSampler([5], max_seq_len=10, tokens_per_batch=30, drop_last=True), 1)


def test_zero_length_documents_yield_nothing():
    batches = take(ZeppelinBatchSampler([0, 4, 0, 3], max_seq_len=8, tokens_per_batch=8, shuffle=False), 1)
    assert batches[0].pieces == (Piece(1, 0, 4), Piece(3, 0, 3))
    assert batches[0].seq_lens == [4, 3] and isinstance(batches[0], GlobalBatch)


@pytest.mark.parametrize("lengths, kw, match", [
    ([5], dict(max_seq_len=0, tokens_per_batch=8), "max_seq_len must be a positive integer, got 0"),
    ([5], dict(max_seq_len=4.0, tokens_per_batch=8), "max_seq_len must be a positive integer, got 4.0"),
    ([5], dict(max_seq_len=4, tokens_per_batch=-8), "tokens_per_batch must be a positive integer"),
    ([5], dict(max_seq_len=16, tokens_per_batch=8), r"tokens_per_batch \(8\) is smaller than max_seq_len"),
    ([], dict(max_seq_len=4, tokens_per_batch=8), "non-empty 1-D"),
    ([0, 0], dict(max_seq_len=4, tokens_per_batch=8), "every document is empty"),
    ([3, -1], dict(max_seq_len=4, tokens_per_batch=8), "document 1 has negative length"),
    ([1.5], dict(max_seq_len=4, tokens_per_batch=8), "must be integers"),
])
def test_config_errors(lengths, kw, match):
    with pytest.raises(ConfigError, match=match):
        ZeppelinBatchSampler(lengths, **kw)


def test_checkpoint_from_other_data_is_refused():
    a = ZeppelinBatchSampler([5, 6, 7], max_seq_len=8, tokens_per_batch=16)
    take(a, 1)
    for other in (ZeppelinBatchSampler([5, 6, 8], max_seq_len=8, tokens_per_batch=16),
                  ZeppelinBatchSampler([5, 6, 7], max_seq_len=8, tokens_per_batch=16, seed=1),
                  ZeppelinBatchSampler([5, 6, 7], max_seq_len=4, tokens_per_batch=16)):
        with pytest.raises(ConfigError, match="sampler checkpoint was made with"):
            other.load_state_dict(a.state_dict())


def test_million_documents_is_fast():
    import time
    lengths = (np.random.default_rng(0).pareto(1.1, 1_000_000) * 400 + 30).astype(np.int64)
    t0 = time.perf_counter()
    sampler = ZeppelinBatchSampler(lengths, max_seq_len=32768, tokens_per_batch=8 * 65536)
    n = len(sampler)
    first = take(sampler, 3)
    elapsed = time.perf_counter() - t0
    assert n > 100 and all(b.num_tokens <= 8 * 65536 for b in first)
    assert elapsed < 10, f"1M documents took {elapsed:.1f}s"
