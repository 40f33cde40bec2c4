"""Exact resume: a sampler restored from a checkpoint's data state trains every piece once."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.integration.checkpoint import data_state, restore_sampler, sampler_state_at
from megatron_zeppelin.sampler import BlendedSampler, ZeppelinBatchSampler
from megatron_zeppelin.sampler.deferral import DeferringSampler


def make(kind, lengths, budget, seed):
    if kind == "single":
        return ZeppelinBatchSampler(lengths, max_seq_len=64, tokens_per_batch=budget, seed=seed)
    half = len(lengths) // 2 or 1
    return BlendedSampler([lengths[:half], lengths[half:] or lengths[:1]], [0.3, 0.7], max_seq_len=64,
                          tokens_per_batch=budget, seed=seed)


def draw(sampler, k):
    """The first ``k`` batches of a DeferringSampler whose plans always fit."""
    return [sampler.next_planned(lambda lens: None, print)[0] for _ in range(k)]


def pieces(batches):
    return [p for b in batches for p in b.pieces]


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
    assert sampler_state_at(make(kind, lengths, budget, seed), k) == saved
    for state in (data_state(saved, k, budget), None):  # the checkpoint's state, or batch boundaries alone
        resumed = DeferringSampler(make(kind, lengths, budget, seed))
        assert restore_sampler(resumed, k, state) is None
        assert list(itertools.islice(iter(resumed.sampler), 5)) == list(itertools.islice(iter(make(
            kind, lengths, budget, seed)), k, k + 5))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["single", "blend"]),
       lengths=st.lists(st.integers(1, 300), min_size=2, max_size=40),
       budgets=st.tuples(st.integers(64, 400), st.integers(64, 400)), k=st.integers(1, 12))
def test_a_changed_batch_continues_at_the_first_untrained_piece(kind, lengths, budgets, k):
    """--zeppelin-tokens-per-gpu / --global-batch-size / DP changed between save and
    resume: the pieces trained before and after are the uninterrupted order's, each once."""
    before = DeferringSampler(make(kind, lengths, budgets[0], 0))
    trained = draw(before, k)
    saved = data_state(before.state_dict(), k, budgets[0])
    after = DeferringSampler(make(kind, lengths, budgets[1], 0))
    note = restore_sampler(after, k, saved)
    assert (note is None) == (budgets[0] == budgets[1])
    resumed = pieces(trained) + pieces(draw(after, 6))
    reference = pieces(draw(DeferringSampler(make(kind, lengths, 10_000, 0)), 40))
    assert resumed == reference[:len(resumed)]


def test_deferred_pieces_survive_the_checkpoint():
    """A piece deferred before the save opens the first batch after the resume."""
    lengths = np.full(30, 60)
    run = DeferringSampler(ZeppelinBatchSampler(lengths, max_seq_len=64, tokens_per_batch=200, seed=0))
    # A plan never holds three pieces: each batch of three defers its last.
    fits = lambda lens: None if len(lens) < 3 else (_ for _ in ()).throw(InfeasibleError("3 pieces"))  # noqa: E731
    notes = []
    first = [run.next_planned(fits, notes.append)[0] for _ in range(3)]
    saved = data_state(run.state_dict(), 3, 200)
    assert saved["sampler"]["carried"] and len(notes) == 3
    resumed = DeferringSampler(ZeppelinBatchSampler(lengths, max_seq_len=64, tokens_per_batch=200, seed=0))
    restore_sampler(resumed, 3, saved)
    assert resumed.next_planned(fits, notes.append)[0] == run.next_planned(fits, notes.append)[0]
    assert len({p for b in first for p in b.pieces}) == 6


def test_restore_refuses_what_cannot_continue_exactly():
    lengths = np.arange(1, 60)
    run = DeferringSampler(make("single", lengths, 128, 0))
    draw(run, 3)
    saved = data_state(run.state_dict(), 3, 128)
    fresh = lambda seed=0, lens=lengths, seq=64: DeferringSampler(  # noqa: E731
        ZeppelinBatchSampler(lens, max_seq_len=seq, tokens_per_batch=128, seed=seed))
    with pytest.raises(ConfigError, match="is after global batch 3, but its iteration is 4"):
        restore_sampler(fresh(), 4, saved)
    with pytest.raises(ConfigError, match=r"seed \(--zeppelin-seed, else --seed\) = 0, this run has 1"):
        restore_sampler(fresh(seed=1), 3, saved)
    with pytest.raises(ConfigError, match="--seq-length = 64, this run has 32"):
        restore_sampler(fresh(seq=32), 3, saved)
    with pytest.raises(ConfigError, match=r"documents \(--data-path, --split\)"):
        restore_sampler(fresh(lens=np.arange(2, 61)), 3, saved)
    with pytest.raises(ConfigError, match="version"):
        restore_sampler(fresh(), 3, {**saved, "version": 99})
    with pytest.raises(ConfigError, match="negative"):
        sampler_state_at(make("single", lengths, 128, 0), -1)
