"""--pp 2: Megatron-Core's own 1F1B schedule on gloo CPU ranks, every stage running
the micro-batch's plan, against the reference through the same pipeline.

Each layout trains zeppelin (remap and routing on) and the reference (plain packed
attention) at the same PP and compares losses, gradient norms and every
parameter's summed gradient on one rank of each stage.  The two runs share their
initial weights (each stage draws its own layers from the same seed), so equal
gradients mean the plan's attention, remap and stage boundaries are exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_zeppelin.plan import Plan
from megatron_zeppelin.sim.pipeline import pipeline_order
from megatron_zeppelin.sim.timeline import decision_step_s
from megatron_zeppelin.train import trainer
from megatron_zeppelin.train.cli import parse_args
from megatron_zeppelin.train.launch import launch
from tests.train.test_trainer import TINY_LONGTAIL, _assert_same_grads, _one_error_line, _train_saving_grads


def _argv(strategy: str, out, nodes: int, gpus: int, *extra: str, tokens_per_gpu: int = 256,
          steps: int = 3) -> list[str]:
    return ["--nodes", str(nodes), "--gpus-per-node", str(gpus), "--strategy", strategy, "--model", "tiny",
            "--lengths", TINY_LONGTAIL, "--max-seq-len", "512", "--tokens-per-gpu", str(tokens_per_gpu),
            "--steps", str(steps), "--seed", "1", "--quiet", "--timeout", "60", "--json-log", str(out), *extra]


def _compare(tmp_path, monkeypatch, nodes: int, gpus: int, stage_ranks: tuple[int, ...], *extra: str,
             tokens_per_gpu: int = 256) -> tuple[list[dict], list[dict]]:
    """Zeppelin and reference at the same layout: losses, norms, every gradient of
    ``stage_ranks`` (one rank per pipeline stage) at 1e-5 relative."""
    zep = _train_saving_grads(_argv("zeppelin", tmp_path / "z.jsonl", nodes, gpus, *extra,
                                    tokens_per_gpu=tokens_per_gpu), tmp_path / "gz", monkeypatch, ranks=stage_ranks)
    ref = _train_saving_grads(_argv("reference", tmp_path / "r.jsonl", nodes, gpus, *extra,
                                    tokens_per_gpu=tokens_per_gpu), tmp_path / "gr", monkeypatch, ranks=stage_ranks)
    assert len(zep) == len(ref) == 3
    for z, r in zip(zep, ref):
        assert z["num_tokens"] == r["num_tokens"] and z["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert z["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert len({round(r["loss"], 6) for r in ref}) == 3   # the weights moved
    _assert_same_grads(tmp_path / "gz", tmp_path / "gr", steps=3 * len(stage_ranks), rel=1e-5)
    # Each stage saved its own layers: the embedding on the first, the output layer on the last.
    first = torch.load(tmp_path / "gz" / "000.pt")
    last = torch.load(tmp_path / "gz" / f"000.rank{stage_ranks[-1]}.pt")
    assert any("embedding" in n for n in first) and not any("output_layer" in n for n in first)
    assert any("output_layer" in n for n in last) and not any("embedding" in n for n in last)
    return zep, ref


def test_pp2_dp2_equals_reference_and_resumes_at_the_same_pp(tmp_path, monkeypatch, capsys):
    """4 nodes x 1 GPU, --pp 2: each stage is 2 nodes, so the plan's rings cross
    nodes (routed); 2 micro-batches per global batch."""
    zep, _ = _compare(tmp_path, monkeypatch, 4, 1, (0, 2), "--pp", "2", "--micro-batches", "2")
    assert any(z["plan"]["inter"] for z in zep)
    assert all(len(z["attn_pairs_per_rank"]) == len(z["linear_tokens_per_rank"]) == 2 for z in zep)
    # Resume at --pp 2: 2 steps saved, the third equals the uninterrupted run's.
    ckpt = tmp_path / "ckpt"
    launch(parse_args(_argv("zeppelin", tmp_path / "s.jsonl", 4, 1, "--pp", "2", "--micro-batches", "2",
                            "--save", str(ckpt), steps=2)))
    launch(parse_args(_argv("zeppelin", tmp_path / "l.jsonl", 4, 1, "--pp", "2", "--micro-batches", "2",
                            "--load", str(ckpt))))
    resumed = [json.loads(x) for x in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == zep[2]["loss"] and resumed[0]["grad_norm"] == zep[2]["grad_norm"]
    # At another PP the shards do not fit: one line, exit 2.
    line = _one_error_line(capsys, _argv("zeppelin", tmp_path / "o.jsonl", 4, 1, "--micro-batches", "2",
                                         "--load", str(ckpt)))
    assert "--pp 2, this run is --tp 1 --ep 1 --pp 1; resume with the layout it was saved at" in line


@pytest.fixture
def sent_shapes(tmp_path, monkeypatch):
    """Every rank appends the shape of each activation it sends to the next stage
    (Megatron-Core's shape exchange, ``variable_seq_lengths``) to ``shapes/<rank>``."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    real = P2PCommunicator._communicate_shapes
    shapes = tmp_path / "shapes"
    shapes.mkdir()

    def logging(self, tensor_send_next, *args, **kwargs):
        if tensor_send_next is not None:
            with open(shapes / str(torch.distributed.get_rank()), "a") as f:
                f.write(" ".join(map(str, tensor_send_next.shape)) + "\n")
        return real(self, tensor_send_next, *args, **kwargs)

    monkeypatch.setattr(P2PCommunicator, "_communicate_shapes", logging)
    return shapes


def test_pp2_with_four_micro_batches_and_remap_equals_reference(tmp_path, monkeypatch, sent_shapes):
    """2 nodes x 2 GPUs, --pp 2 --micro-batches 4: each stage is one node; 1F1B
    runs a later micro-batch's forward before an earlier one's backward, and
    every backward runs its own plan and remap.  The activations sent between
    stages hold each rank's token count in the micro-batch's plan."""
    zep, ref = _compare(tmp_path, monkeypatch, 2, 2, (0, 2), "--pp", "2", "--micro-batches", "4",
                        tokens_per_gpu=320)
    assert all(len(z["micro_batch_tokens"]) == 4 for z in zep)
    # Rank 0 (stage 0, data-parallel rank 0) sent 4 activations per step in each run
    # (zeppelin's first): [tokens, 1, hidden], the tokens its plans gave it.
    sent = [tuple(map(int, line.split())) for line in (sent_shapes / "0").read_text().splitlines()]
    assert len(sent) == 2 * 3 * 4 and {(b, h) for _, b, h in sent} == {(1, 64)}
    for step, z in enumerate(zep):
        assert sum(t for t, _, _ in sent[4 * step:4 * step + 4]) == z["attention_tokens_per_rank"][0]
    assert len({t for t, _, _ in sent[:12]}) > 1
    assert any(z["plan"]["intra"] for z in zep)
    assert any(z["bytes"]["remap_intra_node"] for z in zep)
    # The plans balanced what the reference's packing did not (linear layout).
    assert max(max(z["linear_tokens_per_rank"]) / (sum(z["linear_tokens_per_rank"]) / 2) for z in zep) < \
        max(max(r["linear_tokens_per_rank"]) / (sum(r["linear_tokens_per_rank"]) / 2) for r in ref)


def test_pp2_tp2_sp_dp2_equals_reference(tmp_path, monkeypatch):
    """8 ranks: 4 nodes x 2 GPUs, --tp 2 --sequence-parallel --pp 2: each stage is
    2 nodes of one TP group each; the boundary activations are the SP shards
    (each rank's plan token count padded to a multiple of 2, halved)."""
    zep, _ = _compare(tmp_path, monkeypatch, 4, 2, (0, 1, 4, 5), "--pp", "2", "--micro-batches", "2",
                      "--tp", "2", "--sequence-parallel", tokens_per_gpu=384)
    assert any(z["plan"]["inter"] for z in zep)


def test_pp4_middle_stages_equal_reference(tmp_path, monkeypatch):
    """--pp 4 of a 4-layer tiny model on 2 nodes x 4 GPUs: stages of 2 GPUs, half a
    node each; the two middle stages read no tokens (shapes only); 6 micro-batches,
    not a multiple of the stages."""
    model = tmp_path / "tiny4.yaml"
    model.write_text(Path("configs/models/tiny.yaml").read_text().replace("num_layers: 2", "num_layers: 4")
                     .replace("name: tiny", "name: tiny4"))
    zep, _ = _compare(tmp_path, monkeypatch, 2, 4, (0, 2, 4, 6), "--pp", "4", "--micro-batches", "6",
                      "--model", str(model))
    assert all(len(z["micro_batch_tokens"]) == 6 for z in zep) and any(z["plan"]["intra"] for z in zep)
    middle = torch.load(tmp_path / "gz" / "000.rank2.pt")
    assert middle and all(n.startswith("decoder.layers.0.") for n in middle)


def test_pipeline_bad_inputs_exit_2_before_spawning(tmp_path, capsys, monkeypatch):
    from megatron_zeppelin.train import launch as launch_module

    monkeypatch.setattr(launch_module, "spawn_local", lambda cfg: pytest.fail("spawned ranks"))
    argv = _argv("zeppelin", tmp_path / "x.jsonl", 4, 1)
    line = _one_error_line(capsys, [*argv, "--pp", "4", "--micro-batches", "4"])
    assert "--pp 4 does not divide model tiny's 2 layers" in line
    assert "--pp 3 x --tp 1 does not divide the 4 ranks" in _one_error_line(capsys, [*argv, "--pp", "3"])
    line = _one_error_line(capsys, [*argv, "--pp", "2"])
    assert "--micro-batches 1 is fewer than the 2 pipeline stages" in line and "--micro-batches 2 or more" in line
    line = _one_error_line(capsys, [*argv, "--pp", "2", "--micro-batches", "2", "--dump-trace", str(tmp_path / "t")])
    assert "--dump-trace" in line and "--pp 1" in line
    line = _one_error_line(capsys, [*argv, "--pp", "2", "--micro-batches", "2", "--model", "tiny-moe"])
    assert "MoE" in line and "--pp 1" in line
    three = _argv("zeppelin", tmp_path / "x.jsonl", 3, 2)   # stages of 3 ranks: neither nodes nor a node's slice
    line = _one_error_line(capsys, [*three, "--pp", "2", "--micro-batches", "2"])
    assert "stages of 3 ranks" in line


def _stage_checkpoint(source, target, layers: int, pp: int, shape: dict) -> None:
    """The --pp 1 checkpoint ``source`` (one shard, step 0, no optimizer moments)
    cut into the shards of ``pp`` stages: layer i to stage i // (layers / pp),
    renumbered from 0; the embedding to the first stage, the final norm and
    output layer to the last.  ``shape``: the run-shape entries of the run that
    loads it (a resume checks them)."""
    from megatron_zeppelin.train.checkpoint import load_state, save_state

    _, state = load_state(source, torch.device("cpu"))
    (name, whole), = state["shards"].items()
    per_stage = layers // pp
    shards = {}
    for stage in range(pp):
        model = {}
        for key, value in whole["model"].items():
            if key.startswith("decoder.layers."):
                index, rest = key[len("decoder.layers."):].split(".", 1)
                if int(index) // per_stage == stage:
                    model[f"decoder.layers.{int(index) - stage * per_stage}.{rest}"] = value
            elif stage == (0 if key.startswith("embedding.") else pp - 1):
                model[key] = value
        optimizer = {"state": {}, "param_groups": [
            {**whole["optimizer"]["param_groups"][0],
             "params": list(range(sum(not k.endswith("_extra_state") for k in model)))}]}
        shards[f"pp{stage}-{name}"] = {"model": model, "optimizer": optimizer}
    save_state(target, {**state, "shards": shards, "layout": {**state["layout"], "pp": pp},
                        "shape": {**state["shape"], **shape}})


def test_pp2_equals_the_same_weights_without_a_pipeline(tmp_path):
    """The reference and zeppelin at --pp 2 (4 ranks, 2 data-parallel) start from the
    weights of a --pp 1 run on 2 ranks, cut into stages: losses and gradient norms
    equal the --pp 1 run's for 3 steps (the schedule neither divides the loss by
    the micro-batch count nor drops a stage's gradient)."""
    init = tmp_path / "init"
    launch(parse_args(_argv("reference", tmp_path / "i.jsonl", 2, 1, "--micro-batches", "2", "--save", str(init),
                            steps=0)))
    for strategy in ("reference", "zeppelin"):
        _stage_checkpoint(init, tmp_path / f"init_pp2_{strategy}", layers=2, pp=2,
                          shape={"--nodes x --gpus-per-node": 4, "--strategy": strategy})
    logs = {}
    for name, nodes, extra in (("plain", 2, ()), ("reference", 4, ("--pp", "2")), ("zeppelin", 4, ("--pp", "2"))):
        strategy = "zeppelin" if name == "zeppelin" else "reference"
        load = str(tmp_path / (f"init_pp2_{strategy}" if extra else "init"))
        launch(parse_args(_argv(strategy, tmp_path / f"{name}.jsonl", nodes, 1, "--micro-batches", "2",
                                "--load", load, *extra)))
        logs[name] = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    for plain, ref, zep in zip(logs["plain"], logs["reference"], logs["zeppelin"]):
        assert plain["num_tokens"] == ref["num_tokens"] == zep["num_tokens"]
        for run in (ref, zep):
            assert run["loss"] == pytest.approx(plain["loss"], rel=1e-5)
            assert run["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


def test_micro_batches_run_lightest_at_the_ends(tmp_path, sent_shapes):
    """Each global batch's micro-batches enter the pipeline in ``pipeline_order``
    of their plans' modeled steps (heaviest in the middle): rank 0's activations
    leave in that order, each with its plan's token count."""
    cfg = parse_args(_argv("zeppelin", tmp_path / "z.jsonl", 2, 2, "--pp", "2", "--micro-batches", "4",
                           "--dump-plans", str(tmp_path / "plans"), tokens_per_gpu=320))
    launch(cfg)
    cost = trainer.pipeline_cost(cfg, trainer.resolve_cluster(cfg))
    sent = [int(line.split()[0]) for line in (sent_shapes / "0").read_text().splitlines()]
    orders = []
    for step in range(3):
        plans = [Plan.from_json(p.read_text()) for p in sorted((tmp_path / "plans").glob(f"plan_{step:06d}_mb*.json"))]
        orders.append(pipeline_order([decision_step_s(p, cost) for p in plans], 2))
        assert sent[4 * step:4 * step + 4] == [max(plans[i].attention_tokens_per_rank()[0], 1) for i in orders[-1]]
    assert any(order != sorted(order) for order in orders)   # the order did change something
