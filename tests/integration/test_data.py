"""--data-path / --split parsing and document blends over indexed datasets."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.integration.data import open_blends, parse_data_path, split_bounds

from tests.integration.indexed_data import doc_tokens


def test_parse_data_path():
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    for bad in ([], ["0.7", "a", "0.3"], ["0.7", "a", "x", "b"]):
        with pytest.raises(ConfigError, match="--data-path"):
            parse_data_path(bad)


def test_split_bounds_megatron_style():
    assert split_bounds("99,1,0", 100) == [(0, 99), (99, 100), (100, 100)]
    assert split_bounds("1", 10) == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ConfigError, match="--split"):
        split_bounds("a,b", 10)
    with pytest.raises(ConfigError, match="--split"):
        split_bounds("0,0,0", 10)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=3).filter(any), st.integers(0, 500))
def test_split_bounds_partition_the_documents(shares, n):
    bounds = split_bounds(",".join(map(str, shares)), n)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(b >= a for a, b in bounds)


def test_blend_reads_each_datasets_documents(datasets):
    prefixes, lengths = datasets
    blends = open_blends(["0.25", prefixes[0], "0.75", prefixes[1]], "90,10,0")
    train, valid = blends["train"], blends["valid"]
    assert blends["test"] is None
    assert train.weights == (0.25, 0.75) and [r for r in train.ranges] == [(0, 36), (0, 27)]
    assert valid.ranges == ((36, 40), (27, 30))
    np.testing.assert_array_equal(valid.lengths[0], lengths[0][36:40])
    # Blend document ids run through the datasets: valid doc 4 is dataset 1's document 27.
    np.testing.assert_array_equal(valid.tokens(4, 1, 4), doc_tokens(1, 27, lengths[1][27])[1:4])
    np.testing.assert_array_equal(valid.tokens(0, 0, 3), doc_tokens(0, 36, lengths[0][36])[:3])


def test_unweighted_blend_mixes_by_tokens(datasets):
    prefixes, lengths = datasets
    train = open_blends(prefixes, "1")["train"]
    assert train.weights == (float(lengths[0].sum()), float(lengths[1].sum()))
    single = open_blends(prefixes[:1], "1")["train"]
    assert single.weights is None and type(single.sampler(max_seq_len=64, tokens_per_batch=256, seed=0)
                                            ).__name__ == "ZeppelinBatchSampler"


def test_lengths_file_must_match(datasets, tmp_path):
    prefixes, lengths = datasets
    good = tmp_path / "lengths.npy"
    np.save(good, np.concatenate(lengths))
    open_blends(prefixes, "1", str(good))
    bad = np.concatenate(lengths)
    bad[41] += 1
    np.save(tmp_path / "bad.npy", bad)
    with pytest.raises(ConfigError, match="document 41 has length"):
        open_blends(prefixes, "1", str(tmp_path / "bad.npy"))
    np.save(tmp_path / "short.npy", lengths[0])
    with pytest.raises(ConfigError, match="lists 40 documents, but --data-path holds 70"):
        open_blends(prefixes, "1", str(tmp_path / "short.npy"))


def test_missing_idx_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="missing .*nothing.idx"):
        open_blends([str(tmp_path / "nothing")], "1")


def test_a_torch_dist_save_without_psutil_is_refused(monkeypatch):
    """Megatron-Core's torch_dist writer dies unreported without psutil and every rank
    then waits forever at the first save: refused before launch instead."""
    import argparse
    import sys

    from megatron_zeppelin.integration.preflight import check_checkpoint_writer

    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    args = argparse.Namespace(save="ckpt", ckpt_format="torch_dist")
    with pytest.raises(ConfigError, match="needs psutil.*every rank hangs at the first save; pip install psutil"):
        check_checkpoint_writer(args)
    check_checkpoint_writer(argparse.Namespace(save="ckpt", ckpt_format="torch"))
    check_checkpoint_writer(argparse.Namespace(save=None, ckpt_format="torch_dist"))


def test_a_validation_batch_smaller_than_the_micro_batches_is_refused_before_launch(tmp_path):
    """--global-batch-size 8 on 4 ranks: 2 micro-batches per step; the validation
    split's 3 documents of 500 tokens each fill a global batch of 988 tokens alone
    (evaluation would fail at its first batch), the training split's do not."""
    import argparse

    from megatron_zeppelin.integration.preflight import check_batches_fill_micro_batches, evaluation_batches
    from tests.integration.indexed_data import write_dataset

    prefix = write_dataset(str(tmp_path / "docs"), np.array([100] * 7 + [500] * 3))
    args = argparse.Namespace(world_size=4, tensor_model_parallel_size=1, global_batch_size=8,
                              zeppelin_tokens_per_gpu=130, seq_length=512, zeppelin_batch_fill=0.95, seed=3,
                              zeppelin_seed=None, train_iters=4, eval_iters=2, eval_interval=2, split="70,30,0")
    assert evaluation_batches(args) == 2 * (4 // 2 + 1)
    blends = open_blends([prefix], args.split)
    with pytest.raises(ConfigError, match=r"the validation split's global batch 0 \(epoch 0\) "
                                          r"holds 1 sequence, fewer than the 2 micro-batches per step "
                                          r"\(--global-batch-size 8 / data-parallel size 4\)"):
        check_batches_fill_micro_batches(args, blends)
    args.eval_iters = 0
    check_batches_fill_micro_batches(args, blends)


def test_transformer_engine_layers_without_transformer_engine_are_refused(monkeypatch):
    import argparse
    import sys

    from megatron_zeppelin.integration.preflight import check_transformer_impl

    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(ConfigError, match="--transformer-impl transformer_engine .* pass --transformer-impl local"):
        check_transformer_impl(argparse.Namespace(transformer_impl="transformer_engine"))
    check_transformer_impl(argparse.Namespace(transformer_impl="local"))
