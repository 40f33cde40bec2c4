"""Issue 24's five cases: a diverged run stops and never compares equal, a
checkpoint is never silently replaced or silently wrong, a log never lands in
an input, and a huge document is refused before any table is built."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megatron_zeppelin import resources
from megatron_zeppelin.errors import exit_on_user_error
from megatron_zeppelin.train import compare
from megatron_zeppelin.train.__main__ import main
from megatron_zeppelin.train.checkpoint import LATEST

LENGTHS = [300, 40, 20, 200, 140, 5, 12, 5, 200, 30, 5, 40, 12, 30, 30, 200, 8, 380, 64, 30, 12, 90, 200, 250]


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "lengths.txt"
    path.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return path


def argv(lengths_file, *extra: str, steps: int = 2) -> list[str]:
    """A 2-rank reference run of the tiny model: about 2 s a step on 2 loaded cores."""
    return ["--nodes", "1", "--gpus-per-node", "2", "--strategy", "reference", "--lengths", str(lengths_file),
            "--max-seq-len", "256", "--tokens-per-gpu", "192", "--steps", str(steps), "--seed", "3", "--quiet",
            "--timeout", "30", *extra]


def run(capsys, args: list[str]) -> tuple[int, list[str]]:
    """Exit status and stderr lines of one trainer run (an error line without
    its ``PROG: error: `` prefix, which follows ``sys.argv[0]``)."""
    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code
    return code, [line.split(": error: ", 1)[-1] for line in capsys.readouterr().err.strip().splitlines()]


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def saved(lengths_file, tmp_path_factory):
    """A finished 2-step run: its checkpoint folder and log."""
    tmp = tmp_path_factory.mktemp("saved")
    main(argv(lengths_file, "--save", str(tmp / "ckpt"), "--json-log", str(tmp / "log.jsonl")))
    return tmp / "ckpt", tmp / "log.jsonl"


# ------------------------------------------------------------ 1. divergence
def test_a_diverged_run_stops_in_that_step_with_one_line(lengths_file, tmp_path, capsys):
    log = tmp_path / "nan.jsonl"
    code, err = run(capsys, argv(lengths_file, "--lr", "1e10", "--json-log", str(log), "--save",
                                 str(tmp_path / "ckpt"), steps=4))
    assert code == 1 and len(err) == 1, err
    assert "training diverged at step 1: rank 0's loss is nan" in err[0] and "--lr (now 1e+10)" in err[0]
    assert [r["step"] for r in log_lines(log)] == [0]              # the diverged step is not logged
    assert not (tmp_path / "ckpt" / LATEST).exists()               # nor saved


def compare_run(capsys, *args: str) -> tuple[int, str]:
    try:
        code = exit_on_user_error(lambda: compare.main([str(a) for a in args]))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out + out.err


def with_losses(source: Path, target: Path, losses: list[float]) -> Path:
    lines = log_lines(source)
    target.write_text("".join(json.dumps({**r, "loss": x}) + "\n" for r, x in zip(lines, losses)))
    return target


@pytest.mark.parametrize("ours, theirs", [(math.nan, math.nan), (math.nan, None), (None, math.inf),
                                          (-math.inf, -math.inf)])
def test_compare_never_calls_a_non_finite_loss_equal(saved, tmp_path, capsys, ours, theirs):
    log = saved[1]
    real = [r["loss"] for r in log_lines(log)]
    a = with_losses(log, tmp_path / "a.jsonl", [real[0], real[1] if ours is None else ours])
    b = with_losses(log, tmp_path / "b.jsonl", [real[0], real[1] if theirs is None else theirs])
    code, out = compare_run(capsys, a, b)
    assert code == 1 and "not finite" in out and "DIFFERS" in out and "equal to the reference" not in out
    assert compare_run(capsys, log, log)[0] == 0


def test_compare_never_calls_a_non_finite_gradient_norm_equal(saved, tmp_path, capsys):
    lines = log_lines(saved[1])
    lines[1]["grad_norm"] = math.nan
    nan_norm = tmp_path / "nan-norm.jsonl"
    nan_norm.write_text("".join(json.dumps(r) + "\n" for r in lines))
    code, out = compare_run(capsys, nan_norm, saved[1])
    assert code == 1 and "loss or gradient norm is not finite (NaN or infinite) at step 1" in out


def test_compare_refuses_two_runs_mixed_in_one_log(saved, tmp_path, capsys):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(saved[1].read_text() * 2)         # a second run appended with no run_start line
    code, out = compare_run(capsys, mixed, mixed)
    assert code == 2 and f"{mixed}:3: step 0 follows step 1 (line 2): the file holds several runs" in out


@pytest.mark.parametrize("line, message", [
    ('{"step": 1, "loss": 2.0}', ":2: not a trainer step record (no 'num_tokens'"),
    ('[1, 2]', ":2: not a trainer step record (a JSON list, not an object)"),
    ('{"step": 1, "loss": "2", "num_tokens": 5}', ":2: not a trainer step record ('loss' is '2', not a number)"),
    ('{"step": 1', ":2: not JSON (Expecting"),
])
def test_compare_cites_the_bad_line_without_a_traceback(saved, tmp_path, capsys, line, message):
    first = saved[1].read_text().splitlines()[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{first}\n{line}\n")
    code, out = compare_run(capsys, bad, saved[1])
    assert code == 2 and out.strip().splitlines() == [out.strip()] and f"{bad}{message}" in out


def test_the_megatron_lm_launches_keep_megatrons_nan_check():
    """pretrain_gpt.py --zeppelin runs with Megatron-LM's own --check-for-nan-in-loss-and-grad
    (on unless --no-check-for-nan-in-loss-and-grad): no rendered launch turns it off
    (tests/launch/test_render.py proves the goldens are what the presets render)."""
    goldens = sorted((Path(__file__).parents[1] / "launch" / "golden").glob("*.txt"))
    assert goldens and all("pretrain_gpt.py" in g.read_text() for g in goldens)
    assert not [g.name for g in goldens if "no-check-for-nan" in g.read_text()]


# ----------------------------------------------------------- 2. checkpoints
def test_saving_over_another_runs_checkpoint_is_refused(lengths_file, saved, tmp_path, capsys):
    ckpt = saved[0]
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    code, err = run(capsys, argv(lengths_file, "--save", str(ckpt), steps=1))
    assert code == 2 and len(err) == 1
    assert f"--save {str(ckpt)!r} already holds a checkpoint (step_000002.pt) of another run" in err[0]
    assert f"pass --load {ckpt} to resume" in err[0]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_damaged_weights_are_refused_naming_the_file(lengths_file, saved, tmp_path, capsys):
    from tests.reliability.test_checkpoint import overwrite_tensor_data
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for p in saved[0].iterdir():
        (ckpt / p.name).write_bytes(p.read_bytes())
    overwrite_tensor_data(ckpt / "step_000002.pt")
    code, err = run(capsys, argv(lengths_file, "--load", str(ckpt), steps=3))
    assert code == 2 and err == [f"{ckpt}/step_000002.pt: contents do not match "
                                 "the SHA-256 in step_000002.pt.sha256; the file is damaged -- load another --save "
                                 "directory or start without --load"]


@pytest.mark.parametrize("change, said", [(("--tokens-per-gpu", "256"), "--tokens-per-gpu 192 -> 256"),
                                          (("--gpus-per-node", "1", "--tokens-per-gpu", "384"),
                                           "--nodes x --gpus-per-node 2 -> 1; --tokens-per-gpu 192 -> 384"),
                                          (("--micro-batches", "2"), "--micro-batches 1 -> 2")])
def test_a_resume_of_another_shape_is_refused(lengths_file, saved, capsys, change, said):
    args = argv(lengths_file, "--load", str(saved[0]), steps=3)
    for flag, value in zip(change[::2], change[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    code, err = run(capsys, args)
    assert code == 2 and len(err) == 1 and f"saved by a run of another shape ({said})" in err[0]


def test_save_interval_keeps_the_loaded_checkpoint_and_only_this_runs_newest(lengths_file, saved, tmp_path,
                                                                             capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for p in saved[0].iterdir():
        (ckpt / p.name).write_bytes(p.read_bytes())
    log = tmp_path / "resumed.jsonl"
    code, err = run(capsys, argv(lengths_file, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1",
                                 "--json-log", str(log), steps=4))
    assert (code, err) == (0, [])
    # step 2 was loaded (not this run's): kept; step 3 was this run's: replaced by step 4.
    assert sorted(p.name for p in ckpt.iterdir()) == [LATEST, "step_000002.pt", "step_000002.pt.sha256",
                                                      "step_000004.pt", "step_000004.pt.sha256"]
    # Saving every step leaves the training as it was: the same losses as an uninterrupted run.
    whole = tmp_path / "whole.jsonl"
    assert run(capsys, argv(lengths_file, "--json-log", str(whole), steps=4)) == (0, [])
    assert [(r["step"], r["loss"]) for r in log_lines(log)] == [(r["step"], r["loss"]) for r in log_lines(whole)[2:]]


# ------------------------------------------------------ 3. outputs vs inputs
def test_a_log_into_the_lengths_file_is_refused(lengths_file, tmp_path, capsys):
    before = lengths_file.read_bytes()
    code, err = run(capsys, argv(lengths_file, "--json-log", str(lengths_file)))
    assert code == 2 and err == [f"--json-log {str(lengths_file)!r} is an input of this run (--lengths); writing "
                                 "there would destroy it: pass another path"]
    assert lengths_file.read_bytes() == before


def test_a_second_run_into_a_log_needs_append_and_compare_reads_the_last(lengths_file, saved, tmp_path, capsys):
    log = tmp_path / "two.jsonl"
    log.write_text(saved[1].read_text())
    code, err = run(capsys, argv(lengths_file, "--json-log", str(log), steps=1))
    assert code == 2 and len(err) == 1 and "already holds" in err[0] and "--append-log" in err[0]
    assert run(capsys, argv(lengths_file, "--json-log", str(log), "--append-log")) == (0, [])
    lines = log.read_text().splitlines()
    assert len(lines) == 5 and "run_start" in json.loads(lines[2])
    code, out = compare_run(capsys, log, saved[1])
    assert code == 0 and f"{log} holds 2 appended runs; comparing the last one" in out
    assert "largest relative loss difference 0.0e+00 over 2 steps" in out   # same seed, same batches


# --------------------------------------------------------- 4. sizes bounded
def test_one_huge_document_trains_without_a_piece_table(tmp_path, capsys):
    """The issue's case: one 10**12-token document (3.9e9 pieces at --max-seq-len 256) used to
    build a 10**9-piece table per rank and get a rank OOM-killed; now each rank lists no piece
    (sampler/long_documents.py) and the run trains (its memory: tests/sampler/test_long_documents.py)."""
    huge = tmp_path / "huge.npy"
    np.save(huge, np.array([10**12], dtype=np.int64))
    log = tmp_path / "huge.jsonl"
    assert run(capsys, argv(huge, "--json-log", str(log), steps=2)) == (0, [])
    assert [(r["step"], r["num_tokens"]) for r in log_lines(log)] == [(0, 256), (1, 256)]


def test_a_machine_too_small_for_the_run_is_one_line_with_the_numbers(lengths_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(resources, "available_memory_bytes", lambda: 300 * 2**20)
    monkeypatch.setattr(resources, "usable_cores", lambda: 2)
    code, err = run(capsys, argv(lengths_file, "--gpus-per-node", "4", "--tokens-per-gpu", "96"))
    assert code == 2 and err == ["forking 4 ranks would take about 0.4 GiB of memory, more than 50% of the 0.3 GiB "
                                 "this machine has available; simulate fewer GPUs, or launch on real GPUs with "
                                 "torchrun/srun"]
    code, err = run(capsys, argv(lengths_file, "--nodes", "8", "--gpus-per-node", "8", "--tokens-per-gpu", "4"))
    assert code == 2 and err[0].startswith("--nodes x --gpus-per-node = 64 ranks is more than this machine's 2 cores "
                                           "can run as forked processes (at most 32)")
