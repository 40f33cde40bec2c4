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
