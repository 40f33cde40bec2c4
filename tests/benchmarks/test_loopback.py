"""benchmarks/loopback.py on CPU: ranks as threads over the loopback communicator
run a two-rank ring exactly as plain attention, and one failed rank stops them all."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_zeppelin.attention import plan_attention
from megatron_zeppelin.attention.backends import TorchBackend
from megatron_zeppelin.comm.base import Message
from megatron_zeppelin.plan import Mode, placement
from tests.attention.helpers import make_plan, random_sequences, reference

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import loopback  # noqa: E402  (benchmarks/ is on the path only now)


def test_loopback_ring_equals_plain_attention():
    """Two ranks as threads over the loopback communicator run a zigzag ring and a
    local sequence each; outputs and gradients equal plain attention of whole sequences."""
    plan = make_plan(2, 2, [12, 5, 9], [placement(0, 12, Mode.RING, [0, 1]), placement(1, 5, Mode.LOCAL, [0]),
                                        placement(2, 9, Mode.LOCAL, [1])])
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
