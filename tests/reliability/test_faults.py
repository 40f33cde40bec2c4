"""Faults on a real 2 x 2 gloo run: a stalled rank, a killed rank, a killed
launcher, a save killed mid-write.  Each asserts that the run ends within its
bound with one line and no traceback, and that the last complete checkpoint
still loads and resumes bit-exact.

The launcher is forked from this process (torch and Megatron are imported
once), writes its stderr to a file, and forks its ranks as in production.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_zeppelin.train import trainer
from megatron_zeppelin.train.__main__ import main

LENGTHS = [300, 40, 20, 200, 140, 5, 12, 5, 200, 30, 5, 40, 12, 30, 30, 200, 8, 380, 64, 30, 12, 90, 200, 250]
#: Seconds a run may take beyond its --timeout to end after a fault (start-up of
#: the ranks and the launcher's exit on a loaded 2-core machine).
SLACK_S = 25


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "lengths.txt"
    path.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return str(path)


def _argv(lengths_file, out: Path, *extra: str, steps: int = 100000, strategy: str = "zeppelin") -> list[str]:
    return ["--nodes", "2", "--gpus-per-node", "2", "--strategy", strategy, "--model", "tiny",
            "--lengths", lengths_file, "--max-seq-len", "512", "--tokens-per-gpu", "192", "--steps", str(steps),
            "--seed", "7", "--quiet", "--json-log", str(out), *extra]


def _launcher(argv: list[str], stderr_path: str) -> None:
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os._exit(code)


def _start(argv: list[str], tmp_path: Path) -> tuple[mp.Process, Path]:
    err = tmp_path / "stderr.txt"
    proc = mp.get_context("fork").Process(target=_launcher, args=(argv, str(err)))
    proc.start()
    return proc, err


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return sorted(out)


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, not yet reaped) does not count."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_training(proc: mp.Process, log: Path, steps: int = 2) -> list[int]:
    """Block until the run logged ``steps`` steps; returns the ranks' pids (rank order)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= steps:
            ranks = _children(proc.pid)
            assert len(ranks) == 4, ranks
            return ranks
        assert proc.is_alive(), "the run ended before it trained"
        time.sleep(0.2)
    raise AssertionError("the run did not start training within 240 s")


def _one_line(err: Path) -> str:
    lines = err.read_text().strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def _ended_within(proc: mp.Process, seconds: float) -> float:
    start = time.monotonic()
    proc.join(seconds)
    took = time.monotonic() - start
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"the run still ran {seconds} s after the fault")
    return took


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["on", "off"])
def test_a_stalled_rank_ends_the_run_with_one_line(lengths_file, tmp_path, routing):
    timeout = 4
    log = tmp_path / "log.jsonl"
    proc, err = _start(_argv(lengths_file, log, "--timeout", str(timeout), "--routing", routing), tmp_path)
    ranks = _wait_training(proc, log)
    os.kill(ranks[1], signal.SIGSTOP)
    _ended_within(proc, timeout + SLACK_S)
    assert proc.exitcode == 1
    line = _one_line(err)
    assert f"did not complete within --timeout {timeout} s" in line and "rank " in line
    assert not any(_alive(r) for r in ranks)


def test_a_rank_stalled_before_the_gradient_all_reduce_ends_the_run(lengths_file, tmp_path, monkeypatch):
    """Rank 1 stops itself right before step 2's gradient all-reduce, so the other
    ranks all wait in it, on Megatron's data-parallel group, not on the
    communicator: that group must also time out after --timeout."""
    timeout = 4
    real = trainer.allreduce_grads
    steps = [0]

    def stall_rank_1_at_step_2(model, *args):
        steps[0] += 1
        if steps[0] == 3 and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(model, *args)

    monkeypatch.setattr(trainer, "allreduce_grads", stall_rank_1_at_step_2)  # inherited by the forked ranks
    log = tmp_path / "log.jsonl"
    proc, err = _start(_argv(lengths_file, log, "--timeout", str(timeout)), tmp_path)
    ranks = _wait_training(proc, log)
    _ended_within(proc, timeout + SLACK_S)
    assert proc.exitcode == 1
    line = _one_line(err)
    assert f"did not complete within --timeout {timeout} s" in line and "gradient all-reduce" in line, line
    assert not any(_alive(r) for r in ranks)


def test_a_killed_rank_ends_the_run_with_one_line(lengths_file, tmp_path):
    log = tmp_path / "log.jsonl"
    proc, err = _start(_argv(lengths_file, log, "--timeout", "30"), tmp_path)
    ranks = _wait_training(proc, log)
    os.kill(ranks[2], signal.SIGKILL)
    _ended_within(proc, SLACK_S)
    assert proc.exitcode == 1
    assert "zeppelin-rank2 was killed by signal 9" in _one_line(err)
    assert not any(_alive(r) for r in ranks)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_die_with_their_launcher(lengths_file, tmp_path, sig):
    log = tmp_path / "log.jsonl"
    proc, err = _start(_argv(lengths_file, log, "--timeout", "30"), tmp_path)
    ranks = _wait_training(proc, log)
    os.kill(proc.pid, sig)
    proc.join(30)
    deadline = time.monotonic() + 10
    while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(r) for r in ranks), "a rank outlived its launcher by 10 s"
    if sig == signal.SIGTERM:
        assert proc.exitcode == 128 + signal.SIGTERM
        assert _one_line(err).endswith("stopped by SIGTERM; every rank was stopped")


_real_save_state = trainer.save_state


def _save_killed_midway(directory, state):
    """Rank 0's save: half of the checkpoint is written, then the writer is SIGKILLed."""
    real_save = torch.save

    def half(obj, f):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = half
    _real_save_state(directory, state)


@pytest.mark.slow
def test_a_save_killed_into_the_load_folder_leaves_a_checkpoint_that_resumes_exactly(lengths_file, tmp_path,
                                                                                   monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    first, second, third = (tmp_path / f"{n}.jsonl" for n in ("first", "second", "third"))
    assert main_exit(_argv(lengths_file, first, "--save", ckpt, steps=2, strategy="reference")) == 0
    # Resume into the same folder; rank 0 is killed half-way through writing step 3's checkpoint.
    monkeypatch.setattr(trainer, "save_state", _save_killed_midway)   # inherited by the forked ranks
    assert main_exit(_argv(lengths_file, second, "--load", ckpt, "--save", ckpt, steps=3,
                           strategy="reference")) == 1
    monkeypatch.undo()
    assert (Path(ckpt) / "latest").read_text() == "step_000002.pt\n"
    # The step-2 checkpoint still loads, and training from it repeats the killed run's step 2 bit for bit.
    assert main_exit(_argv(lengths_file, third, "--load", ckpt, steps=3, strategy="reference")) == 0
    killed, resumed = json.loads(second.read_text().splitlines()[-1]), json.loads(third.read_text())
    assert killed["step"] == resumed["step"] == 2
    assert (killed["loss"], killed["grad_norm"]) == (resumed["loss"], resumed["grad_norm"])


def main_exit(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exc:
        return exc.code
    return 0
