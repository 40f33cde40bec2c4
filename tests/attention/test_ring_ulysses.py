"""Zigzag ring (2, 4, 8 ranks) and Ulysses (2, 4 ranks) against plain causal
attention, on 8 gloo ranks (2 nodes x 4 GPUs): outputs, q/k/v gradients, exact
byte counts per link class and exact pair counts."""

from __future__ import annotations

import pytest
import torch

from megatron_zeppelin.attention import AttentionCounter, plan_attention, shard_sequences
from megatron_zeppelin.comm.direct import DirectCommunicator
from megatron_zeppelin.plan import Mode, placement
from megatron_zeppelin.topology import Topology
from tests.attention.helpers import expected_bytes, make_plan, random_sequences, reference
from tests.distributed import world_fixture

TOPO = Topology(nodes=2, gpus_per_node=4, nics_per_node=2)
HQ, HK, D = 8, 4, 4

world = world_fixture(8)


def run_plan(rank, plan, topo, seed, dtype=torch.float32, backend="torch", ring_grad_dtype="model"):
    """This rank's (out, dq, dk, dv, expected..., counters) for ``plan`` on the world."""
    seqs = random_sequences(plan, HQ, HK, D, dtype, seed)
    q, k, v, dout = (shard_sequences(plan, rank, [s[i] for s in seqs]) for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    comm = DirectCommunicator(None, topology=topo)
    counter = AttentionCounter()
    out = plan_attention(q, k, v, plan=plan, rank=rank, comm=comm, backend=backend, counter=counter,
                         ring_grad_dtype=ring_grad_dtype)
    fwd_bytes = (comm.counters.intra_node, dict(comm.counters.inter_node_per_nic))
    comm.counters.reset()
    out.backward(dout)
    bwd_bytes = (comm.counters.intra_node, dict(comm.counters.inter_node_per_nic))
    refs = reference(seqs)
    expected = [shard_sequences(plan, rank, [r[i] for r in refs]) for i in range(4)]
    return (out.detach(), q.grad, k.grad, v.grad), expected, (fwd_bytes, bwd_bytes), counter


def check_rank(plan, topo, rank, got, expected, bytes_, counter, itemsize=4, tol=1e-5, grad_itemsize=None):
    """``grad_itemsize``: what dK/dV travel in (None: the K/V's, ``ring_grad_dtype`` model)."""
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g, e.to(g.dtype), atol=tol, rtol=tol, msg=lambda m: f"rank {rank} {name}: {m}")
    for backward, (intra, inter) in enumerate(bytes_):
        want = expected_bytes(plan, topo, rank, HQ, HK, D, itemsize, bool(backward), grad_itemsize or itemsize)
        assert (intra, {n: b for n, b in inter.items() if b}) == (want.intra_node, want.inter_node_per_nic)
    pairs = plan.attn_pairs_per_rank()[rank]
    assert (counter.forward_pairs, counter.backward_pairs) == (pairs, pairs)


def _case(rank, world_size, plan, seed):
    return run_plan(rank, plan, TOPO, seed)


RING_CASES = {
    "ring2-intra": [(0, 9, Mode.RING, [1, 3])],
    "ring2-inter-uneven": [(0, 11, Mode.RING, [2, 6])],
    "ring4-intra": [(0, 21, Mode.RING, [3, 0, 2, 1])],
    "ring4-inter": [(0, 16, Mode.RING, [0, 4, 5, 1])],
    "ring8": [(0, 37, Mode.RING, [0, 1, 2, 3, 4, 5, 6, 7])],
    "ring8-shuffled-minimal": [(0, 16, Mode.RING, [5, 2, 7, 0, 3, 6, 1, 4])],
    "two-rings-one-wave": [(0, 10, Mode.RING, [0, 1]), (1, 13, Mode.RING, [4, 5, 6])],
    "ulysses2": [(0, 9, Mode.ULYSSES, [2, 3])],
    "ulysses2-inter": [(0, 7, Mode.ULYSSES, [1, 5])],
    "ulysses4": [(0, 19, Mode.ULYSSES, [4, 0, 7, 2])],
}


@pytest.mark.parametrize("name", sorted(RING_CASES))
def test_matches_single_rank_attention(world, name):
    spec = RING_CASES[name]
    plan = make_plan(8, 4, [s[1] for s in spec], [placement(i, L, m, r) for i, (_, L, m, r) in enumerate(spec)])
    for rank, (got, expected, bytes_, counter) in enumerate(world.run(_case, plan, seed=len(name))):
        check_rank(plan, TOPO, rank, got, expected, bytes_, counter)


def _bf16_case(rank, world_size, plan):
    return run_plan(rank, plan, TOPO, 7, dtype=torch.bfloat16)


def test_ring_bf16_inputs(world):
    """bf16 in and out, fp32 accumulation within a rank, dK/dV in bf16 between
    ranks: close to the fp32 reference at bf16 precision."""
    plan = make_plan(8, 4, [24], [placement(0, 24, Mode.RING, [0, 1, 4, 5])])
    for rank, (got, expected, bytes_, counter) in enumerate(world.run(_bf16_case, plan)):
        assert got[0].dtype == torch.bfloat16
        check_rank(plan, TOPO, rank, got, expected, bytes_, counter, itemsize=2, tol=3e-2)
