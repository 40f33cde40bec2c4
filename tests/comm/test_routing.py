"""Routing layer: route_plan geometry and byte predictions (pure), and real routed
rounds over gloo (one 8-process group for the whole module)."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.comm.base import ByteCounters, Message
from megatron_zeppelin.comm.routing import (Phase, RoutedCommError, RoutedCommunicator, hop_bytes,
                                            min_routed_bytes, route_plan)
from megatron_zeppelin.cost.model import CostModel
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.topology import Topology, load_cluster

from tests.distributed import world_fixture

WORLD = 8
world = world_fixture(WORLD)
#: (nodes, gpus per node, NICs per node) run on the 8 spawned ranks; 2x2 runs on ranks 0..3.
TOPOLOGIES = [(2, 4, 1), (2, 4, 2), (2, 4, 4), (4, 2, 1), (4, 2, 2), (2, 2, 1), (2, 2, 2)]


def random_round(topo: Topology, seed: int, count: int = 12) -> list[Message]:
    rng = random.Random(seed)
    w = topo.world_size
    msgs = []
    for i in range(count):
        src, dst = rng.randrange(w), rng.randrange(w)
        numel = rng.choice([0, 1, 3, rng.randrange(4, 200)])
        msgs.append(Message(id=i, src=src, dst=dst, numel=numel))
    return msgs


def payload(seed: int, m: Message) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + m.id)
    return torch.randn(m.numel, generator=g)


# ----------------------------------------------------------------- pure geometry
@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TOPOLOGIES), st.integers(0, 10_000), st.sampled_from([0, 64, 400, math.inf]))
def test_route_plan_delivers_every_element_once(shape, seed, threshold):
    nodes, gpn, nics = shape
    topo = Topology(nodes=nodes, gpus_per_node=gpn, nics_per_node=nics)
    msgs = random_round(topo, seed)
    hops = route_plan(msgs, topo, threshold, itemsize=4)
    for m in msgs:
        mine = [h for h in hops if h.msg == m.id]
        cross = not topo.same_node(m.src, m.dst)
        routed = cross and nics > 1 and m.numel * 4 >= threshold and m.numel > 0
        if not routed:
            assert [(h.phase, h.src, h.dst, h.offset, h.numel) for h in mine] == (
                [(Phase.DIRECT, m.src, m.dst, 0, m.numel)] if m.numel else [])
            continue
        covered = []
        for piece in sorted({h.piece for h in mine}):
            legs = sorted((h for h in mine if h.piece == piece), key=lambda h: h.phase)
            # the legs chain src -> ... -> dst, exactly one leaves the node, through NIC `piece`
            assert legs[0].src == m.src and legs[-1].dst == m.dst
            assert all(a.dst == b.src for a, b in zip(legs, legs[1:]))
            nic_legs = [h for h in legs if h.phase is Phase.NIC]
            assert len(nic_legs) == 1 and nic_legs[0].nic == piece == topo.nic_of(nic_legs[0].src)
            assert topo.local_of(nic_legs[0].src) == topo.local_of(nic_legs[0].dst)
            assert all(topo.same_node(h.src, h.dst) for h in legs if h.phase is not Phase.NIC)
            covered.append((legs[0].offset, legs[0].offset + legs[0].numel))
        assert sorted(covered)[0][0] == 0 and sorted(covered)[-1][1] == m.numel
        assert all(a[1] == b[0] for a, b in zip(sorted(covered), sorted(covered)[1:]))


def ring_messages(topo: Topology, numel: int) -> list[Message]:
    w = topo.world_size
    return [Message(id=r, src=r, dst=(r + 1) % w, numel=numel) for r in range(w)]


def per_nic_load(topo: Topology, hops) -> list[int]:
    """Inter-node bytes per (node, NIC), from every rank's predicted counters."""
    load = [0] * (topo.nodes * topo.nics_per_node)
    for r in range(topo.world_size):
        for nic, n in hop_bytes(hops, r).inter_node_per_nic.items():
            load[topo.node_of(r) * topo.nics_per_node + nic] += n
    return load


@pytest.mark.parametrize("cluster", ["h100-8x400g", "a800-4x200g"])
def test_routing_balances_a_ring_over_all_nics(cluster):
    topo = load_cluster(cluster, nodes=2).topology
    msgs = ring_messages(topo, 1 << 20)
    on, off = per_nic_load(topo, route_plan(msgs, topo, 0, itemsize=2)), \
        per_nic_load(topo, route_plan(msgs, topo, math.inf, itemsize=2))
    assert sum(on) == sum(off) == 2 * (1 << 21)
    assert max(on) / (sum(on) / len(on)) <= 1.2
    assert max(on) <= 0.35 * max(off)


def test_threshold_from_cost_model():
    tiny = load_model("tiny")
    h100 = CostModel(load_cluster("h100-8x400g"), tiny)
    t = min_routed_bytes(h100)
    # routed: 10us + 2*5us; per byte 2 * 7/8 over NVLink (450 GB/s) + 1/8 over 8 NICs (50 GB/s);
    # direct: 10us, 50 GB/s -> pays above 10us / (1/50 - routed seconds per GB)
    routed_per_byte = 2 * 7 / 8 / 450e9 + 1 / (8 * 50e9)
    assert t == pytest.approx(10e-6 / (1 / 50e9 - routed_per_byte))
    one_nic = CostModel(load_cluster("cpu-sim").with_nodes(2), tiny)
    single = dataclasses.replace(one_nic.cluster, topology=Topology(nodes=2, gpus_per_node=2, nics_per_node=1))
    assert min_routed_bytes(dataclasses.replace(one_nic, cluster=single)) == math.inf


