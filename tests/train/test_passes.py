"""A baseline's rounds become the trainer's passes: every sequence once, each pass under the cap."""

from __future__ import annotations

import pytest

from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.train import trainer
from megatron_zeppelin.train.cli import parse_args

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

