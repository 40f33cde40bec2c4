"""The real ``pretrain_gpt.py --zeppelin`` -- Megatron-LM's own ``pretrain()`` loop, optimizer,
logging, evaluation and ``torch_dist`` checkpoints -- on CPU gloo ranks (skipped without
``MEGATRON_LM_DIR``, a Megatron-LM checkout at core_v0.16.1).

Two ``torchrun`` launchers ("nodes") of 2 ranks each, with a c10d rendezvous on
127.0.0.1, train the ``tiny-cpu`` preset for 20 iterations with ``--save-interval 10``;
a second run resumes from the iteration-10 checkpoint and trains iterations 11-20.
Megatron-LM's training path calls CUDA unconditionally; ``cpu_pretrain/sitecustomize.py``
guards those calls (and says which it used) without changing what is computed.

* both runs log the same loss and grad norm for iterations 11-20 (iteration 12 of the
  resumed run excepted: Megatron-LM's ``training_log`` logs the mean of 11 and 12
  there, see docs/megatron-lm.md), the same final validation loss, and the same
  Zeppelin batches (sequences, tokens, ``remap_bytes``) from batch 10 on;
* every ``--zeppelin-log-interval`` line has ``remap_bytes`` > 0;
* the loss falls.
"""

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.indexed_data import write_dataset
from tests.integration.test_megatron_lm_e2e import _free_port

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).parent / "cpu_pretrain"
MLM = os.environ.get("MEGATRON_LM_DIR")
ITERS, RESUME_AT = 20, 10
RUN_TIMEOUT_S, FAILED_PEER_GRACE_S = 480, 60

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not MLM, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout at core_v0.16.1 to run its pretrain()")]

ITERATION = re.compile(r"iteration +(\d+)/ *\d+ \|.*\| lm loss: (\S+) \|.*\| grad norm: (\S+) \|")
ZEPPELIN_BATCH = re.compile(r"zeppelin batch (\d+): (.*remap_bytes=(\d+))")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A patched copy of the whole checkout: Megatron builds its dataset helpers inside
    its tree at start-up, so MEGATRON_LM_DIR itself stays untouched."""
    for module in ("pybind11", "psutil"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"pretrain_gpt.py needs {module} (pip install -e '.[megatron]', docs/megatron-lm.md step 1)")
    root = tmp_path_factory.mktemp("pretrain") / "Megatron-LM"
    shutil.copytree(MLM, root, ignore=shutil.ignore_patterns(".git", "build", "*.so"))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "apply_megatron_patch.sh"), str(root)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    if "core_v0.16.1" not in r.stdout:
        pytest.skip("Megatron-LM's pretrain() runs here at core_v0.16.1 (later tags need Python >= 3.12)")
    return root


def pretrain_argv(data: str, ckpt: str, pp: int = 1, decide: bool = True) -> list[str]:
    """The tiny-cpu preset's pretrain_gpt.py flags, on ``data``, saving to and loading from ``ckpt``
    (its Plans to ``ckpt``/plans), at ``--pipeline-model-parallel-size pp``; ``decide=False``:
    ``--zeppelin-decide off`` (the planner's first plan, remapping every batch)."""
    preset = subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", "tiny-cpu", "--print-args",
                             "--only", "megatron"], capture_output=True, text=True, check=True).stdout.split()
    return [*preset, "--data-path", data, "--save", ckpt, "--load", ckpt, "--train-iters", str(ITERS),
            "--distributed-backend", "gloo", "--pipeline-model-parallel-size", str(pp),
            "--zeppelin-plan-dump-dir", str(Path(ckpt) / "plans"), *([] if decide else ["--zeppelin-decide", "off"])]