# --------------------------------------------------------------- real transfers
def _run_rounds(rank, world_size, shape, seeds, threshold):
    nodes, gpn, nics = shape
    topo = Topology(nodes=nodes, gpus_per_node=gpn, nics_per_node=nics)
    ranks = list(range(topo.world_size))
    group = dist.new_group(ranks)  # collective over the world, even for the 2x2 shapes
    if rank not in ranks:
        return None
    comm = RoutedCommunicator(group, topo, ByteCounters(), threshold, dtype=torch.float32)
    me = comm.rank
    pending = []
    for seed in seeds:  # several rounds in flight at once: the worker runs them FIFO
        msgs = random_round(topo, seed)
        sends = {m.id: payload(seed, m) for m in msgs if m.src == me}
        recvs = {m.id: torch.full((m.numel,), float("nan")) for m in msgs if m.dst == me}
        pending.append((msgs, seed, recvs, comm.start_round(msgs, sends, recvs)))
    bad = []
    for msgs, seed, recvs, p in pending:
        p.wait()
        bad += [m.id for m in msgs if m.dst == me and not torch.equal(recvs[m.id], payload(seed, m))]
    comm.close()
    return bad, comm.counters


@pytest.mark.parametrize("shape", TOPOLOGIES)
def test_routed_rounds_deliver_exact_bytes(world, shape):
    seeds, threshold = [11, 12, 13], 64
    results = world.run(_run_rounds, shape, seeds, threshold)
    topo = Topology(nodes=shape[0], gpus_per_node=shape[1], nics_per_node=shape[2])
    hops = [h for s in seeds for h in route_plan(random_round(topo, s), topo, threshold, itemsize=4)]
    assert any(h.phase is Phase.DISPATCH for h in hops) or shape[2] == 1  # the case routes something
    for rank in range(topo.world_size):
        bad, counters = results[rank]
        assert bad == []
        assert counters == hop_bytes(hops, rank)


def _ring_counters(rank, world_size, numel, threshold, routed=True):
    topo = Topology(nodes=2, gpus_per_node=4, nics_per_node=4)
    comm = RoutedCommunicator(None, topo, ByteCounters(), threshold, dtype=torch.bfloat16)
    msgs = ring_messages(topo, numel)
    me = comm.rank
    x = torch.arange(numel, dtype=torch.bfloat16) + me
    out = torch.zeros(numel, dtype=torch.bfloat16)
    comm.start_round(msgs, {me: x}, {(me - 1) % WORLD: out}, routed=routed).wait()
    comm.close()
    assert torch.equal(out, torch.arange(numel, dtype=torch.bfloat16) + (me - 1) % WORLD)
    return comm.counters


def test_measured_nic_bytes_balanced_with_routing(world):
    topo = Topology(nodes=2, gpus_per_node=4, nics_per_node=4)
    loads = {}
    # "plan off": a routing communicator running a plan with Plan.routed = False.
    for name, threshold, routed in (("on", 0, True), ("off", math.inf, True), ("plan off", 0, False)):
        counters = world.run(_ring_counters, 1001, threshold, routed)
        load = [0] * 8
        for r, c in enumerate(counters):
            for nic, n in c.inter_node_per_nic.items():
                load[topo.node_of(r) * 4 + nic] += n
        loads[name] = load
    assert sum(loads["on"]) == sum(loads["off"]) == 2 * 1001 * 2
    assert max(loads["on"]) / (sum(loads["on"]) / 8) <= 1.2
    assert max(loads["on"]) <= 0.35 * max(loads["off"])
    assert loads["plan off"] == loads["off"]


def _start_returns_at_once(rank, world_size):
    topo = Topology(nodes=2, gpus_per_node=4, nics_per_node=4)
    comm = RoutedCommunicator(None, topo, ByteCounters(), 0)
    msgs = [Message(id=0, src=5, dst=0, numel=64)]  # routed through ranks 4, 6, 7 and 1..3
    if rank == 5:
        time.sleep(0.5)  # the sender is late: rank 0 must not block in start_round
    t0 = time.perf_counter()
    pending = comm.start_round(msgs, {0: torch.ones(64)} if rank == 5 else {},
                               {0: torch.zeros(64)} if rank == 0 else {})
    started = time.perf_counter() - t0
    pending.wait()
    comm.close()
    return started


def test_start_round_returns_before_the_transfers_finish(world):
    started = world.run(_start_returns_at_once)
    assert started[0] < 0.25


def _dead_peer(rank, world_size):
    topo = Topology(nodes=2, gpus_per_node=4, nics_per_node=4)
    if rank != 0:
        return None  # every other rank "died": it never joins the round
    comm = RoutedCommunicator(None, topo, ByteCounters(), 0, timeout=timedelta(seconds=1))
    msgs = [Message(id=0, src=5, dst=0, numel=64)]
    try:
        comm.start_round(msgs, {}, {0: torch.empty(64)}).wait()
    except RoutedCommError as exc:
        return str(exc)
    return "no error"


def test_dead_peer_times_out_with_a_clear_error(world):
    # Last in the module: the timed-out receive stays posted, so the group is retired after it.
    err = world.run(_dead_peer)[0]
    # Op ids are the rank's own schedule's (its projection of the round): op 1 of the whole round.
    assert err.startswith("rank 0: receiving op 0 (remap.nic, remap) with rank 4 did not complete within "
                          "--timeout 1 s")
    assert "stalled or died" in err
