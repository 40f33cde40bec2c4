"""DeferringSampler: a piece no plan holds waits for the next step; none is lost or repeated."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.sampler import ZeppelinBatchSampler
from megatron_zeppelin.sampler.deferral import DeferringSampler


def picky_plan(limit: int):
    """A 'planner' that places at most ``limit`` tokens (the plan is the lengths)."""
    def make_plan(lens):
        if sum(lens) > limit:
            raise InfeasibleError(f"{sum(lens)} > {limit}")
        return list(lens)
    return make_plan


def lengths(seed: int = 0, n: int = 200) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 300, n)


def test_deferred_pieces_come_first_in_the_next_step_and_none_is_lost():
    docs = lengths()
    sampler = DeferringSampler(ZeppelinBatchSampler(docs, max_seq_len=256, tokens_per_batch=1024, seed=1,
                                                    shuffle=False))
    notes, seen = [], []
    for _ in range(40):
        batch, plan = sampler.next_planned(picky_plan(900), notes.append)
        assert plan == batch.seq_lens and sum(plan) <= 900
        seen += [(p.doc, p.start, p.end) for p in batch.pieces]
    assert notes and all("deferred a piece" in n for n in notes)
    # Exactly the sampling order: nothing skipped, repeated or reordered.
    plain = ZeppelinBatchSampler(docs, max_seq_len=256, tokens_per_batch=1024, seed=1, shuffle=False,
                                 num_batches=40)
    order = [(p.doc, p.start, p.end) for batch in plain for p in batch.pieces][:len(seen)]
    assert seen == order


def test_a_plannable_batch_is_handed_on_unchanged():
    sampler = DeferringSampler(ZeppelinBatchSampler(lengths(), max_seq_len=256, tokens_per_batch=1024))
    plain = iter(ZeppelinBatchSampler(lengths(), max_seq_len=256, tokens_per_batch=1024))
    for _ in range(5):
        batch, _ = sampler.next_planned(picky_plan(1024), pytest.fail)
        assert batch == next(plain)


def test_state_resumes_with_the_carried_pieces():
    def make():
        return DeferringSampler(ZeppelinBatchSampler(lengths(3), max_seq_len=256, tokens_per_batch=1024, seed=5))
    a = make()
    for _ in range(6):
        a.next_planned(picky_plan(800), lambda _: None)
    state = a.state_dict()
    assert state["carried"], "the scenario must carry a piece across the checkpoint"
    b = make()
    b.load_state_dict(state)
    for _ in range(6):
        assert a.next_planned(picky_plan(800), lambda _: None) == b.next_planned(picky_plan(800), lambda _: None)


def test_a_single_piece_without_a_plan_is_the_planners_error():
    sampler = DeferringSampler(ZeppelinBatchSampler([500], max_seq_len=500, tokens_per_batch=500))
    with pytest.raises(InfeasibleError, match="500 > 100"):
        sampler.next_planned(picky_plan(100), lambda _: None)
