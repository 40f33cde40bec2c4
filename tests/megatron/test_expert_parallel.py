"""Megatron-Core's all-to-all MoE dispatcher at expert parallelism 2 on 2 gloo CPU
ranks (through megatron/cpu_compat.py) computes what expert parallelism 1 computes.

The driver (``expert_parallel_ranks.py``) runs the tiny-moe MoE layer, built from
the project's layer spec, on 2 ranks with different token counts: once at EP 1
(every expert on every rank, all-gather dispatcher), then at EP 2 (experts split
over the ranks, all-to-all dispatcher) with the EP 1 weights.  Per rank the
outputs, input gradients and router gradients must match; each EP 2 expert's
gradient must match the sum over ranks of that expert's EP 1 gradients (what the
data-parallel all-reduce gives).  One process group per run: Megatron-Core's
parallel state is built once per process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from megatron_zeppelin.megatron.experts import global_expert_name

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("expert_parallel_ranks.py")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(ep: int, out: Path, *state: str) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, str(DRIVER), str(ep), str(out), _free_port(), *state],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_expert_parallel_2_equals_expert_parallel_1(tmp_path):
    ep1 = _run(1, tmp_path / "ep1")
    assert all(torch.equal(v, ep1[1]["state"][k]) for k, v in ep1[0]["state"].items() if torch.is_tensor(v))
    torch.save(ep1[0]["state"], tmp_path / "ep1.pt")
    ep2 = _run(2, tmp_path / "ep2", str(tmp_path / "ep1.pt"))
    assert [r["dispatcher"] for r in ep1 + ep2] == ["MoEAllGatherTokenDispatcher"] * 2 + \
        ["MoEAlltoAllTokenDispatcher"] * 2
    for rank in range(2):
        one, two = ep1[rank], ep2[rank]
        assert _rel(two["y"], one["y"]) <= 1e-5 and _rel(two["x.grad"], one["x.grad"]) <= 1e-5
        assert _rel(two["grads"]["router.weight"], one["grads"]["router.weight"]) <= 1e-5
        experts = [n for n in two["grads"] if n.startswith("experts.")]
        assert len(experts) == 4   # 2 of the 4 experts (fc1, fc2) on each rank
        for name in experts:
            summed = sum(r["grads"][global_expert_name(name, rank, 2)] for r in ep1)
            assert _rel(two["grads"][name], summed) <= 1e-5, (rank, name)
