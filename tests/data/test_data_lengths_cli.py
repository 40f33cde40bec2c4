"""python -m megatron_zeppelin.data.lengths: summary numbers, histogram, plot, what-if, errors."""

import json

import numpy as np
import pytest

from megatron_zeppelin.data.lengths import log2_histogram, main, read_lengths, summary, token_percentile
from megatron_zeppelin.data.prepare import prepare


def test_histogram_bins_and_token_percentile():
    lengths = np.array([1, 2, 3, 4, 7, 8, 100])
    left, docs, tokens = log2_histogram(lengths)
    assert left.tolist() == [1, 2, 4, 8, 16, 32, 64]
    assert docs.tolist() == [1, 2, 2, 1, 0, 0, 1]
    assert tokens.tolist() == [1, 5, 11, 8, 0, 0, 100]
    # 100 of the 125 tokens sit in the 100-token document
    assert token_percentile(lengths, 50) == 100
    assert token_percentile(lengths, 10) == 7  # cum: 1,3,6,10,17 >= 12.5


def test_summary_text():
    text = summary(np.array([10, 10, 10, 1000]))
    assert text.startswith("4 documents, 1,030 tokens; mean 258, min 10, max 1,000")
    assert "[        8,        16)          3    2.9%" in text


def test_prefix_and_files_give_same_report(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": "a" * n}) + "\n" for n in (5, 50, 500)))
    prepare(tmp_path / "in.jsonl", tmp_path / "ds")
    np.save(tmp_path / "l.npy", np.array([6, 51, 501]))
    np.testing.assert_array_equal(read_lengths(str(tmp_path / "ds")), [6, 51, 501])
    main([str(tmp_path / "ds"), "--plot", str(tmp_path / "h.png")])
    from_prefix = capsys.readouterr().out
    main([str(tmp_path / "l.npy")])
    assert from_prefix.startswith(capsys.readouterr().out)
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_what_if_runs_the_simulator(tmp_path, capsys):
    (tmp_path / "l.txt").write_text("100\n2000\n300\n5000\n40\n")
    main([str(tmp_path / "l.txt"), "--cluster", "cpu-sim", "--model", "tiny", "--max-seq-len", "4096",
          "--tokens-per-gpu", "2048", "--steps", "2"])
    out = capsys.readouterr().out
    assert "| te_cp" in out and "| zeppelin" in out
    assert "zeppelin per step (mean of 2):" in out


@pytest.mark.parametrize("make, match", [
    (lambda p: None, "does not exist"),
    (lambda p: (p.parent / (p.name + ".bin")).write_bytes(b""), r"missing .*\.idx; rebuild it"),
    (lambda p: p.write_text("3\n-1\n"), "length -1"),
])
def test_errors_are_one_line(tmp_path, capsys, make, match):
    path = tmp_path / "src"
    make(path)
    with pytest.raises(SystemExit) as exc:
        main([str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert __import__("re").search(match, err)
