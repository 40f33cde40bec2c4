"""Expert parallelism in the trainer: ``--ep`` splits tiny-moe's 4 experts over
data-parallel ranks (Megatron-Core's all-to-all dispatcher on gloo) and changes
nothing but where each expert lives: losses and every parameter's gradient equal
the run that keeps every expert on every rank, and a checkpoint of TP x EP shards
resumes exactly.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_zeppelin.megatron.experts import global_expert_name
from megatron_zeppelin.train.__main__ import main
from megatron_zeppelin.train.cli import parse_args
from megatron_zeppelin.train.launch import launch
from tests.train.test_trainer import _micro_argv, _train_saving_grads

MOE = ("--model", "tiny-moe")
LOCAL_EXPERTS = 2   # tiny-moe's 4 experts over EP 2


def _grads(directory, step: int, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(directory / (f"{step:03d}" + (f".rank{rank}" if rank else "") + ".pt"))


def _assert_expert_shards_equal(ep_dir, ref_dir, steps: int, ranks: dict[int, tuple[int, int]]) -> None:
    """``ranks``: EP run rank -> (its EP rank, the reference rank holding the same
    TP shard of every expert).  Every reference parameter is matched by some rank."""
    for step in range(steps):
        matched = set()
        for rank, (ep_rank, ref_rank) in ranks.items():
            mine, ref = _grads(ep_dir, step, rank), _grads(ref_dir, step, ref_rank)
            experts = {n.split("local_experts.")[1].split(".")[0] for n in mine if "local_experts" in n}
            assert experts == {str(i) for i in range(LOCAL_EXPERTS)}   # half the experts live here
            for name, grad in mine.items():
                full = global_expert_name(name, ep_rank, LOCAL_EXPERTS)
                assert (grad - ref[full]).norm() <= 1e-5 * ref[full].norm(), (step, rank, name, full)
                matched.add((ref_rank, full))
        assert matched == {(r, n) for r in {r for _, r in ranks.values()} for n in _grads(ref_dir, step, r)}


def test_expert_parallel_2_equals_expert_parallel_1(tmp_path, monkeypatch):
    """--ep 2 on 2 x 2 ranks (4 data-parallel ranks: experts 0-1 on EP rank 0, 2-3 on
    EP rank 1, each summed over an expert-data-parallel group of 2), zeppelin with
    remap and routing on, against the reference with every expert on every rank."""
    ep = _train_saving_grads(_micro_argv("zeppelin", tmp_path / "e.jsonl", 192, *MOE, "--ep", "2"),
                             tmp_path / "ge", monkeypatch, ranks=(0, 1))
    ref = _train_saving_grads(_micro_argv("reference", tmp_path / "r.jsonl", 192, *MOE), tmp_path / "gr",
                              monkeypatch)
    for e, r in zip(ep, ref):
        assert e["num_tokens"] == r["num_tokens"] and e["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert e["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert any(e["bytes"]["remap_intra_node"] + e["bytes"]["remap_inter_node"] for e in ep)
    _assert_expert_shards_equal(tmp_path / "ge", tmp_path / "gr", steps=3, ranks={0: (0, 0), 1: (1, 0)})


def test_tp_sp_ep_equal_the_reference_and_resume_exactly(tmp_path, monkeypatch, capsys):
    """--tp 2 --sequence-parallel --ep 2 on 2 x 2 ranks (rank r: TP rank r % 2, EP
    rank r // 2; the all-to-all dispatcher's token gathers over the TP ranks are
    uneven) against the reference at TP 2 + SP with every expert on every rank;
    then 1 step saved and resumed (4 shards: tp0-ep0 .. tp1-ep1) equals the
    uninterrupted second step, and a resume at another layout is one line."""
    parallel = (*MOE, "--tp", "2", "--sequence-parallel")
    ep = _train_saving_grads(_micro_argv("zeppelin", tmp_path / "e.jsonl", 384, *parallel, "--ep", "2", steps=2),
                             tmp_path / "ge", monkeypatch, ranks=(0, 1, 2, 3))
    ref = _train_saving_grads(_micro_argv("reference", tmp_path / "r.jsonl", 384, *parallel, steps=2),
                              tmp_path / "gr", monkeypatch, ranks=(0, 1))
    for e, r in zip(ep, ref):
        assert e["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert e["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    _assert_expert_shards_equal(tmp_path / "ge", tmp_path / "gr", steps=2,
                                ranks={r: (r // 2, r % 2) for r in range(4)})

    ckpt = tmp_path / "ckpt"
    argv = lambda out, *extra, steps: _micro_argv("zeppelin", tmp_path / out, 384, *parallel,  # noqa: E731
                                                  "--ep", "2", *extra, steps=steps)
    launch(parse_args(argv("s.jsonl", "--save", str(ckpt), steps=1)))
    assert sorted(torch.load(sorted(ckpt.glob("step_*.pt"))[0])["shards"]) == \
        ["tp0-ep0", "tp0-ep1", "tp1-ep0", "tp1-ep1"]
    launch(parse_args(argv("l.jsonl", "--load", str(ckpt), steps=2)))
    resumed = [json.loads(x) for x in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1]
    assert resumed[0]["loss"] == ep[1]["loss"] and resumed[0]["grad_norm"] == ep[1]["grad_norm"]

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([*argv("x.jsonl", "--load", str(ckpt), steps=2), "--ep", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds shards of --tp 2 --ep 2, this run is --tp 2 --ep 1" in err[0], err
