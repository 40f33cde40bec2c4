"""DirectCommunicator on 4 gloo ranks (2 nodes x 2 GPUs, 2 NICs per node)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_zeppelin.comm.base import ByteCounters, Message
from megatron_zeppelin.comm.direct import CommTimeoutError, DirectCommunicator
from megatron_zeppelin.topology import Topology
from tests.distributed import world_fixture

TOPO = Topology(nodes=2, gpus_per_node=2, nics_per_node=2)

world = world_fixture(4)


def _payload(m: Message, dtype=torch.float32) -> torch.Tensor:
    # Distinct, recomputable contents per message.
    return torch.arange(m.numel, dtype=dtype) + 1000 * m.id + 100 * m.src


def _expected_counters(rounds: list[list[Message]], rank: int, itemsize: int) -> ByteCounters:
    c = ByteCounters()
    for msgs in rounds:
        for m in msgs:
            if m.src != rank or m.dst == rank:
                continue
            if TOPO.same_node(m.src, m.dst):
                c.intra_node += m.numel * itemsize
            else:
                nic = TOPO.nic_of(m.src)
                c.inter_node_per_nic[nic] = c.inter_node_per_nic.get(nic, 0) + m.numel * itemsize
    return c


def _rounds_case(rank, world_size, rounds, overlap, dtype):
    comm = DirectCommunicator(None, topology=TOPO)
    pendings, received = [], []
    for msgs in rounds:
        sends = {m.id: _payload(m, dtype) for m in msgs if m.src == rank}
        recvs = {m.id: torch.empty(m.numel, dtype=dtype) for m in msgs if m.dst == rank}
        pending = comm.start_round(msgs, sends, recvs)
        received.append(recvs)
        if overlap:
            pendings.append(pending)
        else:
            pending.wait()
    for p in pendings:
        p.wait()
    return received, comm.counters


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounds_deliver_and_count_exactly(world, overlap, dtype):
    rounds = [
        # intra (0->1), inter from NIC 0 (0->2) and NIC 1 (1->3), a self message, rank 2 idle sender
        [Message(0, 0, 1, 5), Message(1, 0, 2, 7), Message(2, 1, 3, 3), Message(3, 3, 3, 4)],
        [],                                                       # an empty round is legal
        # every rank sends to every other rank, same ids as round 0 reused
        [Message(i, s, d, 1 + i) for i, (s, d) in
         enumerate((s, d) for s in range(4) for d in range(4) if s != d)],
    ]
    results = world.run(_rounds_case, rounds, overlap, dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    for rank, (received, counters) in enumerate(results):
        for msgs, recvs in zip(rounds, received):
            assert set(recvs) == {m.id for m in msgs if m.dst == rank}
            for m in msgs:
                if m.dst == rank:
                    torch.testing.assert_close(recvs[m.id], _payload(m, dtype), rtol=0, atol=0)
        assert counters == _expected_counters(rounds, rank, itemsize)


def _misuse_case(rank, world_size):
    comm = DirectCommunicator(None, topology=TOPO)
    errors = []
    for sends in ({}, {0: torch.zeros(3)}, {0: torch.zeros(8)[::2]}):
        try:
            comm.start_round([Message(0, rank, (rank + 1) % world_size, 4)], sends, {})
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_misuse_raises_before_posting(world):
    for errors in world.run(_misuse_case):
        assert len(errors) == 3
        assert "no send tensor" in errors[0]
        assert "declares 4 elements" in errors[1] and "has 3" in errors[1]
        assert "contiguous: False" in errors[2]


def _timeout_case(rank, world_size):
    group = dist.new_group(timeout=timedelta(seconds=60))
    # The communicator's deadline bounds the wait, not the group's timeout.
    comm = DirectCommunicator(group, topology=TOPO, timeout=timedelta(seconds=1))
    # rank 0 expects a message that rank 1 never sends (rank 1 skipped the round)
    if rank == 0:
        pending = comm.start_round([Message(0, 1, 0, 4)], {}, {0: torch.empty(4)})
        try:
            pending.wait()
        except CommTimeoutError as exc:
            return str(exc)
        return "no error"
    return None


def test_timeout_surfaces_as_clear_error(world):
    message = world.run(_timeout_case)[0]
    assert message.startswith("rank 0: receiving op 0 (remap, remap) with rank 1 did not complete within "
                              "--timeout 1 s")
    assert "different schedules" in message


def _wrong_topology_case(rank, world_size):
    from megatron_zeppelin.errors import ConfigError
    try:
        DirectCommunicator(None, topology=Topology(nodes=1, gpus_per_node=2, nics_per_node=1))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_wrong_world_size_is_a_config_error(world):
    for message in world.run(_wrong_topology_case):
        assert message.startswith("world size 4 does not match the topology 1 nodes x 2 GPUs")


def test_a_fresh_nccl_group_is_warmed_up_by_every_rank(monkeypatch):
    """batch_isend_irecv's first call on a NCCL group must involve all its ranks;
    the communicator's constructor (run by every rank) makes that call."""
    calls = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "barrier", lambda group=None: calls.append(group))
    group = object()
    cpu = torch.device("cpu")      # no CUDA here: the warm-up is what is under test
    DirectCommunicator(group, TOPO, device=cpu)
    assert calls == [group]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    DirectCommunicator(group, TOPO, device=cpu)
    assert calls == [group]  # gloo needs no warm-up
