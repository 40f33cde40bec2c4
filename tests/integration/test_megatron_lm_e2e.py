"""End to end through Megatron-LM's own code (skipped without ``MEGATRON_LM_DIR``).

Applies the patch to a copy of a core_v0.16.1 checkout (or core_v0.19.0 under
Python >= 3.12, which that tag needs), then on 2 gloo ranks
builds the model through the patched ``pretrain_gpt.py`` functions with
``--zeppelin-remap on`` and trains 4 global batches (``megatron_lm_e2e.py``):

* the MLPs saw the token-balanced layout (linear rows max/mean <= 1.05) on
  batches whose attention layout is not balanced in tokens;
* each ``--zeppelin-log-interval`` line carries ``remap_bytes=<int>`` > 0;
* a ``torch_dist`` save half way loads into a fresh model and training goes on;
* every step's loss equals the project's trainer (plain data parallelism) on
  the same global batches from the same weights.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.indexed_data import write_dataset

ROOT = Path(__file__).resolve().parents[2]
MLM = os.environ.get("MEGATRON_LM_DIR")
STEPS = 4

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not MLM, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout at core_v0.16.1 (or core_v0.19.0 under "
                    "Python >= 3.12) to run Megatron-LM's code")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """A patched copy of the checkout's Python sources (MEGATRON_LM_DIR stays untouched)."""
    root = tmp_path_factory.mktemp("mlm")
    for f in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron/core/package_info.py"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(MLM) / f, root / f)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "apply_megatron_patch.sh"), str(root)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    if "core_v0.16.1" not in r.stdout and sys.version_info < (3, 12):
        pytest.skip("Megatron-LM's per-step code runs here at core_v0.16.1 (later tags need Python >= 3.12)")
    for driver in ("megatron_lm_e2e.py", "megatron_lm_resume.py"):
        shutil.copy(Path(__file__).parent / driver, root)
    return root


def _dataset(tmp_path) -> str:
    # Long documents beside many short ones: the attention layout balances quadratic
    # work, so the ranks' token counts differ; the remap must even them out.
    rng = np.random.default_rng(7)
    lengths = np.concatenate([[500, 480, 460, 440], rng.integers(8, 40, 120)])
    rng.shuffle(lengths)
    return write_dataset(str(tmp_path / "docs"), lengths.astype(np.int64))


def _one_node_cluster(tmp_path, gpus: int) -> Path:
    cluster = tmp_path / "one-node.yaml"
    text = (ROOT / "configs" / "clusters" / "cpu-sim.yaml").read_text()
    # One node of "GPUs" whose link is so slow that no ring pays off: every document
    # stays on one rank, so balancing attention work leaves token counts uneven.
    text = re.sub(r"(?m)^nodes: 2", "nodes: 1", text)
    text = re.sub(r"(?m)^gpus_per_node: \d+", f"gpus_per_node: {gpus}", text)
    cluster.write_text(re.sub(r"(?m)^(\s+)latency_us: 200", r"\g<1>latency_us: 1000000", text))
    return cluster


