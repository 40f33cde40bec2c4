"""Several ranks of one Plan in one process: a thread per rank, rounds as device copies.

A machine with one GPU cannot run two NCCL ranks, but the engine's schedule (rings,
merges, waves, local queue) can still run for real: each rank is a thread calling
``plan_attention`` for its own rank, and :class:`LoopbackCommunicator` delivers a
round's messages by copying the sender's tensor into the receiver's buffer -- on a
stream of its own on CUDA, so that a profiler sees transfers beside compute as it
would with NCCL.  Used by ``benchmarks/gpu_check.py`` (engine overhead and stream
concurrency) and tested on CPU against single-rank attention.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping, Sequence

import torch

from megatron_zeppelin.comm.base import ByteCounters, Message


class LoopbackHub:
    """What the ranks of one process share: posted sends and two barriers per round."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.posted: dict[tuple[int, int], torch.Tensor] = {}
        self.lock = threading.Lock()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        """The copies' own CUDA stream (NCCL's role), or None on CPU."""


class LoopbackCommunicator:
    """One rank's view of a :class:`LoopbackHub` (the ``Communicator`` protocol)."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        self.hub, self.rank = hub, rank
        self.counters = ByteCounters()
        self._rounds = 0

    def start_round(self, messages: Sequence[Message], sends: Mapping[int, torch.Tensor],
                    recvs: Mapping[int, torch.Tensor]) -> "LoopbackPending":
        index = self._rounds
        self._rounds += 1
        ready = None
        if self.hub.stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the sends were written on this rank's stream
        with self.hub.lock:
            for m in messages:
                if m.src == self.rank:
                    self.hub.posted[(index, m.id)] = sends[m.id]
                    if m.dst != self.rank:
                        self.counters.intra_node += sends[m.id].numel() * sends[m.id].element_size()
        return LoopbackPending(self, index, [m for m in messages if m.dst == self.rank], recvs, ready)


class LoopbackPending:
    """A round in flight: ``wait`` copies this rank's receives once every rank posted."""

    def __init__(self, comm: LoopbackCommunicator, index: int, incoming: list[Message],
                 recvs: Mapping[int, torch.Tensor], ready) -> None:
        self.comm, self.index, self.incoming, self.recvs, self.ready = comm, index, incoming, recvs, ready

    def wait(self) -> None:
        hub = self.comm.hub
        hub.barrier.wait()  # every rank has posted this round's sends
        stream = hub.stream
        if stream is None:
            for m in self.incoming:
                self.recvs[m.id].copy_(hub.posted[(self.index, m.id)])
        else:
            stream.wait_event(self.ready)
            with torch.cuda.stream(stream):
                for m in self.incoming:
                    self.recvs[m.id].copy_(hub.posted[(self.index, m.id)], non_blocking=True)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.current_stream().synchronize()  # the senders may reuse their buffers after the barrier
        hub.barrier.wait()  # every rank has copied: the senders may reuse their buffers
        with hub.lock:
            for m in self.incoming:
                hub.posted.pop((self.index, m.id), None)


def run_ranks(hub: LoopbackHub, work: Callable[[int], object]) -> list:
    """``work(rank)`` on one thread per rank of ``hub``; the results in rank order.  A
    rank that fails breaks the hub's barrier, so the others stop instead of waiting."""
    results: list = [None] * hub.world_size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # noqa: BLE001  handed to the caller below
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(hub.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results
