"""Packed rings (``Plan.packed_rings``, TransformerEngine's THD ring) against plain
causal attention on 8 gloo ranks (2 nodes x 4 GPUs): outputs and q/k/v
gradients, exact byte counts, one message per ring step and link holding every
member's rows, and the fused (one varlen call per step) path of the kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_zeppelin.attention import build_schedule
from megatron_zeppelin.attention.backends import TorchBackend
from megatron_zeppelin.attention.backends.base import FusedKernels, host_bounds
from megatron_zeppelin.comm.direct import DirectCommunicator
from megatron_zeppelin.plan import Mode, placement
from megatron_zeppelin.schedule import COMM, AttnShape
from megatron_zeppelin.schedule.attention import Transport, add_attention
from megatron_zeppelin.schedule.ops import ScheduleBuilder
from tests.attention.helpers import make_plan
from tests.attention.test_ring_ulysses import HK, TOPO, check_rank, run_plan
from tests.distributed import world_fixture

world = world_fixture(8)

#: (length, mode, ranks) per sequence, and the packed rings (sequence indices).
CASES = {
    # Uneven lengths (chunks differ by a token), one member exactly 2k tokens.
    "intra-uneven": ([(9, Mode.RING, [1, 3]), (14, Mode.RING, [1, 3]), (4, Mode.RING, [1, 3])], [[0, 1, 2]]),
    # Two packed rings, an unpacked ring on a packed ring's ranks, a local
    # sequence and a Ulysses group in one layer; a packed ring across nodes.
    "mixed-inter": ([(16, Mode.RING, [0, 4, 5, 1]), (5, Mode.LOCAL, [2]), (11, Mode.RING, [0, 4, 5, 1]),
                     (9, Mode.ULYSSES, [2, 3]), (8, Mode.RING, [0, 4, 5, 1]), (13, Mode.RING, [6, 7]),
                     (10, Mode.RING, [6, 7]), (12, Mode.RING, [0, 4, 5, 1]), (7, Mode.RING, [2, 6])],
                    [[7, 0, 4], [5, 6]]),
    # Two packed rings over the same ranks in the other order, and a ring of 8.
    "same-ranks-both-ways": ([(6, Mode.RING, [0, 1]), (7, Mode.RING, [1, 0]), (9, Mode.RING, [0, 1]),
                              (5, Mode.RING, [1, 0]), (21, Mode.RING, list(range(8))),
                              (17, Mode.RING, list(range(8)))], [[0, 2], [1, 3], [4, 5]]),
}


def packed_plan(name: str):
    spec, rings = CASES[name]
    plan = make_plan(8, 4, [L for L, _, _ in spec], [placement(i, L, m, r) for i, (L, m, r) in enumerate(spec)])
    return dataclasses.replace(plan, packed_rings=tuple(map(tuple, rings))).validate()


class LoopedFused(FusedKernels):
    """The THD entry points of a fused backend, computed sequence by sequence with
    the PyTorch kernels on CPU: the packed ring's one-call path (offsets,
    concatenation, splitting back) checked without a GPU."""

    name = "looped_fused"
    torch_kernels = TorchBackend()
    calls = 0
    """Calls of several full blocks at once (local sequences' calls are causal)."""

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        type(self).calls += not causal and len(cu_q) > 2      # a packed ring step's full blocks
        bq, bk = host_bounds(cu_q, None), host_bounds(cu_k, None)
        assert max_q == max(b - a for a, b in zip(bq, bq[1:])) and max_k == max(b - a for a, b in zip(bk, bk[1:]))
        parts = [self.torch_kernels.forward(q[a:b], k[c:d], v[c:d], causal=causal, scale=scale)
                 for a, b, c, d in zip(bq, bq[1:], bk, bk[1:])]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts], dim=1)

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        type(self).calls += not causal and len(cu_q) > 2
        bq, bk = host_bounds(cu_q, None), host_bounds(cu_k, None)
        parts = [self.torch_kernels.backward(dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b], lse[:, a:b],
                                             causal=causal, scale=scale)
                 for a, b, c, d in zip(bq, bq[1:], bk, bk[1:])]
        return tuple(torch.cat(g) for g in zip(*parts))


