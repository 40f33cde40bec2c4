"""Every baseline in the trainer equals the reference, as its users run it.

2 nodes x 2 GPUs, the long-tailed lengths sample, 3072-token pieces at 1024
tokens per GPU: a 3072-token piece needs a group of 4 GPUs spanning both nodes
(a TE ring, a Ulysses all-to-all), Megatron's hybrid CP runs its groups'
sub-samples one after another, and the short documents share the groups.
Losses and every parameter's summed gradient equal plain data parallelism's
on the same global batches.
Model ``tiny-ulysses`` (4 KV heads): Ulysses groups of 4 split heads evenly.
The planners price plans with the H100 preset's numbers (``--cluster``), so
FlexSP's MILP mixes group sizes as it would on GPUs (with the CPU preset's
costs it puts every sequence in one group of 4, which ulysses_sp covers).
"""

from __future__ import annotations

import json
import sys

import pytest

from megatron_zeppelin.errors import exit_on_user_error
from megatron_zeppelin.plan import Mode, Plan
from megatron_zeppelin.train import compare
from megatron_zeppelin.train.cli import parse_args
from megatron_zeppelin.train.launch import launch
from tests.reliability.test_full_batch import _permuted
from tests.train.test_trainer import _assert_same_grads, _one_error_line, _train_saving_grads

BASELINES = ("te_cp", "megatron_hybrid_cp", "ulysses_sp", "flexsp")
LENGTHS = "configs/lengths/tiny-longtail.npy"
CAP = 1024
STEPS = 2


