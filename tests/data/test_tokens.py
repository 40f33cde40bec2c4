"""synthetic_tokens: deterministic, slice-consistent, in range, seed/doc dependent."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.data import synthetic_tokens


@given(seed=st.integers(0, 2**40), doc=st.integers(0, 10**7), length=st.integers(0, 3000),
       cut=st.data(), vocab=st.integers(1, 200_000))
@settings(max_examples=80, deadline=None)
def test_piece_equals_slice_of_document(seed, doc, length, cut, vocab):
    whole = synthetic_tokens(seed, doc, 0, length, vocab)
    start = cut.draw(st.integers(0, length))
    end = cut.draw(st.integers(start, length))
    assert whole.dtype == np.int64 and whole.shape == (length,)
    np.testing.assert_array_equal(synthetic_tokens(seed, doc, start, end, vocab), whole[start:end])
    assert whole.size == 0 or (0 <= whole.min() and whole.max() < vocab)


def test_far_piece_of_huge_document_is_cheap_and_consistent():
    tail = synthetic_tokens(7, 3, 999_000, 1_000_000, 32000)
    np.testing.assert_array_equal(tail[-10:], synthetic_tokens(7, 3, 999_990, 1_000_000, 32000))


def test_depends_on_seed_and_doc_and_is_roughly_uniform():
    a = synthetic_tokens(0, 0, 0, 1000, 50_000)
    assert not np.array_equal(a, synthetic_tokens(1, 0, 0, 1000, 50_000))
    assert not np.array_equal(a, synthetic_tokens(0, 1, 0, 1000, 50_000))
    np.testing.assert_array_equal(a, synthetic_tokens(0, 0, 0, 1000, 50_000))
    counts = np.bincount(synthetic_tokens(3, 5, 0, 100_000, 10), minlength=10)
    assert counts.min() > 9_500 and counts.max() < 10_500


def test_bad_arguments():
    with pytest.raises(ValueError, match="bad token range"):
        synthetic_tokens(0, 0, 5, 4, 10)
    with pytest.raises(ValueError, match="vocab_size"):
        synthetic_tokens(0, 0, 0, 4, 0)
