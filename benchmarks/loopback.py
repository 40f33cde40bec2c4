"""Several ranks of one Plan in one process, with NCCL's stream semantics.

A machine with one GPU cannot run two NCCL ranks, but the engine's CUDA branch
can still run for real: each rank is a thread whose caller works on a stream of
its own, and :class:`LoopbackP2P` moves tensors between the threads the way NCCL
orders them:

* a send is ordered after the sending lane's stream by an event, and the
  sender's tensor is kept alive for the receiving stream (``record_stream``);
* the receive copies on the receiving lane's stream, after that event;
* completion is stream-ordered (``work.wait()`` makes the waiting stream wait
  on the copy's event): no host sync anywhere.

:class:`Delays` makes streams slow on purpose (``torch.cuda._sleep`` on a GPU):
a wrong stream order then gives wrong numbers, where a synced run would hide
it.  Used by ``benchmarks/stream_checks.py`` (``gpu_check``'s engine sections),
and on CPU tensors with the recording checker by the tests.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.comm.lanes import LaneRunner
from megatron_zeppelin.comm.p2p import Transfer
from megatron_zeppelin.comm.rounds import LaneCommunicator
from megatron_zeppelin.comm.streams import StreamOps, streams_for
from megatron_zeppelin.topology import Topology


@dataclass(frozen=True)
class Delays:
    """Seconds a stream is held busy, per place (0: not at all)."""

    caller_s: float = 0.0
    """The caller's stream, before q/k/v are written (a QKV projection still running)."""
    transfer_s: float = 0.0
    """The receiving lane's stream, before every copy (a slow link)."""
    compute_s: float = 0.0
    """The caller's stream after every compute op of the engine."""


#: Cycles of ``torch.cuda._sleep`` per second (about 1.5 GHz; only the order of magnitude matters).
SLEEP_CYCLES_PER_S = 1.5e9


def hold(streams: StreamOps, stream: Any, seconds: float) -> None:
    """Keep ``stream`` busy for ``seconds`` (CUDA: a sleep kernel; CPU: the host sleeps,
    which shuffles the threads' interleaving)."""
    if seconds <= 0:
        return
    if streams.device.type == "cuda":
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(seconds * SLEEP_CYCLES_PER_S))
    else:
        time.sleep(seconds)


class DelayedStreams:
    """A :class:`StreamOps` that holds the caller's stream after each compute op
    (before the op's event), delegating everything else."""

    def __init__(self, base: StreamOps, compute_s: float) -> None:
        self.base, self.compute_s = base, compute_s
        self.device = base.device
        self.callers: set[int] = set()
        """ids of the streams that count as callers (the harness registers them)."""

    def record(self, event: Any, stream: Any) -> None:
        if id(stream) in self.callers:
            hold(self.base, stream, self.compute_s)
        self.base.record(event, stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


class LoopbackHub:
    """What the ranks of one process share: the sends posted to each peer."""

    def __init__(self, world_size: int, device: torch.device, streams: StreamOps | None = None,
                 delays: Delays = Delays()) -> None:
        self.world_size = world_size
        self.device = device
        self.streams = streams if streams is not None else streams_for(device)
        self.delays = delays
        self.cv = threading.Condition()
        self.posted: dict[tuple[int, int, int], tuple[torch.Tensor, Any, "_SendWork"]] = {}
        """(src, dst, tag) -> the sender's tensor, the event it is ready at, its work."""
        self.failed = False
        """A rank failed: every wait ends (``run_ranks`` sets it)."""

    def fail(self) -> None:
        with self.cv:
            self.failed = True
            self.cv.notify_all()


class _SendWork:
    def __init__(self, streams: StreamOps) -> None:
        self.streams = streams
        self.copied = threading.Event()
        self.copy_event: Any = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.copied.wait(None if timeout is None else timeout.total_seconds()):
            return False
        s = self.streams                      # the sender's stream is after the receiver's copy
        s.wait_event(s.current_stream(), self.copy_event)
        return True


class _RecvWork:
    def __init__(self, hub: LoopbackHub, key: tuple[int, int, int], buffer: torch.Tensor) -> None:
        self.hub, self.key, self.buffer = hub, key, buffer

    def wait(self, timeout: timedelta | None = None) -> bool:
        hub, s = self.hub, self.hub.streams
        with hub.cv:
            if not hub.cv.wait_for(lambda: self.key in hub.posted or hub.failed,
                                   None if timeout is None else timeout.total_seconds()):
                return False
            if hub.failed:
                raise RuntimeError("another rank failed")
            tensor, ready, send = hub.posted.pop(self.key)
        stream = s.current_stream()           # the receiving lane's
        s.wait_event(stream, ready)
        hold(s, stream, hub.delays.transfer_s)
        s.record_stream(tensor, stream)       # the sender's block outlives its reader
        self.buffer.copy_(tensor, non_blocking=True)
        send.copy_event = s.new_event()
        s.record(send.copy_event, stream)
        send.copied.set()
        return True


class LoopbackP2P:
    """``post`` between the threads of one process, ordered as NCCL orders it."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def post(self, transfers: Sequence[Transfer]) -> list:
        hub, s = self.hub, self.hub.streams
        works: list = []
        for t in transfers:
            if t.send:
                ready = s.new_event()
                s.record(ready, s.current_stream())
                work = _SendWork(s)
                with hub.cv:
                    hub.posted[(self.rank, t.peer, t.tag)] = (t.tensor, ready, work)
                    hub.cv.notify_all()
                works.append(work)
            else:
                works.append(_RecvWork(hub, (t.peer, self.rank, t.tag), t.tensor))
        return works


class LoopbackCommunicator(LaneCommunicator):
    """One rank of a :class:`LoopbackHub`: the engine's lane communicator over
    threads' copies.  ``topology`` and ``min_routed_bytes`` as for the real ones
    (a two-node topology with routing on exercises the proxies' hops); ``dtype``:
    what routed remap messages carry, as the real ones are told."""

    def __init__(self, hub: LoopbackHub, rank: int, topology: Topology | None = None,
                 min_routed_bytes: float = math.inf, timeout: timedelta = timedelta(seconds=120),
                 dtype: torch.dtype = torch.float32) -> None:
        # No process group: the rank, device and lane runner LaneCommunicator.__init__ would take from one.
        topology = topology or Topology(nodes=1, gpus_per_node=hub.world_size, nics_per_node=1)
        topology.check_world_size(hub.world_size)
        counters = ByteCounters()
        self._bind(None, rank, topology, counters, min_routed_bytes, dtype, hub.device,
                   LaneRunner(None, rank, counters, device=hub.device, timeout=timeout,
                              p2p=LoopbackP2P(hub, rank), streams=hub.streams))


def run_ranks(hub: LoopbackHub, work: Callable[[int], object]) -> list:
    """``work(rank)`` on one thread per rank of ``hub``; the results in rank order.  A
    rank that fails fails the hub, so the others stop instead of waiting."""
    results: list = [None] * hub.world_size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            with hub.streams.lane_thread():
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
