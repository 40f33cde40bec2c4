"""Several ranks of one Plan in one process: a thread per rank, rounds as device copies.

A machine with one GPU cannot run two NCCL ranks, but the engine's schedule (rings,
Ulysses, local work on their lanes) can still run for real: each rank is a thread
calling ``plan_attention`` for its own rank, and :class:`LoopbackCommunicator` is
the engine's lane communicator whose transfers are copies of the sender's tensor
into the receiver's buffer -- issued from the communication lane, on its own CUDA
stream, so that a profiler sees transfers beside compute as it would with NCCL.  Used by ``benchmarks/gpu_check.py`` (engine overhead and stream
concurrency) and tested on CPU against single-rank attention.
"""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import Callable

import torch

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.comm.lanes import LaneRunner
from megatron_zeppelin.comm.rounds import LaneCommunicator
from megatron_zeppelin.schedule.attention import Transport
from megatron_zeppelin.topology import Topology


class LoopbackHub:
    """What the ranks of one process share: the sends posted to each peer."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self.cv = threading.Condition()
        self.posted: dict[tuple[int, int, int], tuple[torch.Tensor, threading.Event]] = {}
        """(src, dst, tag) -> the sender's tensor and the event it waits on."""
        self.failed = False
        """A rank failed: every wait ends (``run_ranks`` sets it)."""

    def fail(self) -> None:
        with self.cv:
            self.failed = True
            self.cv.notify_all()


class _SendWork:
    def __init__(self, taken: threading.Event) -> None:
        self.taken = taken

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self.taken.wait(None if timeout is None else timeout.total_seconds())


class _RecvWork:
    def __init__(self, hub: LoopbackHub, key: tuple[int, int, int], buffer: torch.Tensor) -> None:
        self.hub, self.key, self.buffer = hub, key, buffer

    def wait(self, timeout: timedelta | None = None) -> bool:
        hub = self.hub
        with hub.cv:
            if not hub.cv.wait_for(lambda: self.key in hub.posted or hub.failed,
                                   None if timeout is None else timeout.total_seconds()):
                return False
            if hub.failed:
                raise RuntimeError("another rank failed")
            tensor, taken = hub.posted.pop(self.key)
        # On CUDA the lane thread's current stream is the communicator's own: the
        # copy runs there, beside compute, as NCCL's kernels would.
        self.buffer.copy_(tensor, non_blocking=True)
        if self.buffer.is_cuda:
            torch.cuda.current_stream().synchronize()   # the sender may reuse its buffer once taken
        taken.set()
        return True


class LoopbackP2P:
    """``isend``/``irecv`` between the threads of one process, as copies."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> _SendWork:
        taken = threading.Event()
        with self.hub.cv:
            self.hub.posted[(self.rank, peer, tag)] = (tensor, taken)
            self.hub.cv.notify_all()
        return _SendWork(taken)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> _RecvWork:
        return _RecvWork(self.hub, (peer, self.rank, tag), tensor)


class LoopbackCommunicator(LaneCommunicator):
    """One rank of a :class:`LoopbackHub`: the engine's lane communicator with
    threads' copies for transfers (the ranks share one node, so nothing routes)."""

    def __init__(self, hub: LoopbackHub, rank: int, timeout: timedelta = timedelta(seconds=120)) -> None:
        # No process group: the parts LaneCommunicator.__init__ would take from one.
        self.group, self.rank, self.device = None, rank, hub.device
        self.topology = Topology(nodes=1, gpus_per_node=hub.world_size, nics_per_node=1)
        self.counters = ByteCounters()
        self.min_routed_bytes = math.inf
        self.itemsize = torch.empty(()).element_size()
        self.transport = Transport(self.topology)
        self.runner = LaneRunner(None, rank, self.counters, device=hub.device, timeout=timeout,
                                 p2p=LoopbackP2P(hub, rank))
        self.recorder = None


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
            hub.fail()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(hub.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        from megatron_zeppelin.comm.deadline import CommTimeoutError
        raise next((e for e in errors if not isinstance(e, CommTimeoutError)), errors[0])
    return results