def _case(rank, world_size, plan, seed, backend):
    LoopedFused.calls = 0           # the world's processes outlive a test
    got = run_plan(rank, plan, TOPO, seed, backend=backend)
    return (*got, LoopedFused.calls)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_packed_rings_match_single_rank_attention(world, name, backend):
    plan = packed_plan(name)
    kernels = "torch" if backend == "torch" else LoopedFused()
    in_packed = {r for i in plan.packed_leads() for r in plan.attention[i].ranks}
    for rank, (got, expected, bytes_, counter, fused_calls) in enumerate(
            world.run(_case, plan, seed=len(name), backend=kernels)):
        check_rank(plan, TOPO, rank, got, expected, bytes_, counter, tol=1e-6)
        # Forward and backward: a packed ring's full blocks went through one call per step.
        assert (fused_calls >= 2) == (backend == "fused" and rank in in_packed), (rank, fused_calls)


def test_a_packed_ring_sends_one_message_per_step_and_link():
    """Every kv / dkv message of the packed ring of ``intra-uneven`` holds all
    three members' rows of its owner: 2 x hk x d x itemsize x rows, one per
    (step, link) -- as many messages as one unpacked ring."""
    plan = packed_plan("intra-uneven")
    shape = AttnShape(8, HK, 4, 4, 4)
    members = [plan.attention[i] for i in range(3)]
    for backward, kinds in ((False, {"kv": 1}), (True, {"kv": 1, "dkv": 1})):
        layer = build_schedule(plan, shape, None)
        ops = [o for o in (layer.backward if backward else layer.forward).ops if o.kind == COMM]
        k = 2
        steps = {"kv": k - 1, "dkv": k} if backward else {"kv": k - 1}
        assert len(ops) == sum(steps.values()) * k      # one message per step and link, not per member
        for o in ops:
            kind, _, step, src = (layer.backward if backward else layer.forward).messages[o.key[0]][:4]
            owner = (src - step) % k if kind == "kv" else (src - step + 1) % k
            rows = sum(sum(e - s for s, e in p.shards[owner]) for p in members)
            assert o.nbytes == 2 * HK * 4 * rows * 4, (kind, step, src)


def test_packed_rings_of_every_ring_schedule_as_te_cps_packing():
    """A plan whose packed rings hold every ring of each rank tuple has the very
    schedule the simulator builds for te_cp (``add_attention(pack=True)``)."""
    spec = [(16, Mode.RING, [0, 1, 2, 3]), (5, Mode.LOCAL, [4]), (11, Mode.RING, [0, 1, 2, 3]),
            (12, Mode.RING, [4, 5, 6, 7]), (9, Mode.RING, [4, 5, 6, 7]), (8, Mode.RING, [0, 1, 2, 3])]
    plan = make_plan(8, 4, [L for L, _, _ in spec], [placement(i, L, m, r) for i, (L, m, r) in enumerate(spec)])
    packed = dataclasses.replace(plan, packed_rings=((0, 2, 5), (3, 4))).validate()
    shape, transport = AttnShape(8, HK, 4), Transport(TOPO)

    def ops(p, pack):
        b = ScheduleBuilder(8)
        add_attention(b, (), p, shape, transport, True, pack=pack)
        s = b.build()
        return [(o.kind, o.rank, o.peer, o.nbytes, o.pairs, o.deps, o.key) for o in s.ops]

    assert ops(packed, False) == ops(plan, True)
    assert ops(plan, False) != ops(plan, True)


def _bf16_case(rank, world_size, plan, ring_grad_dtype):
    return run_plan(rank, plan, TOPO, 5, dtype=torch.bfloat16, ring_grad_dtype=ring_grad_dtype)


@pytest.mark.parametrize("ring_grad_dtype, grad_itemsize", [("model", 2), ("fp32", 4)])
def test_packed_ring_bf16_inputs(world, ring_grad_dtype, grad_itemsize):
    """bf16 in and out, fp32 accumulation within a rank, the packed dK/dV messages
    in bf16 (``model``) or fp32: close to the fp32 reference at bf16 precision,
    the backward bytes those of the ring-gradient dtype."""
    plan = packed_plan("mixed-inter")
    for rank, (got, expected, bytes_, counter) in enumerate(world.run(_bf16_case, plan, ring_grad_dtype)):
        assert got[0].dtype == torch.bfloat16
        check_rank(plan, TOPO, rank, got, expected, bytes_, counter, itemsize=2, tol=3e-2,
                   grad_itemsize=grad_itemsize)