def _argv(strategy: str, out, *extra: str) -> list[str]:
    return ["--nodes", "2", "--gpus-per-node", "2", "--strategy", strategy, "--model", "tiny-ulysses",
            "--lengths", LENGTHS, "--max-seq-len", "3072", "--tokens-per-gpu", str(CAP), "--steps", str(STEPS),
            "--seed", "0", "--cluster", "h100-8x400g", "--quiet", "--timeout", "60", "--json-log", str(out), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """strategy -> (JSON lines, dumped Plans, gradient directory), reference included."""
    tmp = tmp_path_factory.mktemp("baselines")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for strategy in ("reference", *BASELINES):
            plans = tmp / f"{strategy}-plans"
            log = _train_saving_grads(_argv(strategy, tmp / f"{strategy}.jsonl", "--dump-plans", str(plans)),
                                      tmp / f"{strategy}-grads", mp)
            out[strategy] = (log, [Plan.from_json(p.read_text()) for p in sorted(plans.glob("*.json"))],
                             tmp / f"{strategy}-grads")
    out["logs"] = tmp
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", BASELINES)
def test_baseline_equals_the_reference(runs, strategy):
    ref, _, ref_grads = runs["reference"]
    log, plans, grads = runs[strategy]
    assert [r["step"] for r in log] == list(range(STEPS))
    for r, b in zip(ref, log):
        # The same global batches: nothing deferred, every piece trained in its step.
        assert b["num_tokens"] == r["num_tokens"] == sum(b["micro_batch_tokens"])
        assert b["loss"] == pytest.approx(r["loss"], rel=1e-5)
    _assert_same_grads(grads, ref_grads, steps=STEPS, rel=1e-5)
    # Every pass (a round; hybrid CP: a sub-sample of each group) holds at most the cap on a GPU.
    assert max(max(plan.attention_tokens_per_rank()) for plan in plans) <= CAP
    # Baselines have no remapping layer: their MLPs run on the attention layout.
    assert all(b["linear_tokens_per_rank"] == b["attention_tokens_per_rank"] for b in log)
    assert all(b["bytes"]["remap_intra_node"] == b["bytes"]["remap_inter_node"] == 0 for b in log)


@pytest.mark.slow
def test_the_long_pieces_are_split_over_both_nodes(runs):
    # The reference holds a 3072-token piece on one rank; every baseline splits it 4 ways.
    assert any(max(r["attention_tokens_per_rank"]) > CAP for r in runs["reference"][0])
    for strategy in BASELINES:
        _, plans, _ = runs[strategy]
        mode = Mode.ULYSSES if strategy in ("ulysses_sp", "flexsp") else Mode.RING
        assert any(p.mode == mode and p.ranks == (0, 1, 2, 3) for plan in plans for p in plan.attention), strategy
    # FlexSP's groups differ per sequence (its MILP), te_cp's and ulysses_sp's never.
    for strategy, sizes in (("flexsp", lambda n: n > 2), ("te_cp", lambda n: n == 1), ("ulysses_sp", lambda n: n == 1)):
        used = {p.size for plan in runs[strategy][1] for p in plan.attention}
        assert sizes(len(used)), (strategy, used)
    # Hybrid CP ran a step as several micro-batches (its groups' sub-samples one after another).
    assert any(len(r["micro_batch_tokens"]) > 1 for r in runs["megatron_hybrid_cp"][0])


@pytest.mark.slow
def test_te_cp_is_static_and_unrouted(runs):
    log, plans, _ = runs["te_cp"]
    # One CP group of 4 for the whole run: every sequence, short ones too, rides its ring.
    assert {(p.mode, p.ranks) for plan in plans for p in plan.attention} == {(Mode.RING, (0, 1, 2, 3))}
    # ... as TE's THD ring: one packed ring per pass (Plan.packed_rings), which the engine ran.
    assert all(plan.packed_rings == ((tuple(p.seq for p in plan.attention),) if len(plan.attention) > 1 else ())
               for plan in plans)
    assert any(plan.packed_rings for plan in plans)
    # No routing: the ring's node crossings (GPU 1 -> 2, GPU 3 -> 0) leave through the
    # sending GPU's own NIC (NIC 1 of each node); a routed run would use NIC 0 too.
    for r in log:
        assert [n[0] for n in r["bytes"]["inter_node_per_nic"]] == [0, 0]
        assert all(n[1] > 0 for n in r["bytes"]["inter_node_per_nic"])


@pytest.mark.parametrize("strategy", ["ulysses_sp", "flexsp"])
def test_a_model_whose_kv_heads_forbid_the_group_is_one_line_before_spawning(strategy, tmp_path, capsys,
                                                                          monkeypatch):
    """tiny has 2 KV heads: no Ulysses group of 4 GPUs exists, and a 3072-token
    piece needs one at 1024 tokens per GPU.  Refused up front (not at the first
    long piece, and not by quietly running smaller groups)."""
    from megatron_zeppelin.train import launch as launch_module

    monkeypatch.setattr(launch_module, "spawn_local", lambda cfg: pytest.fail("spawned ranks"))
    argv = _argv(strategy, tmp_path / "u.jsonl")
    argv[argv.index("tiny-ulysses")] = "tiny"
    line = _one_error_line(capsys, argv)
    assert f"{strategy}: a 3072-token piece needs a Ulysses group of more than 2 GPUs" in line
    assert "tiny's 2 KV heads" in line and "--model tiny-ulysses" in line
    assert "--batches-of makes the reference train" in _one_error_line(capsys, [*argv, "--batches-of", "zeppelin"])


@pytest.mark.slow
def test_compare_checks_the_batches_before_the_losses(runs, tmp_path, capsys, monkeypatch):
    logs = runs["logs"]
    monkeypatch.setattr(sys, "argv", ["compare", str(logs / "te_cp.jsonl"), str(logs / "reference.jsonl"),
                                      "--rtol", "1e-5"])
    assert exit_on_user_error(compare.main) == 0
    assert "equal to the reference" in capsys.readouterr().out
    # A run that deferred a piece trained other batches: one line says so, no loss verdict.
    lines = [json.loads(x) for x in (logs / "te_cp.jsonl").read_text().splitlines()]
    lines[1]["num_tokens"] -= 5
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.setattr(sys, "argv", ["compare", str(tmp_path / "other.jsonl"), str(logs / "reference.jsonl")])
    with pytest.raises(SystemExit) as exc:
        exit_on_user_error(compare.main)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 1 trained" in err[0] and "different batches" in err[0]


@pytest.mark.slow
def test_the_reference_trains_the_batches_a_strategy_deferred(tmp_path, capfd):
    """Issue 13's full batch (2 nodes x 1 GPU x 80 tokens): zeppelin defers a
    3-token piece one step; ``--batches-of zeppelin`` makes the reference defer it
    too, so the two runs compare step by step."""
    path = _permuted(tmp_path / "full.npy", [52, 44, 24, 37, 3, 150, 60, 40])
    logs = {}
    for name, extra in (("zeppelin", ["--strategy", "zeppelin"]),
                        ("reference", ["--strategy", "reference", "--batches-of", "zeppelin"])):
        out = tmp_path / f"{name}.jsonl"
        launch(parse_args(["--nodes", "2", "--gpus-per-node", "1", *extra, "--lengths", path, "--max-seq-len", "160",
                           "--tokens-per-gpu", "80", "--steps", "3", "--quiet", "--json-log", str(out)]))
        logs[name] = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["num_tokens"] for r in logs["reference"]] == [r["num_tokens"] for r in logs["zeppelin"]] == [157, 153, 100]
    for z, r in zip(logs["zeppelin"], logs["reference"]):
        assert z["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert capfd.readouterr().err.count("deferred a piece of 3 tokens") == 2   # once per run
