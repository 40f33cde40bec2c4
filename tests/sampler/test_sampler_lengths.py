"""load_lengths: both formats, and a clear ConfigError for every malformed file."""

import numpy as np
import pytest

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler import load_lengths


def test_npy_and_text_agree(tmp_path):
    lengths = np.array([3, 1, 40000, 7], dtype=np.int32)
    np.save(tmp_path / "a.npy", lengths)
    (tmp_path / "a.txt").write_text("# lengths\n3\n\n1  # short\n40000\n7\n")
    for name in ("a.npy", "a.txt"):
        got = load_lengths(tmp_path / name)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, lengths)


@pytest.mark.parametrize("name, content, match", [
    ("empty.txt", "# nothing\n\n", "no document length"),
    ("zero.txt", "5\n0\n", r"zero.txt:2: length 0"),
    ("neg.txt", "5\n6\n-2\n", r"neg.txt:3: length -2"),
    ("float.txt", "5\n2.5\n", r"float.txt:2: '2.5' is not an integer"),
    ("word.txt", "abc\n", r"word.txt:1: 'abc'"),
])
def test_bad_text(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_lengths(tmp_path / name)


@pytest.mark.parametrize("array, match", [
    (np.array([1.0, 2.0]), "integer array, got dtype float64"),
    (np.array([[1, 2], [3, 4]]), r"one-dimensional.*shape \(2, 2\)"),
    (np.array([], dtype=np.int64), "no document length"),
    (np.array([4, 0, 2]), "entry 1 is 0"),
    (np.array([4, -3]), "entry 1 is -3"),
])
def test_bad_npy(tmp_path, array, match):
    np.save(tmp_path / "x.npy", array)
    with pytest.raises(ConfigError, match=match):
        load_lengths(tmp_path / "x.npy")


def test_missing_and_corrupt(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_lengths(tmp_path / "nope.npy")
    (tmp_path / "bad.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ConfigError, match="not a readable .npy"):
        load_lengths(tmp_path / "bad.npy")
