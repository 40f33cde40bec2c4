"""plan_attention on random Plans mixing local sequences, intra-node rings,
inter-node rings and Ulysses groups, on 2 x 4 GPUs (8 gloo ranks) and 2 x 2 GPUs
(a 4-rank subgroup of the same processes): every output and q/k/v gradient
against plain causal attention, exact bytes per link class, exact pair counts."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from megatron_zeppelin.attention import AttentionCounter, plan_attention, shard_sequences
from megatron_zeppelin.comm.direct import DirectCommunicator
from megatron_zeppelin.plan import Mode, placement
from megatron_zeppelin.topology import Topology
from tests.attention.helpers import (expected_bytes, make_plan, random_plan, random_sequences,
                                     reference)
from tests.distributed import world_fixture

HQ, HK, D = 4, 2, 4
TOPOS = {"2x4": Topology(nodes=2, gpus_per_node=4, nics_per_node=4),
         "2x2": Topology(nodes=2, gpus_per_node=2, nics_per_node=1)}

world = world_fixture(8)

_GROUPS: dict[int, object] = {}


def _group(size: int):
    """Process group of ranks 0..size-1, built once per process (collective)."""
    if size not in _GROUPS:
        _GROUPS[size] = None if size == dist.get_world_size() else dist.new_group(list(range(size)))
    return _GROUPS[size]


def _case(rank, world_size, plan, topo, seed, layers):
    group = _group(plan.world_size)
    if rank >= plan.world_size:
        return None
    seqs = random_sequences(plan, HQ, HK, D, torch.float32, seed)
    q, k, v, dout = (shard_sequences(plan, rank, [s[i] for s in seqs]) for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    comm = DirectCommunicator(group, topology=topo)
    counter = AttentionCounter()
    # several "layers" on the same plan: the cached schedule must be reused safely
    outs = [plan_attention(q, k, v, plan=plan, rank=rank, comm=comm, backend="torch", counter=counter)
            for _ in range(layers)]
    sent_forward = (comm.counters.intra_node, dict(comm.counters.inter_node_per_nic))
    comm.counters.reset()
    (sum(outs) / layers).backward(dout)
    sent_backward = (comm.counters.intra_node, dict(comm.counters.inter_node_per_nic))
    refs = reference(seqs)
    expected = [shard_sequences(plan, rank, [r[i] for r in refs]) for i in range(4)]
    return ((outs[-1].detach(), q.grad, k.grad, v.grad), expected, sent_forward, sent_backward,
            counter)


def _check(plan, topo, results, layers):
    for rank, result in enumerate(results[:plan.world_size]):
        got, expected, sent_forward, sent_backward, counter = result
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {rank} {name}: {m}")
        for sent, backward in ((sent_forward, False), (sent_backward, True)):
            want = expected_bytes(plan, topo, rank, HQ, HK, D, 4, backward)
            intra, inter = sent
            assert intra == want.intra_node * layers
            assert {n: b for n, b in inter.items() if b} == {
                n: b * layers for n, b in want.inter_node_per_nic.items()}
        pairs = plan.attn_pairs_per_rank()[rank]
        assert (counter.forward_pairs, counter.backward_pairs) == (layers * pairs, layers * pairs)


@pytest.mark.parametrize("topo_name", sorted(TOPOS))
@pytest.mark.parametrize("seed", range(4))
def test_random_plans(world, topo_name, seed):
    topo = TOPOS[topo_name]
    rng = random.Random(1000 * seed + len(topo_name))
    plan = random_plan(rng, topo, n_seqs=rng.randint(3, 7))
    _check(plan, topo, world.run(_case, plan, topo, seed, layers=1), layers=1)


def test_idle_rank_and_repeated_layers(world):
    """Rank 3 holds no token yet takes part in every round; two layers share a schedule."""
    topo = TOPOS["2x2"]
    spec = [(9, Mode.RING, [2, 0]), (4, Mode.LOCAL, [1]), (6, Mode.LOCAL, [2]), (8, Mode.RING, [0, 1])]
    plan = make_plan(4, 2, [L for L, _, _ in spec], [placement(i, L, m, r) for i, (L, m, r) in enumerate(spec)])
    assert plan.attention_tokens_per_rank()[3] == 0
    _check(plan, topo, world.run(_case, plan, topo, 5, layers=2), layers=2)


def test_local_only_plan_sends_nothing(world):
    topo = TOPOS["2x4"]
    plan = make_plan(8, 4, [3, 5, 1, 7], [placement(i, L, Mode.LOCAL, [i * 2])
                                           for i, L in enumerate([3, 5, 1, 7])])
    results = world.run(_case, plan, topo, 3, layers=1)
    _check(plan, topo, results, layers=1)
    assert all(r[2] == (0, {}) and r[3] == (0, {}) for r in results)


def _transport_case(rank, world_size, plan, topo, routed):
    from megatron_zeppelin.comm.routing import RoutedCommunicator
    seqs = random_sequences(plan, HQ, HK, D, torch.bfloat16, 11)
    q, k, v, dout = (shard_sequences(plan, rank, [s[i] for s in seqs]) for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    comm = (RoutedCommunicator(None, topo, min_routed_bytes=0, dtype=torch.bfloat16) if routed
            else DirectCommunicator(None, topology=topo))
    out = plan_attention(q, k, v, plan=plan, rank=rank, comm=comm, backend="torch")
    out.backward(dout)
    if routed:
        comm.close()
    return out.detach(), q.grad, k.grad, v.grad


def test_bf16_routed_equals_direct(world):
    """bf16 K/V and fp32 dK/dV share rounds; routing changes the path, not a bit of the result."""
    topo = TOPOS["2x4"]
    spec = [(40, Mode.RING, [0, 1, 4, 5]), (24, Mode.RING, [2, 6]), (7, Mode.LOCAL, [3]), (5, Mode.LOCAL, [7])]
    plan = make_plan(8, 4, [L for L, _, _ in spec], [placement(i, L, m, r) for i, (L, m, r) in enumerate(spec)])
    direct = world.run(_transport_case, plan, topo, False)
    routed = world.run(_transport_case, plan, topo, True)
    for rank, (d, r) in enumerate(zip(direct, routed)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), d, r):
            assert a.dtype == torch.bfloat16
            assert torch.equal(a, b), f"rank {rank} {name} differs between routed and direct transport"


def _grad_dtype_case(rank, world_size, plan, topo, dtype, ring_grad_dtype):
    seqs = random_sequences(plan, HQ, HK, D, dtype, 12)
    q, k, v, dout = (shard_sequences(plan, rank, [s[i] for s in seqs]) for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    comm = DirectCommunicator(None, topology=topo)
    out = plan_attention(q, k, v, plan=plan, rank=rank, comm=comm, backend="torch", ring_grad_dtype=ring_grad_dtype)
    sent_forward = (comm.counters.intra_node, dict(comm.counters.inter_node_per_nic))
    comm.counters.reset()
    out.backward(dout)
    sent_backward = (comm.counters.intra_node, dict(comm.counters.inter_node_per_nic))
    expected = [shard_sequences(plan, rank, [r[i] for r in reference(seqs)]) for i in range(4)]
    return (out.detach(), q.grad, k.grad, v.grad), expected, sent_forward, sent_backward


def _ring_plan():
    """An inter-node ring of 4 (3 roundings of the first owner's dK/dV under
    ``model``), an intra-node ring of 2 and local sequences, on 2 x 4 GPUs."""
    spec = [(40, Mode.RING, [0, 1, 4, 5]), (24, Mode.RING, [2, 3]), (7, Mode.LOCAL, [6]), (5, Mode.LOCAL, [7])]
    return make_plan(8, 4, [L for L, _, _ in spec], [placement(i, L, m, r) for i, (L, m, r) in enumerate(spec)])


def _assert_bytes(plan, topo, rank, sent, itemsize, grad_itemsize, backward):
    want = expected_bytes(plan, topo, rank, HQ, HK, D, itemsize, backward, grad_itemsize)
    intra, inter = sent
    assert intra == want.intra_node
    assert {n: b for n, b in inter.items() if b} == want.inter_node_per_nic


@pytest.mark.parametrize("ring_grad_dtype, grad_itemsize", [("model", 2), ("fp32", 4)])
def test_bf16_ring_gradients_travel_in_the_ring_grad_dtype(world, ring_grad_dtype, grad_itemsize):
    """bf16 q/k/v: out and every gradient within bf16 precision of plain attention
    under both settings; the backward ring's dK/dV bytes are the K/V dtype's under
    ``model`` (half of fp32's), fp32's under ``fp32``; the forward is unchanged."""
    topo, plan = TOPOS["2x4"], _ring_plan()
    for rank, (got, expected, fwd, bwd) in enumerate(world.run(_grad_dtype_case, plan, topo, torch.bfloat16,
                                                                ring_grad_dtype)):
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g.float(), e, atol=2e-2, rtol=2e-2, msg=lambda m: f"rank {rank} {name}: {m}")
        _assert_bytes(plan, topo, rank, fwd, 2, grad_itemsize, backward=False)
        _assert_bytes(plan, topo, rank, bwd, 2, grad_itemsize, backward=True)


def test_fp32_models_are_identical_under_both_ring_grad_dtypes(world):
    """An fp32 model's dK/dV travel in fp32 either way: the same bits, the same bytes."""
    topo, plan = TOPOS["2x4"], _ring_plan()
    model, fp32 = (world.run(_grad_dtype_case, plan, topo, torch.float32, s) for s in ("model", "fp32"))
    for rank, (a, b) in enumerate(zip(model, fp32)):
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])), f"rank {rank} differs"
        assert a[2:] == b[2:]
        _assert_bytes(plan, topo, rank, a[3], 4, 4, backward=True)


