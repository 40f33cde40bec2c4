"""A baseline's rounds become the trainer's passes: every sequence once, each pass under the cap."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.train import trainer
from megatron_zeppelin.train.cli import parse_args
from tests.train.test_trainer import _assert_same_grads, _train_saving_grads

#: Three full-length pieces on 2 x 4 GPUs at 1024 tokens per GPU: te_cp's and
#: ulysses_sp's two groups of 4 hold two of them per pass, the third waits.
LENS = [3072, 3072, 200, 3072, 500, 40]


@pytest.mark.parametrize("strategy", ["te_cp", "ulysses_sp", "flexsp", "megatron_hybrid_cp"])
def test_rounds_run_as_passes_covering_the_batch(strategy):
    cfg = parse_args(["--nodes", "2", "--gpus-per-node", "4", "--strategy", strategy, "--model", "tiny-ulysses",
                      "--lengths", "configs/lengths/tiny-longtail.npy", "--max-seq-len", "3072",
                      "--tokens-per-gpu", "1024", "--steps", "1", "--cluster", "h100-8x400g"])
    make_plan = trainer.make_planner(cfg, trainer.resolve_cluster(cfg), load_model("tiny-ulysses"), remap=False)
    passes = make_plan(LENS)
    assert len(passes) > 1
    assert sorted(s for p in passes for s in p.seqs) == list(range(len(LENS)))
    for p in passes:
        assert p.plan.seq_lens == tuple(LENS[s] for s in p.seqs)
        assert max(p.plan.attention_tokens_per_rank()) <= 1024
        if strategy == "megatron_hybrid_cp":   # one sub-sample of each CP group per pass
            firsts = [q.ranks[0] for q in p.plan.attention]
            assert len(firsts) == len(set(firsts))



@pytest.mark.slow
def test_zeppelin_runs_hybrid_cps_rounds_as_passes(tmp_path, monkeypatch):
    """Zeppelin's decision (remap off: the baselines' layouts are candidates)
    runs its first batch, [1181, 1543, 189, 919] on 2 x 2 GPUs at 1024 tokens
    per GPU, as Megatron hybrid CP's two rounds, each a pass under the cap,
    which the replay puts faster than its best one pass: the loss and every
    parameter's gradient equal the reference's on the same global batch (one
    step: after an update, fp32 summation order moves a layernorm's gradient
    by 1.1e-5 relative on the next)."""
    lengths = tmp_path / "docs.npy"
    np.save(lengths, np.array([919, 1181, 1543, 189] * 3, dtype=np.int64))

    def argv(strategy: str) -> list[str]:
        return ["--nodes", "2", "--gpus-per-node", "2", "--strategy", strategy, "--model", "tiny-ulysses",
                "--lengths", str(lengths), "--max-seq-len", "3072", "--tokens-per-gpu", "1024", "--steps", "1",
                "--seed", "0", "--cluster", "h100-8x400g", "--remap", "off", "--quiet", "--timeout", "60",
                "--json-log", str(tmp_path / f"{strategy}.jsonl"), "--dump-plans", str(tmp_path / f"{strategy}-plans")]

    mine = _train_saving_grads(argv("zeppelin"), tmp_path / "zg", monkeypatch)
    ref = _train_saving_grads(argv("reference"), tmp_path / "rg", monkeypatch)
    assert mine[0]["micro_batch_tokens"] == [1181 + 1543, 189 + 919]    # hybrid CP's two rounds
    plans = [Plan.from_json(p.read_text()) for p in sorted((tmp_path / "zeppelin-plans").glob("plan_000000_mb*.json"))]
    assert len(plans) == 2 and all(p.strategy == "zeppelin" and max(p.attention_tokens_per_rank()) <= 1024
                                   for p in plans)
    for m, r in zip(mine, ref):
        assert m["num_tokens"] == r["num_tokens"] == sum(m["micro_batch_tokens"])
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-5)
    _assert_same_grads(tmp_path / "zg", tmp_path / "rg", steps=1, rel=1e-5)