def kill_launcher(launcher: subprocess.Popen) -> None:
    """Kill a torchrun launcher and its ranks: torchrun starts each rank in a session of its own,
    so killing the launcher's process group alone would leave them running."""
    import psutil

    ranks = psutil.Process(launcher.pid).children(recursive=True)
    os.killpg(launcher.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    launcher.wait()


def torchrun_two_nodes(checkout: Path, argv: list[str], log: Path) -> str:
    """``torchrun --nnodes 2 --nproc-per-node 2 --node-rank N ... pretrain_gpt.py ARGV`` for N = 0, 1;
    both launchers' output.  Both launchers and their ranks are killed after RUN_TIMEOUT_S, or
    FAILED_PEER_GRACE_S after one launcher failed (its peer may wait in the rendezvous)."""
    path = [str(SHIM), str(checkout), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    # Megatron's dataset-helper Makefile runs `python3 -m pybind11` from PATH: this interpreter's,
    # as in an activated venv.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    endpoint = f"127.0.0.1:{_free_port()}"
    logs = [log.with_suffix(f".node{node}.log") for node in (0, 1)]
    procs = []
    for node, out in enumerate(logs):
        with out.open("w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                 "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id",
                 "cpu-pretrain", "pretrain_gpt.py", *argv], cwd=checkout, env=env, stdout=f,
                stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() for p in procs):
                deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
            time.sleep(1)
    finally:
        killed = [p.pid for p in procs if p.poll() is None]
        for p in procs:
            if p.pid in killed:
                kill_launcher(p)
    out = "\n".join(f.read_text() for f in logs)
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", out)
    if any(p.returncode for p in procs) and missing:
        pytest.skip(f"Megatron-LM needs {missing.group(1)} (see docs/megatron-lm.md, step 1)")
    assert not killed and [p.returncode for p in procs] == [0, 0], (
        f"launchers {killed} killed at the deadline\n" if killed else "") + out[-6000:]
    return out


def iterations(out: str) -> dict[int, tuple[float, str]]:
    """Megatron's logged (lm loss, grad norm) per iteration."""
    return {int(m[1]): (float(m[2]), m[3]) for m in ITERATION.finditer(out)}


def zeppelin_batches(out: str) -> dict[int, str]:
    """Each ``--zeppelin-log-interval`` line up to its remap_bytes (the rates after it are wall time)."""
    return {int(m[1]): m[2] for m in ZEPPELIN_BATCH.finditer(out)}


@pytest.mark.parametrize("pp, decide", [(1, False), (2, True)], ids=["dp4-remap-every-batch", "pp2-dp2"])
def test_pretrain_gpt_trains_saves_and_resumes_on_two_cpu_launchers(checkout, tmp_path, pp, decide):
    """``dp4-remap-every-batch``: ``--zeppelin-decide off``, so every batch remaps (on this
    tiny model the default decision remaps few or none: it remaps where the replay says
    it pays).  ``pp2-dp2``: the default decision, ``--pipeline-model-parallel-size 2``
    (each launcher one stage of 2 data-parallel ranks, 2 micro-batches per global batch
    through Megatron-Core's 1F1B schedule): the torch_dist checkpoint holds each stage's
    layers, the ``--zeppelin-log-interval`` report is summed after each step's schedule."""
    rng = np.random.default_rng(7)
    lengths = np.concatenate([[500, 480, 460, 440] * 4, rng.integers(8, 200, 400)])
    rng.shuffle(lengths)
    data = write_dataset(str(tmp_path / "docs"), lengths.astype(np.int64))
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"

    start = time.monotonic()
    straight = torchrun_two_nodes(checkout, pretrain_argv(data, str(straight_dir), pp, decide), tmp_path / "straight")
    # The checkpoint a run stopped after iteration 10 leaves (the tracker names its last save).
    shutil.copytree(straight_dir / f"iter_{RESUME_AT:07d}", resumed_dir / f"iter_{RESUME_AT:07d}")
    (resumed_dir / "latest_checkpointed_iteration.txt").write_text(str(RESUME_AT))
    resumed = torchrun_two_nodes(checkout, pretrain_argv(data, str(resumed_dir), pp, decide), tmp_path / "resumed")
    seconds = time.monotonic() - start

    assert f"saving checkpoint at iteration {RESUME_AT:7d} to {straight_dir} in torch_dist format" in straight
    assert f"successfully loaded checkpoint from {resumed_dir} [ t 1/1, p 1/{pp} ] at iteration {RESUME_AT}" in resumed
    a, b = iterations(straight), iterations(resumed)
    assert sorted(a) == list(range(1, ITERS + 1)) and sorted(b) == list(range(RESUME_AT + 1, ITERS + 1))
    for it in b:
        if it == RESUME_AT + 2:
            # Megatron's training_log logs a process's first iteration without resetting
            # its sums: the resumed run's second logged loss is the mean of both.
            assert b[it][0] == pytest.approx((a[it - 1][0] + a[it][0]) / 2, rel=2e-6), (a, b)
            assert b[it][1] == a[it][1]
        else:
            assert b[it] == a[it], (it, a[it], b[it])
    assert a[ITERS][0] < a[1][0] - 0.3  # it learns
    final = re.compile(r"validation loss at iteration 20 \| lm loss value: (\S+)")
    assert final.findall(straight) and final.findall(straight) == final.findall(resumed)

    za, zb = zeppelin_batches(straight), zeppelin_batches(resumed)
    remap = {batch: int(line.rsplit("=", 1)[1]) for batch, line in za.items()}
    # Rank 0 logs each iteration when the next batch is handed out: the last has no line.
    assert sorted(remap) == list(range(ITERS - 1)), za
    # A batch moved bytes exactly when one of its micro-batches' Plans remaps tokens (over
    # 2 data-parallel ranks, PP 2, a Plan whose attention layout already balances the
    # tokens moves none).
    plans = {}
    for f in (straight_dir / "plans").glob("train_plan_*.json"):
        plans.setdefault(int(f.name.split("_")[2].split(".")[0]), []).append(json.loads(f.read_text()))
    assert {k: b > 0 for k, b in remap.items()} == {k: any(p["remap"] for p in plans[k]) for k in remap}, za
    # Remapping every batch, most move tokens; the decision remaps where the replay says it
    # pays (here a few batches: planner/settle.py), and some must for the check above to
    # cover the remap's traffic.
    assert sum(b > 0 for b in remap.values()) > (0 if decide else ITERS // 2), za
    assert sorted(zb) == list(range(RESUME_AT, ITERS - 1)) and all(zb[k] == za[k] for k in zb), (za, zb)

    guards = sorted({g for line in re.findall(r"cpu_pretrain: rank \d guarded (.*)", straight + resumed)
                     for g in re.sub(r" x\d+", "", line).split(", ")})
    assert guards, "the CPU shim did not run"
    print(f"wall time of both runs: {seconds:.0f} s")
    print("iteration  straight (loss, grad norm)  resumed")
    for it in b:
        print(f"{it:9d}  {a[it][0]:.6E} {a[it][1]}  {b[it][0]:.6E} {b[it][1]}")
    print(f"remap_bytes per batch (straight run): {[remap[k] for k in sorted(remap)]}")
    print("CUDA calls guarded:", "; ".join(guards))
