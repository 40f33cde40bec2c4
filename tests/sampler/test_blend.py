"""BlendedSampler: token shares follow the weights at every prefix; exact resume."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler import BlendedSampler, ZeppelinBatchSampler
from megatron_zeppelin.sampler.batch_sampler import PieceTable, pass_order


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def dataset_streams(batches, k):
    out = [[] for _ in range(k)]
    for b in batches:
        for p in b.pieces:
            out[p.dataset].append((p.doc, p.start, p.end))
    return out


def test_one_dataset_blend_equals_plain_sampler():
    lengths = np.random.default_rng(2).integers(1, 3000, 300)
    kw = dict(max_seq_len=512, tokens_per_batch=2048, seed=9)
    plain = take(ZeppelinBatchSampler(lengths, **kw), 600)
    blend = take(BlendedSampler([lengths], [3.0], **kw), 600)
    assert plain == blend and plain[-1].epoch >= 2


@given(sizes=st.lists(st.integers(1, 40), min_size=2, max_size=4), data=st.data())
@settings(max_examples=40, deadline=None)
def test_token_shares_follow_weights_at_every_prefix(sizes, data):
    max_seq_len = 16
    datasets = [data.draw(st.lists(st.integers(1, 50), min_size=n, max_size=n)) for n in sizes]
    weights = data.draw(st.lists(st.floats(0.05, 5.0), min_size=len(sizes), max_size=len(sizes)))
    w = np.array(weights) / sum(weights)
    sampler = BlendedSampler(datasets, weights, max_seq_len=max_seq_len, tokens_per_batch=40,
                             seed=data.draw(st.integers(0, 9)))
    consumed = np.zeros(len(sizes))
    for batch in take(sampler, 60):
        for p in batch.pieces:
            consumed[p.dataset] += p.length
            # weighted fair queueing: each dataset is within (K w_d + 1) pieces of its share
            total = consumed.sum()
            assert (np.abs(consumed - w * total) < (len(sizes) * w + 1) * max_seq_len).all()


def test_shares_converge_and_streams_are_whole_passes():
    rng = np.random.default_rng(0)
    datasets = [rng.integers(1, 400, 3000), rng.integers(1, 4000, 50), rng.integers(1, 100, 20000)]
    weights = [0.5, 0.3, 0.2]
    sampler = BlendedSampler(datasets, weights, max_seq_len=1024, tokens_per_batch=16384, seed=1)
    batches = take(sampler, 400)
    tokens = np.zeros(3)
    for b in batches:
        assert b.num_tokens <= 16384
        for p in b.pieces:
            tokens[p.dataset] += p.length
    np.testing.assert_allclose(tokens / tokens.sum(), weights, atol=2e-3)
    # each dataset's pieces are its own passes, back to back: nothing lost or repeated
    for d, stream in enumerate(dataset_streams(batches, 3)):
        table = PieceTable.from_lengths(datasets[d], 1024)
        expect = []
        for p in itertools.count():
            order = pass_order(table, 1, d, p, True)
            expect += zip(table.doc[order].tolist(), table.start[order].tolist(), table.end[order].tolist())
            if len(expect) >= len(stream):
                break
        assert stream == expect[:len(stream)]


def test_scarcest_dataset_read_once_per_epoch():
    a, b = [10] * 30, [7] * 1000  # with equal weights, a is upsampled ~23x
    sampler = BlendedSampler([a, b], [1, 1], max_seq_len=16, tokens_per_batch=64, seed=0)
    epoch0 = [p for bat in sampler.batch_bounds(0) for p in sampler.epoch_order(0).pieces(*bat)]
    assert sorted((p.doc, p.start) for p in epoch0 if p.dataset == 1) == [(i, 0) for i in range(1000)]
    count_a = sum(p.dataset == 0 for p in epoch0)
    assert abs(count_a * 10 - 7000) <= 10 + 7


@given(stop=st.integers(0, 40), seed=st.integers(0, 50), drop_last=st.booleans())
@settings(max_examples=30, deadline=None)
def test_blend_resume_is_exact(stop, seed, drop_last):
    datasets = [[5, 30, 12, 9], [3] * 17, [40, 1]]
    kw = dict(max_seq_len=16, tokens_per_batch=48, seed=seed, drop_last=drop_last)
    full = take(BlendedSampler(datasets, [0.2, 0.5, 0.3], **kw), stop + 15)
    first = BlendedSampler(datasets, [0.2, 0.5, 0.3], **kw)
    assert take(first, stop) == full[:stop]
    resumed = BlendedSampler(datasets, [0.2, 0.5, 0.3], **kw)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert take(resumed, 15) == full[stop:]


def test_blend_errors():
    kw = dict(max_seq_len=8, tokens_per_batch=16)
    with pytest.raises(ConfigError, match="needs 2 weights, got 1"):
        BlendedSampler([[1], [2]], [1.0], **kw)
    with pytest.raises(ConfigError, match="positive numbers"):
        BlendedSampler([[1], [2]], [1.0, 0.0], **kw)
    with pytest.raises(ConfigError, match="at least one dataset"):
        BlendedSampler([], [], **kw)
    with pytest.raises(ConfigError, match="dataset 1 lengths"):
        BlendedSampler([[1], [-2]], [1, 1], **kw)
    a = BlendedSampler([[4, 5], [6]], [1, 1], **kw)
    with pytest.raises(ConfigError, match="weights"):
        BlendedSampler([[4, 5], [6]], [1, 2], **kw).load_state_dict(a.state_dict())
