"""Exact resume: a sampler restored at batch k yields what the uninterrupted one yields."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.integration.checkpoint import data_state, restore_sampler, sampler_state_at
from megatron_zeppelin.sampler import BlendedSampler, ZeppelinBatchSampler


def make(kind, lengths, budget, seed):
    if kind == "single":
        return ZeppelinBatchSampler(lengths, max_seq_len=64, tokens_per_batch=budget, seed=seed)
    half = len(lengths) // 2 or 1
    return BlendedSampler([lengths[:half], lengths[half:] or lengths[:1]], [0.3, 0.7], max_seq_len=64,
                          tokens_per_batch=budget, seed=seed)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["single", "blend"]),
       lengths=st.lists(st.integers(1, 300), min_size=2, max_size=40),
       budget=st.integers(64, 400), seed=st.integers(0, 3), k=st.integers(0, 30))
def test_restore_equals_uninterrupted(kind, lengths, budget, seed, k):
    uninterrupted = make(kind, lengths, budget, seed)
    it = iter(uninterrupted)
    for _ in range(k):
        next(it)
    saved = uninterrupted.state_dict()
    resumed = make(kind, lengths, budget, seed)
    assert sampler_state_at(resumed, k) == saved
    restore_sampler(resumed, k, data_state(saved, k))
    assert list(itertools.islice(iter(resumed), 5)) == list(itertools.islice(it, 5))


def test_restore_rejects_other_data_or_position():
    lengths = np.arange(1, 60)
    run = make("single", lengths, 128, 0)
    it = iter(run)
    for _ in range(3):
        next(it)
    saved = data_state(run.state_dict(), 3)
    with pytest.raises(ConfigError, match="does not match"):
        restore_sampler(make("single", lengths, 128, 0), 4, saved)
    with pytest.raises(ConfigError, match="does not match"):
        restore_sampler(make("single", lengths, 128, 1), 3, saved)
    with pytest.raises(ConfigError, match="version"):
        restore_sampler(make("single", lengths, 128, 0), 3, {**saved, "version": 99})
    with pytest.raises(ConfigError, match="negative"):
        sampler_state_at(make("single", lengths, 128, 0), -1)