def test_the_engine_and_the_cost_model_agree_on_the_ring_grad_bytes():
    from megatron_zeppelin.attention.engine import attn_shape
    from megatron_zeppelin.cost.model import RING_GRAD_DTYPES, ring_grad_itemsize

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        q, k = torch.zeros(3, HQ, D, dtype=dtype), torch.zeros(3, HK, D, dtype=dtype)
        for setting in RING_GRAD_DTYPES:
            assert attn_shape(q, k, setting).acc_itemsize == ring_grad_itemsize(setting, dtype.itemsize)
    assert [ring_grad_itemsize(s, 2) for s in RING_GRAD_DTYPES] == [2, 4]


def test_a_plan_that_runs_direct_gets_no_routed_hops():
    """``Plan.routed = False`` on a routing communicator: the engine's schedule of
    an inter-node ring holds no dispatch/NIC/combine hops, the routed plan does."""
    import dataclasses

    from megatron_zeppelin.attention import build_schedule
    from megatron_zeppelin.comm.rounds import LaneCommunicator
    from megatron_zeppelin.schedule.attention import AttnShape, Transport

    comm = LaneCommunicator.__new__(LaneCommunicator)        # only its transport is read
    comm.transport = Transport(Topology(nodes=2, gpus_per_node=2, nics_per_node=2), min_routed_bytes=0)
    plan = make_plan(4, 2, [64], [placement(0, 64, Mode.RING, (0, 2))])
    shape = AttnShape(4, 2, 8, 4, 4)

    def hops(p) -> int:
        sched = build_schedule(p, shape, comm).forward
        return sum("." in op.name for op in sched.ops if op.is_comm)

    assert hops(plan) > 0
    assert hops(dataclasses.replace(plan, routed=False)) == 0
