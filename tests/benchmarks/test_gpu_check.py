"""scripts/gpu_check.sh and benchmarks/gpu_check.py on a machine without CUDA: the
one-line exit, the argument parser, the pieces that need no GPU (preset writing,
fit parsing, trace overlap), and the loopback communicator that lets one GPU run
a two-rank ring (checked here on CPU against plain attention)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_zeppelin.comm.base import Message

from megatron_zeppelin.attention import plan_attention
from megatron_zeppelin.attention.backends import TorchBackend
from megatron_zeppelin.topology import load_cluster
from tests.attention.helpers import random_sequences, reference

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
loopback = _load("loopback")
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")


@needs_no_cuda
def test_script_without_cuda_prints_one_line_and_exits_0():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines() == [gpu_check.NO_GPU], r.stdout + r.stderr


@needs_no_cuda
def test_main_without_cuda(capsys):
    assert gpu_check.main(["--skip", "training"]) == 0
    assert capsys.readouterr().out.strip() == gpu_check.NO_GPU


def test_arguments():
    args = gpu_check.parse_args(["--cluster", "h200-8x400g", "--skip", "training", "tests", "--steps", "5"])
    assert (args.cluster, args.skip, args.steps) == ("h200-8x400g", ["training", "tests"], 5)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--skip", "everything"])
    assert gpu_check.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_calibrated_preset_is_a_loadable_cluster(tmp_path):
    out = ("sdpa: attn_efficiency = 0.412, attn_half_block = 700\n"
           "flash: attn_efficiency = 0.631, attn_half_block = 1480\n")
    kernel, efficiency, half_block = gpu_check.fitted_efficiency(out)
    assert (kernel, efficiency, half_block) == ("flash", 0.631, 1480.0)
    base = (ROOT / "configs" / "clusters" / "h100-8x400g.yaml").read_text()
    path = tmp_path / "nvidia-h100-calibrated.yaml"
    path.write_text(gpu_check.calibrated_preset(base, "nvidia-h100-calibrated", kernel, efficiency, half_block,
                                                "NVIDIA H100"))
    cluster, original = load_cluster(str(path)), load_cluster("h100-8x400g")
    assert cluster.name == "nvidia-h100-calibrated"
    assert (cluster.gpu.attn_efficiency, cluster.gpu.attn_half_block) == (0.631, 1480)
    assert cluster.gpu.peak_tflops == original.gpu.peak_tflops and cluster.nic == original.nic
    with pytest.raises(RuntimeError, match="no fit"):
        gpu_check.fitted_efficiency("nothing")


def test_stream_overlap_counts_copies_beside_kernels():
    def event(cat, ts, dur, stream):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream}}

    kernel = lambda *a: event("kernel", *a)  # noqa: E731
    copy = lambda *a: event("gpu_memcpy", *a)  # noqa: E731
    trace = {"traceEvents": [kernel(0, 10, 7), kernel(12, 10, 7), copy(5, 10, 20), copy(30, 4, 20),
                             copy(0, 3, 7)]}  # the last copy is on the compute stream: not a transfer
    total, overlap = gpu_check.stream_overlap(trace)
    assert (total, overlap) == (14, 5 + 3)


def test_loopback_ring_equals_plain_attention():
    """Two ranks as threads over the loopback communicator run a zigzag ring and a
    local sequence; outputs and gradients equal plain attention of whole sequences."""
    plan = gpu_check.overhead_case([5, 9], [12])
    seqs = random_sequences(plan, 4, 2, 8, torch.float64, seed=3)
    refs = reference(seqs)
    hub = loopback.LoopbackHub(plan.world_size, torch.device("cpu"))

    def rank_step(rank):
        spans = plan.attention_spans(rank)
        q, k, v, dout = (torch.cat([seqs[sp.seq][i][sp.start:sp.end] for sp in spans]) for i in range(4))
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = plan_attention(q, k, v, plan=plan, rank=rank, comm=loopback.LoopbackCommunicator(hub, rank),
                             backend=TorchBackend())
        out.backward(dout)
        return spans, out.detach(), q.grad, k.grad, v.grad

    for spans, *got in loopback.run_ranks(hub, rank_step):
        want = [torch.cat([refs[sp.seq][i][sp.start:sp.end] for sp in spans]) for i in range(4)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def test_loopback_failure_stops_every_rank():
    hub = loopback.LoopbackHub(2, torch.device("cpu"))

    def rank_step(rank):
        if rank == 1:
            raise ValueError("rank 1 broke")
        comm = loopback.LoopbackCommunicator(hub, rank)
        # rank 1 never sends: without the hub's failure rank 0 would wait for its timeout
        comm.start_round([Message(0, 1, 0, 4)], {}, {0: torch.empty(4)}).wait()

    with pytest.raises(ValueError, match="rank 1 broke"):
        loopback.run_ranks(hub, rank_step)