def _env(patched) -> dict:
    # The patched scripts first; the package `megatron` comes from the checkout itself.
    path = [str(patched), MLM, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _start_ranks(patched, world: int, *argv: str, **env_extra: str) -> list[subprocess.Popen]:
    """``python ARGV`` started as ``world`` gloo ranks in the patched tree."""
    env = {**_env(patched), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           **env_extra}
    return [subprocess.Popen([sys.executable, *argv], cwd=patched, env={**env, "RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]


def _run_ranks(patched, world: int, *argv: str) -> str:
    """``python ARGV`` as ``world`` gloo ranks in the patched tree; rank 0's output."""
    procs = _start_ranks(patched, world, *argv)
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", err)
        if p.returncode and missing:
            pytest.skip(f"Megatron-LM needs {missing.group(1)} (see docs/megatron-lm.md, step 1)")
        assert p.returncode == 0, outs[0][0][-2000:] + err[-4000:]
    return outs[0][0]


def _run_driver(patched, tmp_path, world: int, model: str, *flags: str) -> tuple[str, list[list[str]]]:
    """Run ``megatron_lm_e2e.py`` on ``world`` gloo ranks with Megatron-LM ``flags``;
    rank 0's output and its STEP lines (split)."""
    prefix, cluster = _dataset(tmp_path), _one_node_cluster(tmp_path, world)
    (tmp_path / "ckpt").mkdir()  # Megatron's save_checkpoint makes the iteration directory first
    out = _run_ranks(patched, world, "megatron_lm_e2e.py", prefix, str(cluster), str(tmp_path / "ckpt"), str(STEPS),
                     model, *flags)
    print("\n".join(line for line in out.splitlines() if line.startswith(("STEP", "zeppelin batch", "RESUMED", "MOE"))))
    steps = [line.split() for line in out.splitlines() if line.startswith("STEP ")]
    assert [int(s[1]) for s in steps] == list(range(STEPS)), out
    for _, _, megatron_loss, trainer_loss, *_ in steps:
        assert float(megatron_loss) == pytest.approx(float(trainer_loss), rel=1e-5, abs=1e-6)
    assert "RESUMED torch_dist" in out
    return out, steps


def test_megatron_lm_path_matches_the_trainer_with_remap_and_torch_dist(patched, tmp_path):
    out, steps = _run_driver(patched, tmp_path, 2, "tiny")
    for _, _, _, _, attention, linear, *_ in steps:
        assert float(linear) <= 1.05  # what the MLP saw: the token-balanced layout
    assert max(float(s[4]) for s in steps) > 1.1  # ...where the attention layout was not
    remap = [int(m) for m in re.findall(r"remap_bytes=(\d+)", out)]
    assert len(remap) == STEPS and all(b > 0 for b in remap), out


def test_per_batch_decision(patched, tmp_path):
    """``--zeppelin-decide on``: on this cluster (links so slow that every document
    stays on one rank) the modeled step says the remap's all-to-all never pays, so
    no batch remaps; the losses still equal plain data parallelism's.  (The other
    tests run with ``--zeppelin-decide off``, which megatron_lm_e2e.py passes: every
    batch remaps.)"""
    out, steps = _run_driver(patched, tmp_path, 2, "tiny", "--zeppelin-decide", "on")
    remap = [int(m) for m in re.findall(r"remap_bytes=(\d+)", out)]
    assert len(remap) == STEPS and not any(remap), out


def _mlp_rows(step: list[str]) -> tuple[list[int], list[int]]:
    """The rows each rank's first MLP saw and the Plan's linear tokens per data-parallel rank."""
    fields = dict(f.split("=", 1) for f in step if "=" in f)
    parse = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    return parse(fields["linear"]), parse(fields["plan_linear"])


def test_tensor_and_sequence_parallel(patched, tmp_path):
    """``--tensor-model-parallel-size 2 --sequence-parallel`` on 4 gloo ranks (2
    data-parallel ranks): Megatron-Core's sequence-parallel layers on CPU
    (``megatron/cpu_compat.py``), the remapped MLP under SP; every step's loss equals
    the trainer's reference at TP 2 with SP, and each TP rank's MLP saw half of its
    data-parallel rank's linear-layout rows (padded to a multiple of 2)."""
    out, steps = _run_driver(patched, tmp_path, 4, "tiny", "--tensor-model-parallel-size", "2",
                             "--sequence-parallel")
    for step in steps:
        rows, plan_linear = _mlp_rows(step)
        assert rows == [-(-plan_linear[rank // 2] // 2) for rank in range(4)], (rows, plan_linear)
    assert "remap_bytes=" in out


@pytest.mark.parametrize("ep, tp", [(1, 1), (2, 1), (2, 2)], ids=["allgather", "alltoall-ep2", "alltoall-tp2-sp-ep2"])
def test_moe(patched, tmp_path, ep, tp):
    """An MoE model through Megatron-LM's own flags (4 experts, top-2, no
    load-balancing loss, no token dropping) with remap on: the router runs on the
    token-balanced layout and every step's loss equals the trainer's reference on
    the tiny-moe preset (the same shapes, the same expert layout).  ``allgather``:
    every expert on both ranks; ``alltoall-ep2``: ``--expert-model-parallel-size 2``,
    two experts per rank, tokens sent to them by Megatron-Core's all-to-all
    dispatcher (on gloo through ``megatron/cpu_compat.py``), the torch_dist save
    holding each rank's experts; ``alltoall-tp2-sp-ep2``: also TP 2 with sequence
    parallelism on 4 ranks (each expert split over the TP ranks, the dispatcher's
    token gathers over them uneven)."""
    dispatcher = "allgather" if ep == 1 else "alltoall"
    parallel = ("--tensor-model-parallel-size", "2", "--sequence-parallel") if tp > 1 else ()
    out, steps = _run_driver(patched, tmp_path, 2 * tp, "tiny-moe", "--num-experts", "4", "--moe-router-topk", "2",
                             "--moe-ffn-hidden-size", "64", "--moe-router-load-balancing-type", "none",
                             "--moe-token-dispatcher-type", dispatcher, "--expert-model-parallel-size", str(ep),
                             *parallel)
    kind = "MoEAllGatherTokenDispatcher" if ep == 1 else "MoEAlltoAllTokenDispatcher"
    assert f"MOE local_experts={4 // ep} dispatcher={kind}" in out
    for step in steps:
        rows, plan_linear = _mlp_rows(step)
        # The router saw the linear layout (under SP: each TP rank its half, padded).
        assert rows == [-(-plan_linear[rank // tp] // tp) for rank in range(2 * tp)], (rows, plan_linear)
    remap = [int(m) for m in re.findall(r"remap_bytes=(\d+)", out)]
    assert len(remap) == STEPS and all(b > 0 for b in remap), out


def _tiny_cpu_argv() -> list[str]:
    """The tiny-cpu preset's Megatron-LM flags."""
    return subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", "tiny-cpu", "--print-args",
                           "--only", "megatron"], capture_output=True, text=True, check=True).stdout.split()


def _refused_before_launch(patched, argv, world: int) -> str:
    """The real ``pretrain_gpt.py ARGV`` as rank 0 of ``world`` with no MASTER_ADDR (reaching
    init_process_group would fail): it must stop with one ``pretrain_gpt.py: error:``
    line and exit 2; that line."""
    env = {**_env(patched), "WORLD_SIZE": str(world), "RANK": "0", "MASTER_ADDR": "", "MASTER_PORT": ""}
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=patched, env=env, capture_output=True,
                       text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("pp, layers, tp, dp", [(2, 2, 1, 2), (4, 4, 1, 1), (2, 2, 2, 1), (2, 2, 2, 2)],
                         ids=["pp2-dp2", "pp4-dp1", "pp2-tp2-sp", "pp2-tp2-sp-dp2"])
def test_pipeline_parallel(patched, tmp_path, pp, layers, tp, dp):
    """``--pipeline-model-parallel-size P`` on gloo ranks (PP 2 x DP 2; PP 4 x DP 1,
    whose two middle stages read no token; PP 2 x TP 2 with sequence parallelism,
    each stage's sequence-parallel block holding its own layers, on 4 and on 8 ranks
    (DP 1 and 2)), 4 micro-batches per global batch, each step a global batch of its own:
    Megatron-Core's 1F1B schedule runs the patched ``forward_step``; the hidden
    states cross each boundary with the rank's token count in the micro-batch's Plan
    (``variable_seq_lengths``; the driver checks every stage's first layer got
    exactly that, and which stages read tokens); half way Megatron-LM's
    ``save_checkpoint`` (``torch_dist``) saves, a fresh model loads it, new loaders
    resume from its data state with the micro-batches the uninterrupted run would
    train; every step's loss equals the trainer's reference at the same PP on the
    same micro-batches (which never resumed).  ``--zeppelin-log-interval 1`` prints one
    line per iteration whose remap_bytes is what every rank counted.  A resume
    of that checkpoint at another pipeline size is refused in one line before any
    process group."""
    tensor_parallel = ("--tensor-model-parallel-size", "2", "--sequence-parallel") if tp > 1 else ()
    _, prefix, cluster, checkpointing = _pipeline_run(
        patched, tmp_path, pp * tp * dp, dp, "tiny", "--pipeline-model-parallel-size", str(pp), "--num-layers",
        str(layers), "--global-batch-size", str(4 * dp), *tensor_parallel)
    if (pp, tp, dp) == (2, 1, 2):
        argv = [*_tiny_cpu_argv(), "--data-path", prefix, "--split", "100,0,0", "--zeppelin-cluster", str(cluster),
                "--global-batch-size", "8", "--train-iters", "8", "--num-layers", "2", *checkpointing]
        error = _refused_before_launch(patched, argv, 4)
        print(error)
        assert "--load" in error and "--pipeline-model-parallel-size 2" in error, error


def test_pipeline_parallel_with_expert_parallel_moe(patched, tmp_path):
    """PP 2 x EP 2 on 4 gloo ranks (2 data-parallel ranks per stage, each holding 2 of
    the 4 experts of each of its layers; Megatron-Core's all-to-all dispatcher, the
    only one that takes per-micro-batch shapes): what test_pipeline_parallel checks
    (boundary shapes, torch_dist save/resume, the report), every loss equal to the
    trainer's reference at the same PP and EP."""
    out = _pipeline_run(patched, tmp_path, 4, 2, "tiny-moe", "--pipeline-model-parallel-size", "2", "--num-layers",
                        "2", "--global-batch-size", "8", "--num-experts", "4", "--moe-router-topk", "2",
                        "--moe-ffn-hidden-size", "64", "--moe-router-load-balancing-type", "none",
                        "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2")[0]
    assert "MOE local_experts=2 dispatcher=MoEAlltoAllTokenDispatcher" in out


def _pipeline_run(patched, tmp_path, world: int, dp: int, model: str,
                  *flags: str) -> tuple[str, str, Path, tuple[str, ...]]:
    """``megatron_lm_e2e.py`` under PP on ``world`` gloo ranks (``dp`` data-parallel) with Megatron-LM ``flags``
    (4 micro-batches per global batch), saving to and resuming from a ``torch_dist``
    checkpoint, with the checks every PP layout passes; rank 0's output, the data
    prefix, the cluster file and the checkpoint flags."""
    prefix, cluster = _dataset(tmp_path), _one_node_cluster(tmp_path, world)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    checkpointing = ("--ckpt-format", "torch_dist", "--no-save-optim", "--no-load-optim", "--no-load-rng",
                     "--save", str(ckpt), "--load", str(ckpt))
    out = _run_ranks(patched, world, "megatron_lm_e2e.py", prefix, str(cluster), str(ckpt), str(STEPS), model,
                     "--zeppelin-tokens-per-gpu", "512", "--zeppelin-log-interval", "1", *checkpointing, *flags)
    steps = [line.split(" ", 5) for line in out.splitlines() if line.startswith("STEP ")]
    print("\n".join(" ".join(s) for s in steps))
    assert [int(s[1]) for s in steps] == list(range(STEPS)), out
    for _, _, megatron_loss, trainer_loss, _, _ in steps:
        assert float(megatron_loss) == pytest.approx(float(trainer_loss), rel=1e-5, abs=1e-6)
    assert [s[4] for s in steps] == [f"batch={k}" for k in range(STEPS)]  # a new global batch every step
    assert f"RESUMED torch_dist {ckpt} at iteration {STEPS // 2}" in out
    shapes = {n for s in steps for rank_rows in json.loads(s[5][len("rows="):]) for n in rank_rows}
    assert len(shapes) > 1  # the boundary shape changed between micro-batches
    # --zeppelin-log-interval 1: one line per iteration; its remap_bytes is what every rank's
    # remapping layers counted in all the iteration's micro-batches, summed after the schedule.
    counted = json.loads(next(line for line in out.splitlines() if line.startswith("REMAP "))[len("REMAP "):])
    logged = {int(m[1]): int(m[2]) for m in re.finditer(r"zeppelin batch (\d+): .*? in 4 micro-batches, .*"
                                                          r"remap_bytes=(\d+)", out)}
    print(f"remap_bytes per iteration: {logged}")
    # (The driver's last hand-off, which prints the last line, trained nothing: batch STEPS.)
    assert logged == {int(k): v for k, v in counted.items() if int(k) < STEPS}, (logged, counted)
    assert sorted(logged) == list(range(STEPS)), logged
    # One data-parallel rank holds every token in both layouts: nothing to move.
    assert all(logged.values()) if dp > 1 else not any(logged.values()), logged
    return out, prefix, cluster, checkpointing


def _iterations(out: str) -> list[list[list[int]]]:
    """The pieces each of the resume driver's iterations trained."""
    return [json.loads(line.split(" ", 2)[2]) for line in out.splitlines() if line.startswith("PIECES ")]


def test_resume_with_another_token_budget_trains_every_piece_once(patched, tmp_path):
    """Megatron-LM's own save_checkpoint / load_checkpoint (torch_dist) around the patched
    dataset provider: a run saved after 2 iterations at --zeppelin-tokens-per-gpu 400
    and resumed at 600 goes on at the first piece it had not trained: each iteration
    of both runs trains the next pieces of the sampler's order (its global batch;
    micro-batches reorder pieces inside it), none skipped or repeated.  A resume with
    another seed, a --save onto that checkpoint by another run, and a resume from a
    copy with a truncated shard are refused in one line by the real pretrain_gpt.py
    before any process group."""
    from megatron_zeppelin.integration.data import open_blends

    prefix, cluster = _dataset(tmp_path), _one_node_cluster(tmp_path, 2)
    common = ("megatron_lm_resume.py", prefix, str(cluster))
    flags = ("--global-batch-size", "4", "--train-iters", "8")
    ckpt = str(tmp_path / "ckpt")
    before = _run_ranks(patched, 2, *common, "2", *flags, "--zeppelin-tokens-per-gpu", "400", "--save", ckpt,
                        "--load", ckpt)
    after = _run_ranks(patched, 2, *common, "3", *flags, "--zeppelin-tokens-per-gpu", "600", "--save", ckpt,
                       "--load", ckpt)
    print(next(line for line in after.splitlines() if line.startswith("zeppelin: resuming")))
    assert "no piece is skipped or repeated" in after and "deferred a piece" not in before + after
    # The sampler's order of pieces (the preset's --seed 1234), two epochs of it.
    everything = open_blends([prefix], "100,0,0")["train"].sampler(max_seq_len=512, tokens_per_batch=10**9, seed=1234)
    order = [[p.dataset, p.doc, p.start, p.end] for _, batch in zip(range(2), everything) for p in batch.pieces]
    assert len(order) == 2 * 124  # every document is one piece (none longer than --seq-length)
    at = 0
    for pieces in _iterations(before) + _iterations(after):
        assert sorted(pieces) == sorted(order[at:at + len(pieces)])
        at += len(pieces)
    assert len(_iterations(before)) == 2 and len(_iterations(after)) == 3

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    latest = int((damaged / "latest_checkpointed_iteration.txt").read_text())
    shard = damaged / f"iter_{latest:07d}" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    for extra, message in (
            (("--load", str(damaged), "--save", str(damaged)),
             f"{shard} holds 1000 bytes, its index (.metadata) needs"),
            (("--load", ckpt, "--save", ckpt, "--seed", "7"),
             "the --load checkpoint drew its batches with seed (--zeppelin-seed, else --seed) = 1234, this run has 7"),
            (("--load", str(tmp_path / "new"), "--save", ckpt, "--seed", "7"),
             f"--save {ckpt} holds another run's checkpoint (--seed 1234 (this run: 7))")):
        error = _refused_before_launch(patched, [*_tiny_cpu_argv(), "--data-path", prefix, "--split", "100,0,0",
                                                 "--zeppelin-cluster", str(cluster), "--global-batch-size", "4",
                                                 "--train-iters", "8", *extra], 2)
        assert message in error, error
        print(error)


def test_a_global_batch_no_plan_holds_defers_a_piece(patched, tmp_path):
    """At --zeppelin-tokens-per-gpu 400 the 5th global batch's 9 sequences do not fit
    its 2 micro-batches of 800 tokens: the patched provider's loader defers its last
    piece (440 tokens) to the next global batch and says so; every piece of the
    sampler's order is trained once, none dropped.  Saved (Megatron-LM's
    save_checkpoint) with the piece still waiting and resumed, the run trains what
    the uninterrupted run trains, iteration by iteration."""
    from megatron_zeppelin.integration.data import open_blends

    prefix, cluster = _dataset(tmp_path), _one_node_cluster(tmp_path, 2)
    common = ("megatron_lm_resume.py", prefix, str(cluster))
    flags = ("--global-batch-size", "4", "--train-iters", "8", "--zeppelin-tokens-per-gpu", "400")
    straight_dir, ckpt = str(tmp_path / "straight"), str(tmp_path / "ckpt")
    straight = _run_ranks(patched, 2, *common, "8", *flags, "--save", straight_dir, "--load", straight_dir)
    notes = [line for line in straight.splitlines() if "deferred a piece" in line]
    print("\n".join(notes))
    assert notes and notes[0].startswith("zeppelin train: step 5: deferred a piece of 440 tokens (document 98")
    iterations = _iterations(straight)
    assert [0, 98, 0, 440] not in iterations[5] and iterations[6][0] == [0, 98, 0, 440]
    everything = open_blends([prefix], "100,0,0")["train"].sampler(max_seq_len=512, tokens_per_batch=10**9, seed=1234)
    order = [[p.dataset, p.doc, p.start, p.end] for _, batch in zip(range(2), everything) for p in batch.pieces]
    trained = [p for pieces in iterations for p in pieces]
    assert sorted(trained) == sorted(order[:len(trained)])  # none dropped, none twice
    _run_ranks(patched, 2, *common, "6", *flags, "--save", ckpt, "--load", ckpt)
    resumed = _iterations(_run_ranks(patched, 2, *common, "2", *flags, "--save", ckpt, "--load", ckpt))
    assert resumed == iterations[6:8]


def test_a_save_that_fails_on_one_rank_ends_the_run(patched, tmp_path):
    """Rank 1's save raises inside Megatron-LM's save_checkpoint (a full disk) while
    the Zeppelin loaders, their planning thread and the communicator are up: both
    ranks end on their own, long before --distributed-timeout-minutes (1 here);
    nothing Zeppelin runs keeps the dying rank alive.  (The hang of issue 21 was
    Megatron-Core's writer without psutil, refused before launch:
    test_data.py::test_a_torch_dist_save_without_psutil_is_refused.)"""
    import time

    prefix, cluster = _dataset(tmp_path), _one_node_cluster(tmp_path, 2)
    ckpt = str(tmp_path / "ckpt")
    start = time.monotonic()
    procs = _start_ranks(patched, 2, "megatron_lm_resume.py", prefix, str(cluster), "2", "--global-batch-size", "4",
                         "--train-iters", "8", "--zeppelin-tokens-per-gpu", "600", "--save", ckpt, "--load", ckpt,
                         "--distributed-timeout-minutes", "1", SAVE_FAULT_RANK="1")
    outs = [p.communicate(timeout=300) for p in procs]
    seconds = time.monotonic() - start
    assert [p.returncode != 0 for p in procs] == [True, True], [o[1][-1500:] for o in outs]
    assert "OSError: [Errno 28] No space left on device" in outs[1][1]
    # After Python's report, each rank's last line names it and the checkpoint that stays loadable.
    for rank, (_, err) in enumerate(outs):
        last = re.sub(r"^\[rank\d\]: ", "", err.strip().splitlines()[-1])  # torch prefixes a rank's stderr
        assert last.startswith(f"pretrain_gpt.py: error: rank {rank} stopped: "), last
        assert last.endswith(f"; no complete checkpoint in --save {ckpt}"), last
    assert "PIECES 1 " in outs[0][0] and seconds < 60, seconds
    print(f"both ranks ended {seconds:.1f} s after the start; their last lines:")
    print("\n".join(err.strip().splitlines()[-1] for _, err in outs))
