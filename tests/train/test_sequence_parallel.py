"""--tp 2 --sequence-parallel on CPU ranks: Megatron-Core's own sequence-parallel
layers (through ``megatron/cpu_compat.py``) against the reference at the same TP/SP.

2 x 2 simulated GPUs (2 data-parallel ranks of 2 TP ranks), real long-tailed lengths.
MoE under TP + SP: ``test_trainer.py::test_moe_with_remap_equals_reference[tp2-sp]``.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_zeppelin.train.cli import parse_args
from megatron_zeppelin.train.launch import launch
from tests.train.test_trainer import _assert_same_grads, _micro_argv, _train_saving_grads

SP = ("--tp", "2", "--sequence-parallel")


@pytest.fixture
def count_sp_collectives(tmp_path, monkeypatch):
    """Every rank appends the rows of each Megatron-Core sequence-parallel
    reduce-scatter it runs to ``calls/<rank>`` (the forked ranks inherit the wrapper)."""
    from megatron.core.tensor_parallel import mappings

    real = mappings._reduce_scatter_along_first_dim
    calls = tmp_path / "calls"
    calls.mkdir()

    def counting(input_, group, *args, **kwargs):
        with open(calls / str(torch.distributed.get_rank()), "a") as f:
            f.write(f"{input_.shape[0]} {input_.device.type}\n")
        return real(input_, group, *args, **kwargs)

    monkeypatch.setattr(mappings, "_reduce_scatter_along_first_dim", counting)
    return calls


def _log(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sequence_parallel_equals_reference_at_the_same_tp_and_sp(tmp_path, monkeypatch, count_sp_collectives):
    """Zeppelin (remap and routing on) against the reference, both --tp 2
    --sequence-parallel: losses, gradient norms and every parameter's gradient (TP
    rank 0's shards, norm weights summed over the TP group) for 3 steps."""
    zep = _train_saving_grads(_micro_argv("zeppelin", tmp_path / "z.jsonl", 384, *SP), tmp_path / "gz", monkeypatch)
    # Megatron-Core's reduce-scatter ran on every rank, on CPU tensors, over even row counts.
    for rank in range(4):
        rows = [line.split() for line in (count_sp_collectives / str(rank)).read_text().splitlines()]
        assert rows and all(device == "cpu" and int(n) % 2 == 0 for n, device in rows)
    ref = _train_saving_grads(_micro_argv("reference", tmp_path / "r.jsonl", 384, *SP), tmp_path / "gr", monkeypatch)
    for z, r in zip(zep, ref):
        assert len(z["linear_tokens_per_rank"]) == 2  # data-parallel ranks
        assert z["num_tokens"] == r["num_tokens"] and z["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert z["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert any(z["plan"]["inter"] for z in zep)
    # Ranks held odd token counts (SP padded them by a row) in both runs; below, the
    # reference equals plain data parallelism, which pads nothing: padding does not count.
    assert any(n % 2 for rec in ref for n in rec["attention_tokens_per_rank"])
    assert any(n % 2 for rec in zep for n in rec["attention_tokens_per_rank"])
    _assert_same_grads(tmp_path / "gz", tmp_path / "gr", steps=3, rel=1e-5)
    # SP itself is exact: the reference at TP 2 + SP equals plain data parallelism on 4
    # ranks of half the tokens each (the same global batches).
    launch(parse_args(_micro_argv("reference", tmp_path / "p.jsonl", 192)))
    for p, r in zip(_log(tmp_path / "p.jsonl"), ref):
        assert p["num_tokens"] == r["num_tokens"] and p["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert p["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
