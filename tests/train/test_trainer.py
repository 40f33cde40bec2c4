"""End to end: the trainer's zeppelin run equals its reference run, step by step.

Runs fork their ranks from this process (``launch``), so each costs process
start-up and a few tiny steps, not a Megatron import.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan import Plan, Span
from megatron_zeppelin.sampler import Piece
from megatron_zeppelin.train import trainer
from megatron_zeppelin.train.__main__ import main
from megatron_zeppelin.train.batch import build_rank_batch, num_label_tokens
from megatron_zeppelin.train.cli import parse_args
from megatron_zeppelin.train.launch import ChildFailed, launch, supervise

#: Long-tailed document lengths: at 2 x 2 ranks x 192 tokens the longest documents
#: need rings (inside a node or across nodes), the short ones stay local.
LENGTHS = [300, 40, 20, 200, 140, 5, 12, 5, 200, 30, 5, 40, 12, 30, 30, 200, 8, 380, 64, 30, 12, 90, 200, 250]
KEYS = {"step", "loss", "grad_norm", "num_tokens", "plan", "attn_pairs_per_rank",
        "linear_tokens_per_rank", "attention_tokens_per_rank", "bytes", "step_time_s"}


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "lengths.txt"
    path.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return str(path)


def _argv(lengths_file: str, strategy: str, out, *extra: str, steps: int = 3) -> list[str]:
    return ["--nodes", "2", "--gpus-per-node", "2", "--strategy", strategy, "--model", "tiny",
            "--lengths", lengths_file, "--max-seq-len", "512", "--tokens-per-gpu", "192",
            "--steps", str(steps), "--seed", "7", "--quiet", "--timeout", "30",
            "--json-log", str(out), *extra]


def _train(lengths_file, strategy, out, *extra, steps=3) -> list[dict]:
    launch(parse_args(_argv(lengths_file, strategy, out, *extra, steps=steps)))
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(lengths_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return {
        "reference": _train(lengths_file, "reference", tmp / "ref.jsonl"),
        "zeppelin": _train(lengths_file, "zeppelin", tmp / "zep.jsonl", "--dump-plans", str(tmp / "plans"),
                           "--remap", "off", "--routing", "off"),
        "plans": [Plan.from_json(p.read_text()) for p in sorted((tmp / "plans").glob("*.json"))],
        "remap": _train(lengths_file, "zeppelin", tmp / "remap.jsonl", "--remap", "on", "--routing", "on"),
    }


def test_zeppelin_losses_equal_reference(runs):
    ref, zep = runs["reference"], runs["zeppelin"]
    assert [r["step"] for r in zep] == [0, 1, 2]
    for r, z in zip(ref, zep):
        assert z["num_tokens"] == r["num_tokens"]
        assert z["loss"] == pytest.approx(r["loss"], rel=1e-4)
        assert z["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    # Training moved the weights: the losses of later steps differ from step 0.
    assert len({round(r["loss"], 6) for r in ref}) == 3


def test_remap_and_routing_keep_the_losses(runs):
    for r, z in zip(runs["reference"], runs["remap"]):
        assert z["loss"] == pytest.approx(r["loss"], rel=1e-4)
        linear, attention = z["linear_tokens_per_rank"], z["attention_tokens_per_rank"]
        assert sum(linear) == sum(attention) == z["num_tokens"]
    # Without the remapping layer the linear layout is the attention layout and nothing is remapped.
    assert all(z["linear_tokens_per_rank"] == z["attention_tokens_per_rank"] for z in runs["zeppelin"])
    assert all(z["bytes"]["remap_intra_node"] == z["bytes"]["remap_inter_node"] == 0 for z in runs["zeppelin"])
    # With it, every step whose layouts differ moves hidden states (4 switches per layer), and the
    # remap bytes are part of what the communicator sent.
    moved = [z for z in runs["remap"] if z["linear_tokens_per_rank"] != z["attention_tokens_per_rank"]]
    assert moved
    for z in moved:
        b = z["bytes"]
        assert b["remap_intra_node"] + b["remap_inter_node"] > 0
        assert b["remap_intra_node"] <= b["intra_node"]


def test_json_lines_report_what_ran(runs):
    zep, plans = runs["zeppelin"], runs["plans"]
    assert len(plans) == len(zep)
    for record, plan in zip(zep, plans):
        assert KEYS <= set(record)
        tiers = plan.tier_counts()
        assert record["plan"] == {"local": tiers.local, "intra": tiers.intra, "inter": tiers.inter,
                                  "ulysses": tiers.ulysses}
        assert record["attn_pairs_per_rank"] == plan.attn_pairs_per_rank()
        assert record["linear_tokens_per_rank"] == plan.linear_tokens_per_rank()
        assert record["num_tokens"] == sum(plan.seq_lens)
        assert len(record["bytes"]["inter_node_per_nic"]) == 2
        if tiers.inter:
            assert sum(map(sum, record["bytes"]["inter_node_per_nic"])) > 0
    # The lengths call for local and distributed attention in the same step.
    assert any(r["plan"]["local"] and r["plan"]["intra"] + r["plan"]["inter"] + r["plan"]["ulysses"]
               for r in zep)
    assert all(sum(map(sum, r["bytes"]["inter_node_per_nic"])) == 0 and r["bytes"]["intra_node"] == 0
               for r in runs["reference"])


def test_resume_is_exact(lengths_file, runs, tmp_path):
    _train(lengths_file, "reference", tmp_path / "a.jsonl", "--save", str(tmp_path / "ckpt"), steps=2)
    resumed = _train(lengths_file, "reference", tmp_path / "b.jsonl", "--load", str(tmp_path / "ckpt"))
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == runs["reference"][2]["loss"]
    assert resumed[0]["grad_norm"] == runs["reference"][2]["grad_norm"]


#: Real long-tailed lengths; 2 x 2 ranks x 256 tokens per micro-batch, pieces up to 512.
TINY_LONGTAIL = "configs/lengths/tiny-longtail.npy"


def _micro_argv(strategy: str, out, tokens_per_gpu: int, *extra: str, steps: int = 3) -> list[str]:
    return ["--nodes", "2", "--gpus-per-node", "2", "--strategy", strategy, "--model", "tiny",
            "--lengths", TINY_LONGTAIL, "--max-seq-len", "512", "--tokens-per-gpu", str(tokens_per_gpu),
            "--steps", str(steps), "--seed", "1", "--quiet", "--timeout", "60", "--json-log", str(out), *extra]


def _train_saving_grads(argv: list[str], grads_dir, monkeypatch, ranks=(0,)) -> list[dict]:
    """Train; each of ``ranks`` saves every step's summed gradient per parameter to
    ``grads_dir`` (``NNN.pt`` from rank 0, ``NNN.rank<r>.pt`` from rank r)."""
    real = trainer.allreduce_grads
    steps_done = [0]   # per rank: each forked rank counts its own steps

    def saving(model, *args):
        norm = real(model, *args)
        rank = torch.distributed.get_rank()
        if rank in ranks:
            name = f"{steps_done[0]:03d}" + (f".rank{rank}" if rank else "")
            torch.save({n: p.grad.clone() for n, p in model.named_parameters()}, grads_dir / f"{name}.pt")
        steps_done[0] += 1
        return norm

    grads_dir.mkdir()
    with monkeypatch.context() as m:
        m.setattr(trainer, "allreduce_grads", saving)  # inherited by the forked ranks
        launch(parse_args(argv))
    out = argv[argv.index("--json-log") + 1]
    return [json.loads(line) for line in open(out).read().splitlines()]


def _assert_same_grads(dir_a, dir_b, steps: int, rel: float) -> None:
    files = sorted(dir_a.glob("*.pt"))
    assert [f.name for f in files] == [f.name for f in sorted(dir_b.glob("*.pt"))] and len(files) == steps
    for f in files:
        a, b = torch.load(f), torch.load(dir_b / f.name)
        assert a.keys() == b.keys()
        for name in a:
            assert (a[name] - b[name]).norm() <= rel * b[name].norm(), (f.name, name)


def test_micro_batches_equal_one_big_batch(tmp_path, monkeypatch):
    """--micro-batches 4 (zeppelin, remap and routing on, 256 tokens per GPU) against
    the reference on the same global batches as one batch (4 x 256 tokens per GPU):
    losses and every parameter's gradient, step by step."""
    micro = _train_saving_grads(_micro_argv("zeppelin", tmp_path / "m.jsonl", 256, "--micro-batches", "4"),
                                tmp_path / "gm", monkeypatch)
    big = _train_saving_grads(_micro_argv("reference", tmp_path / "b.jsonl", 1024), tmp_path / "gb", monkeypatch)
    for m, b in zip(micro, big):
        assert m["num_tokens"] == b["num_tokens"] == sum(m["micro_batch_tokens"])
        assert len(m["micro_batch_tokens"]) == 4 and len(b["micro_batch_tokens"]) == 1
        assert max(m["linear_tokens_per_rank"]) > 256  # more than one micro-batch's cap per rank ran
        assert m["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert any(m["plan"]["intra"] + m["plan"]["inter"] for m in micro)  # rings in the micro-batches
    _assert_same_grads(tmp_path / "gm", tmp_path / "gb", steps=3, rel=1e-5)
    # Resume with micro-batches: 2 steps saved, the third equals the uninterrupted run's
    # (the sampler state saved is the trained batch's, not the one planned ahead).
    resumed_from = tmp_path / "ckpt2"
    launch(parse_args(_micro_argv("zeppelin", tmp_path / "s.jsonl", 256, "--micro-batches", "4",
                                  "--save", str(resumed_from), steps=2)))
    launch(parse_args(_micro_argv("zeppelin", tmp_path / "r.jsonl", 256, "--micro-batches", "4",
                                  "--load", str(resumed_from))))
    resumed = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == micro[2]["loss"] and resumed[0]["grad_norm"] == micro[2]["grad_norm"]


def test_tensor_parallel_equals_reference_at_the_same_tp(tmp_path, monkeypatch):
    """--tp 2 on 2 x 2 ranks (2 data-parallel ranks, one per node: every ring crosses
    nodes), remap and routing on, against the reference at TP 2: losses and each TP
    rank 0 shard's gradient."""
    zep = _train_saving_grads(_micro_argv("zeppelin", tmp_path / "z.jsonl", 384, "--tp", "2"), tmp_path / "gz",
                              monkeypatch)
    ref = _train_saving_grads(_micro_argv("reference", tmp_path / "r.jsonl", 384, "--tp", "2"), tmp_path / "gr",
                              monkeypatch)
    for z, r in zip(zep, ref):
        assert len(z["linear_tokens_per_rank"]) == len(z["attn_pairs_per_rank"]) == 2  # data-parallel ranks
        assert z["num_tokens"] == r["num_tokens"] and z["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert z["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert any(z["plan"]["inter"] for z in zep)
    # TP itself is exact: the reference at TP 2 equals the one at TP 1 (4 data-parallel
    # ranks of half the tokens each: the same global batches), gradient norm included.
    launch(parse_args(_micro_argv("reference", tmp_path / "p.jsonl", 192)))
    plain = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    for p, r in zip(plain, ref):
        assert p["num_tokens"] == r["num_tokens"] and p["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert p["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    # Both NICs of each node carried ring bytes: TP rank 1's GPUs sit on the second NIC.
    assert any(all(all(n) for n in z["bytes"]["inter_node_per_nic"]) for z in zep)
    _assert_same_grads(tmp_path / "gz", tmp_path / "gr", steps=3, rel=1e-5)


def test_tensor_parallel_and_moe_bad_inputs_exit_2_before_spawning(lengths_file, tmp_path, capsys, monkeypatch):
    from megatron_zeppelin.train import launch as launch_module

    monkeypatch.setattr(launch_module, "spawn_local", lambda cfg: pytest.fail("spawned ranks"))
    argv = _argv(lengths_file, "zeppelin", tmp_path / "x.jsonl")
    assert "--tp 3 does not divide --gpus-per-node (2)" in _one_error_line(capsys, [*argv, "--tp", "3"])
    one_node = [*argv, "--nodes", "1", "--gpus-per-node", "4", "--tp", "4"]  # tiny: 4 heads, 2 KV heads
    assert "--tp 4 does not divide model tiny's KV heads (2)" in _one_error_line(capsys, one_node)
    assert "needs --tp > 1" in _one_error_line(capsys, [*argv, "--sequence-parallel"])
    # llama-moe-8x7b spreads its 8 experts over 8 ranks: 2 x 2 has 4 data-parallel ranks.
    line = _one_error_line(capsys, [*argv, "--model", "llama-moe-8x7b"])
    assert "model llama-moe-8x7b's expert_parallel_size 8 does not divide the 4 data-parallel ranks" in line
    assert "pick an --ep" in line
    moe = [*argv, "--model", "tiny-moe"]
    assert "--ep 3 does not divide model tiny-moe's 4 experts" in _one_error_line(capsys, [*moe, "--ep", "3"])
    assert "model tiny has none" in _one_error_line(capsys, [*argv, "--ep", "2"])
    assert "need --sequence-parallel" in _one_error_line(capsys, [*moe, "--tp", "2"])


@pytest.mark.parametrize("tokens_per_gpu, parallel, steps", [(192, (), 3), (384, ("--tp", "2", "--sequence-parallel"), 2)],
                         ids=["dp", "tp2-sp"])
def test_moe_with_remap_equals_reference(tmp_path, monkeypatch, tokens_per_gpu, parallel, steps):
    """--model tiny-moe (Megatron-Core's MoE layer, 4 experts, top-2) with remap on: the
    router and experts run on the linear layout; losses and every parameter's gradient
    (router and expert weights included) equal the reference's at the same TP/SP.
    ``tp2-sp``: Megatron-Core's all-gather token dispatcher over the TP ranks, experts
    split over them (CPU ranks: ``megatron/cpu_compat.py``); its reference's losses
    also equal plain data parallelism's."""
    moe = ("--model", "tiny-moe", *parallel)
    zep = _train_saving_grads(_micro_argv("zeppelin", tmp_path / "z.jsonl", tokens_per_gpu, *moe, steps=steps),
                              tmp_path / "gz", monkeypatch)
    ref = _train_saving_grads(_micro_argv("reference", tmp_path / "r.jsonl", tokens_per_gpu, *moe, steps=steps),
                              tmp_path / "gr", monkeypatch)
    for z, r in zip(zep, ref):
        assert z["num_tokens"] == r["num_tokens"] and z["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert any(z["bytes"]["remap_intra_node"] + z["bytes"]["remap_inter_node"] for z in zep)
    names = torch.load(sorted((tmp_path / "gz").glob("*.pt"))[0]).keys()
    assert any("mlp.router" in n for n in names) and any("mlp.experts" in n for n in names)
    _assert_same_grads(tmp_path / "gz", tmp_path / "gr", steps=steps, rel=1e-5)
    if parallel:
        launch(parse_args(_micro_argv("reference", tmp_path / "p.jsonl", 192, "--model", "tiny-moe", steps=steps)))
        plain = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
        for p, r in zip(plain, ref):
            assert p["loss"] == pytest.approx(r["loss"], rel=1e-5)


def test_micro_batch_count_leaving_one_empty_exits_2_before_spawning(lengths_file, tmp_path, capsys,
                                                                    monkeypatch):
    from megatron_zeppelin.train import launch as launch_module

    monkeypatch.setattr(launch_module, "spawn_local", lambda cfg: pytest.fail("spawned ranks"))
    # 24 documents in all: a global batch holds at most 24 sequences.
    line = _one_error_line(capsys, _argv(lengths_file, "zeppelin", tmp_path / "x.jsonl", "--micro-batches", "30"))
    assert "--micro-batches 30, global batch 0" in line and "leave" in line and "empty" in line
    assert "must be >= 1" in _one_error_line(
        capsys, _argv(lengths_file, "zeppelin", tmp_path / "x.jsonl", "--micro-batches", "0"))


def _one_error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_inputs_exit_2_with_one_line(lengths_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "x.jsonl"
    argv = _argv(lengths_file, "zeppelin", out)
    line = _one_error_line(capsys, [*argv[:argv.index("--max-seq-len")], "--max-seq-len", "1000",
                                    *argv[argv.index("--max-seq-len") + 2:]])
    assert "longer than the cluster can hold" in line
    i = argv.index("--lengths")
    assert "dataset prefix" in _one_error_line(
        capsys, [*argv[:i], "--data", str(tmp_path / "nope"), *argv[i + 2:]])
    assert "does not exist" in _one_error_line(
        capsys, [*argv[:i], "--lengths", str(tmp_path / "nope.npy"), *argv[i + 2:]])
    # Pieces over the per-GPU cap for a strategy that cannot split them: one line
    # before any process starts (train/strategy_limits.py).
    assert "packing_dp" in _one_error_line(capsys, _argv(lengths_file, "packing_dp", out))
    assert "'model', 'fp32'" in _one_error_line(capsys, [*argv, "--ring-grad-dtype", "bf16"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "started 3 processes" in _one_error_line(capsys, argv)


def test_invalid_plan_is_a_plan_error(monkeypatch):
    class Broken:
        name = "broken"

        def plan(self, seq_lens, ctx):
            ref = trainer.reference_plan(seq_lens, 4, 2)
            return Plan(strategy="broken", world_size=4, gpus_per_node=2, seq_lens=ref.seq_lens,
                        attention=ref.attention[1:], linear=ref.linear)

    monkeypatch.setattr(trainer, "get_planner", lambda name: Broken())
    cfg = parse_args(["--nodes", "2", "--gpus-per-node", "2", "--strategy", "zeppelin", "--lengths", __file__,
                      "--max-seq-len", "8", "--tokens-per-gpu", "8", "--steps", "1"])
    cluster = trainer.resolve_cluster(cfg)
    make_plan = trainer.make_planner(cfg, cluster, cfg.model_config(), remap=False)
    with pytest.raises(PlanError, match="invalid plan.*sequence 0"):
        make_plan([3, 4, 5])


def test_dead_peer_stops_the_run(lengths_file, tmp_path, monkeypatch):
    """Rank 1 dies in its second step: the parent stops the others and fails fast."""
    real_step = trainer.train_step

    def dying_step(run, *args):
        if run.rank == 1 and run.step == 1:
            os._exit(9)
        return real_step(run, *args)

    monkeypatch.setattr(trainer, "train_step", dying_step)  # inherited by the forked ranks
    # The survivors' collectives would time out after --timeout; the parent must stop
    # them long before (a bound far from both, so a loaded machine cannot fail it).
    start = time.monotonic()
    with pytest.raises(ChildFailed, match="rank1 exited with status 9"):
        launch(parse_args(_argv(lengths_file, "zeppelin", tmp_path / "d.jsonl", "--timeout", "900")))
    assert time.monotonic() - start < 300


def test_supervise_reports_a_crashed_child():
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    sleeper = ctx.Process(target=time.sleep, args=(60,), name="sleeper")
    crasher = ctx.Process(target=os._exit, args=(3,), name="crasher")
    sleeper.start()
    crasher.start()
    try:
        with pytest.raises(ChildFailed, match="crasher exited with status 3"):
            supervise([sleeper, crasher], errors)
    finally:
        sleeper.kill()
        sleeper.join()


def test_indexed_dataset_run_equals_reference(tmp_path):
    """``--data``: tokens read from a Megatron indexed dataset; 1 node x 2 ranks."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.int32)
    for n in LENGTHS:
        builder.add_document(rng.integers(0, 256, n), [n])
    builder.finalize(str(tmp_path / "d.idx"))
    losses = {}
    for strategy in ("zeppelin", "reference"):
        argv = ["--nodes", "1", "--gpus-per-node", "2", "--strategy", strategy, "--data", str(tmp_path / "d"),
                "--max-seq-len", "384", "--tokens-per-gpu", "256", "--steps", "2", "--quiet",
                "--json-log", str(tmp_path / f"{strategy}.jsonl")]
        launch(parse_args(argv))
        lines = (tmp_path / f"{strategy}.jsonl").read_text().splitlines()
        losses[strategy] = [json.loads(x)["loss"] for x in lines]
    assert losses["zeppelin"] == pytest.approx(losses["reference"], rel=1e-4)


def test_rank_batch_labels_stay_inside_each_sequence():
    """Zigzag chunks of one sequence and a whole second one: every label is the
    next token of the same sequence; each sequence's last token is masked."""

    class Counting:
        def tokens(self, doc, start, end):
            return np.arange(start, end) + 1000 * doc

    pieces = [Piece(doc=3, start=10, end=18), Piece(doc=5, start=0, end=3)]
    spans = [Span(0, 0, 2), Span(0, 6, 8), Span(1, 0, 3)]
    b = build_rank_batch(spans, pieces, Counting(), torch.device("cpu"))
    assert b.tokens.tolist() == [3010, 3011, 3016, 3017, 5000, 5001, 5002]
    assert b.labels.tolist() == [3011, 3012, 3017, 0, 5001, 5002, 0]
    assert b.loss_mask.tolist() == [1, 1, 1, 0, 1, 1, 0]
    assert b.pad_tokens == 0
    # A rank the Plan gives no token holds one masked row (Megatron's layers need one).
    empty = build_rank_batch([], pieces, Counting(), torch.device("cpu"))
    assert (empty.tokens.tolist(), empty.loss_mask.tolist(), empty.pad_tokens) == ([0], [0], 1)
    assert num_label_tokens([8, 3]) == 9
