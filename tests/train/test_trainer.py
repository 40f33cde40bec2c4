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
    # A sequence over the per-GPU cap for a strategy that cannot split it: raised
    # inside the spawned ranks, reported by the parent as one line.
    assert "packing_dp" in _one_error_line(capsys, _argv(lengths_file, "packing_dp", out))
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
    make_plan = trainer.make_planner(cfg, cluster, trainer.load_model("tiny"), remap=False)
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
    start = time.monotonic()
    with pytest.raises(ChildFailed, match="rank1 exited with status 9"):
        launch(parse_args(_argv(lengths_file, "zeppelin", tmp_path / "d.jsonl")))
    assert time.monotonic() - start < 25


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
    b = build_rank_batch(spans, pieces, Counting(), torch.device("cpu"), pad_tokens=1)
    assert b.tokens.tolist() == [3010, 3011, 3016, 3017, 5000, 5001, 5002, 0]
    assert b.labels.tolist() == [3011, 3012, 3017, 0, 5001, 5002, 0, 0]
    assert b.loss_mask.tolist() == [1, 1, 1, 0, 1, 1, 0, 0]
    assert num_label_tokens([8, 3]) == 9
