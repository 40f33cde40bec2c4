"""Executes one rank's lanes of a schedule (``schedule/ops.py``) with real overlap.

* **Compute lane** (the caller's thread): whenever free, runs the first op in
  lane order whose dependencies are done -- local sequences fill every gap in
  which ring or Ulysses work waits for a transfer.
* **Send lane** (a worker thread): posts this rank's transfers strictly in lane
  order, each once its data is there: the first hop of a message reads the
  binding's send tensor; a proxy's or a peer's hop forwards the piece it received.
* **Receive lane** (a worker thread): posts and completes this rank's receives
  in lane order, marking each op done as it lands.

No rank waits for the world: a rank only waits for the ops it depends on, and
ranks that take no part in a transfer never see it (proxies carry their
forwarding hops as ops of their own).  Every wait has a deadline: a stalled or
dead peer ends the call with :class:`CommTimeoutError` naming the rank, the op
and its peer, never a hang.

Transfers use ``torch.distributed`` point-to-point calls tagged with the op id
and the call's number modulo :data:`CALLS_IN_FLIGHT` (so a fast rank's next
call never matches a slow rank's current one).  Each call's lanes get threads
of their own -- calls in flight at once never queue behind each other's
blocked waits -- so the caller's compute overlaps the transfers on gloo.  On CUDA the send and receive lanes share one thread and one stream of
their own (NCCL wants one thread per communicator); CUDA events order compute
and communication, and the compute thread never blocks on the host.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.comm.deadline import CommTimeoutError
from megatron_zeppelin.errors import brief
from megatron_zeppelin.schedule.ops import Op, Schedule

#: Calls of one runner that may be in flight at once with distinct tags.
CALLS_IN_FLIGHT = 64
#: Default deadline of a wait (the trainer's ``--timeout`` overrides it).
DEFAULT_TIMEOUT = timedelta(seconds=300)


class Binding(Protocol):
    """What the ops of a schedule do on this rank."""

    def compute(self, op: Op) -> None: ...

    def send_tensor(self, message: int) -> torch.Tensor:
        """The contiguous tensor this rank sends as ``message`` (called once its deps are done)."""

    def recv_buffer(self, message: int) -> torch.Tensor:
        """The contiguous tensor ``message`` lands in on this rank."""


@dataclass
class OpTrace:
    """Executed times of this rank's ops in one call (monotonic nanoseconds: one
    clock for every process of a machine), for ``--dump-trace``."""

    ops: int
    """Ops in the call's schedule (what the step schedule's segment must hold)."""
    start_ns: dict[int, int] = field(default_factory=dict)
    """Op id -> when it started here (compute: kernel start; send: post)."""
    end_ns: dict[int, int] = field(default_factory=dict)
    """Op id -> when it ended here (compute: kernel end; receive: landed)."""
    begin_ns: int = 0
    """When the call began on this rank."""
    finish_ns: int = 0
    """When the call returned on this rank (every lane done)."""


class StepRecorder:
    """Every call of one step, in call order, with the times of this rank's ops."""

    def __init__(self) -> None:
        self.calls: list[OpTrace] = []
        self.marks: dict[str, int] = {}
        """Named instants of the step (e.g. ``backward_begin``), monotonic ns."""

    def new_call(self, schedule: Schedule) -> OpTrace:
        trace = OpTrace(len(schedule.ops), begin_ns=time.monotonic_ns())
        self.calls.append(trace)
        return trace

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic_ns()


class _Done:
    """Op ids that are done on this rank, with a condition to wait on them."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.cv = threading.Condition()
        self.error: BaseException | None = None

    def mark(self, op_id: int) -> None:
        with self.cv:
            self.ids.add(op_id)
            self.cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = exc
            self.cv.notify_all()

    def wait_for(self, predicate: Callable[[], bool], deadline: float, what: Callable[[], str]) -> None:
        with self.cv:
            while not predicate():
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(what())
                self.cv.wait(min(left, 1.0))


def _group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> timedelta:
    """The process group's own timeout (what its collectives honour), else the default."""
    try:
        return (group or dist.group.WORLD)._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT


class TorchP2P:
    """Point-to-point transfers of ``torch.distributed`` between ranks of ``group``."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._global = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(dist.get_world_size(group))]

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        return dist.isend(tensor, self._global[peer], self.group, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        return dist.irecv(tensor, self._global[peer], self.group, tag)


class LaneRunner:
    """Runs schedules for one rank of ``group`` (one per communicator)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, counters: ByteCounters, *,
                 device: torch.device, timeout: timedelta | None = None, p2p=None) -> None:
        """``p2p``: what moves a tensor to a peer (``isend/irecv(tensor, peer, tag)``
        returning works with ``wait(timeout)``); default ``torch.distributed`` over
        ``group``.  One process running several ranks as threads passes its own."""
        self.group = group
        self.rank = rank
        """This rank's index in the schedules (its rank in ``group``)."""
        self.counters = counters
        self.device = device
        self.timeout = timeout or _group_timeout(group, device)
        self.p2p = p2p if p2p is not None else TorchP2P(group)
        self._calls = 0
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        """The communication stream on CUDA (never the compute stream)."""
        # NCCL: one thread issues every call, in call order (one NCCL communicator
        # must not be driven from two threads at once).
        self._cuda_lane = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeppelin-lane",
                                              initializer=torch.cuda.set_device, initargs=(device,))
                           if cuda else None)

    def close(self) -> None:
        if self._cuda_lane is not None:
            self._cuda_lane.shutdown(wait=True)

    # ------------------------------------------------------------------ run
    def start(self, schedule: Schedule, binding: Binding, recorder: StepRecorder | None = None) -> "_Call":
        """Post this rank's communication lanes of ``schedule`` and return the call;
        ``call.run_compute()`` then runs the compute lane, ``call.wait()`` finishes.
        Collective: every rank starts every schedule, also one without ops of its
        own, because calls are numbered in order and the number is in the tags."""
        trace = recorder.new_call(schedule) if recorder is not None else None
        call = _Call(self, schedule, binding, trace, self._calls % CALLS_IN_FLIGHT)
        self._calls += 1
        call.launch()
        return call

    def run(self, schedule: Schedule, binding: Binding, recorder: StepRecorder | None = None) -> None:
        """Run every op of this rank in ``schedule``; returns when all are done."""
        call = self.start(schedule, binding, recorder)
        try:
            call.run_compute()
        finally:
            call.wait()


def run_without_transfers(schedule: Schedule, rank: int, binding: Binding) -> None:
    """Run ``rank``'s ops of a schedule that moves nothing to or from it, with no
    communicator at all (a single rank, or a plan of local sequences only)."""
    lanes = schedule.lanes(rank)
    if lanes.comm:
        raise ValueError(f"rank {rank}'s part of the plan sends or receives {len(lanes.comm)} transfers; "
                         "pass a communicator")
    for op in lanes.compute:
        binding.compute(op)


class _Call:
    """One schedule on one rank."""

    def __init__(self, runner: LaneRunner, schedule: Schedule, binding: Binding, trace: OpTrace | None,
                 parity: int) -> None:
        self.r, self.schedule, self.binding, self.trace = runner, schedule, binding, trace
        self.parity = parity
        lanes = schedule.lanes(runner.rank)
        self.compute_ops = lanes.compute
        self.sends = [op for op in lanes.comm if op.rank == runner.rank]
        self.recvs = [op for op in lanes.comm if op.peer == runner.rank]
        self.done = _Done()
        self.deadline = time.monotonic() + runner.timeout.total_seconds()
        self.in_transit: dict[tuple[int, int], torch.Tensor] = {}   # (message, piece) -> forwarded bytes
        self.futures = []
        self.threads: list[threading.Thread] = []
        self.send_works: list = []
        self.ready_events: dict[int, torch.cuda.Event] = {}
        self.send_tensors: dict[int, torch.Tensor] = {}   # message -> the binding's send tensor
        self.recv_tensors: dict[int, torch.Tensor] = {}   # message -> the binding's receive buffer
        received = {(o.key[0], o.key[1]) for o in self.recvs}
        self.forwarded = {(o.key[0], o.key[1]) for o in self.sends} & received
        """(message, piece) this rank receives and sends on: its proxy or peer legs."""

    def _what(self, op: Op, doing: str, cause: BaseException | None = None) -> Callable[[], str]:
        """The one line a missed deadline gives: this rank, the op, the peer (and,
        for a compute or send op, the ops it still waits for)."""
        def text() -> str:
            peer = op.peer if op.rank == self.r.rank else op.rank
            missing = [d for d in op.deps if d not in self.done.ids] if doing != "receiving" else []
            waits = f", waiting on op(s) {missing[:6]}" if missing else ""
            why = f" ({brief(cause)})" if cause is not None else ""
            return (f"rank {self.r.rank}: {doing} op {op.id} ({op.name}, {op.tier}) with rank {peer}{waits} "
                    f"did not complete within --timeout {self.r.timeout.total_seconds():g} s{why}: a peer "
                    "stalled or died, or the ranks run different schedules (check the other ranks)")
        return text

    def _tag(self, op: Op) -> int:
        return op.id * CALLS_IN_FLIGHT + self.parity

    def _view(self, op: Op, tensor: torch.Tensor) -> torch.Tensor:
        mid, piece, phase, offset, numel, itemsize = op.key
        if tensor.element_size() != itemsize:
            raise TypeError(f"rank {self.r.rank}: message {mid} travels in {itemsize}-byte elements, its "
                            f"tensor is {tensor.dtype}")
        flat = tensor.reshape(-1)
        if flat.numel() < offset + numel:
            raise ValueError(f"rank {self.r.rank}: message {mid} needs {offset + numel} elements, its tensor "
                             f"holds {flat.numel()}")
        return flat.view(torch.uint8)[offset * itemsize:(offset + numel) * itemsize]

    # ------------------------------------------------------------- threads
    def launch(self) -> None:
        if self.r._cuda_lane is not None:
            self.futures = [self.r._cuda_lane.submit(self._guard, self._comm_lane_cuda)]
            return
        for lane, ops in ((self._send_lane, self.sends), (self._recv_lane, self.recvs)):
            if ops:
                thread = threading.Thread(target=self._guard, args=(lane,), daemon=True,
                                          name="zeppelin-lane")
                thread.start()
                self.threads.append(thread)

    def _guard(self, lane: Callable[[], None]) -> None:
        try:
            lane()
        except BaseException as exc:          # surfaced by the compute thread
            self.done.fail(exc)

    def _send_buffer(self, op: Op) -> torch.Tensor:
        mid, piece = op.key[0], op.key[1]
        if (mid, piece) in self.in_transit:          # a proxy or peer forwarding a piece
            return self.in_transit.pop((mid, piece))
        if mid not in self.send_tensors:             # a routed message sends a piece per NIC
            self.send_tensors[mid] = self.binding.send_tensor(mid)
        return self._view(op, self.send_tensors[mid])

    def _recv_buffer(self, op: Op) -> torch.Tensor:
        mid, piece = op.key[0], op.key[1]
        if (mid, piece) in self.forwarded:           # a proxy or peer: the piece moves on
            buf = self.in_transit[(mid, piece)] = torch.empty(op.nbytes, dtype=torch.uint8,
                                                              device=self.r.device)
            return buf
        if mid not in self.recv_tensors:             # the destination: pieces land in one buffer
            self.recv_tensors[mid] = self.binding.recv_buffer(mid)
        return self._view(op, self.recv_tensors[mid])

    def _count(self, op: Op) -> None:
        c = self.r.counters
        if op.nic is None:
            c.intra_node += op.nbytes
        else:
            c.inter_node_per_nic[op.nic] = c.inter_node_per_nic.get(op.nic, 0) + op.nbytes

    def _send_lane(self) -> None:
        for op in self.sends:
            self.done.wait_for(lambda: all(d in self.done.ids for d in op.deps), self.deadline,
                               self._what(op, "sending"))
            buf = self._send_buffer(op)
            if self.trace is not None:
                self.trace.start_ns[op.id] = time.monotonic_ns()
            self.send_works.append((op, self.r.p2p.isend(buf, op.peer, self._tag(op))))
            self._count(op)
        for op, work in self.send_works:
            self._wait_work(op, work, "sending")

    def _recv_lane(self) -> None:
        for op in self.recvs:
            buf = self._recv_buffer(op)
            work = self.r.p2p.irecv(buf, op.rank, self._tag(op))
            self._wait_work(op, work, "receiving")
            if self.trace is not None:
                self.trace.end_ns[op.id] = time.monotonic_ns()
            self.done.mark(op.id)

    def _wait_work(self, op: Op, work, doing: str) -> None:
        left = self.deadline - time.monotonic()
        try:
            if left <= 0 or not work.wait(timedelta(seconds=max(left, 0.001))):
                raise RuntimeError("deadline passed")
        except RuntimeError as exc:
            raise CommTimeoutError(self._what(op, doing, exc)()) from None

    def _comm_lane_cuda(self) -> None:
        """NCCL: one thread posts both lanes in the schedule's global order on the
        communication stream; events order them against the compute stream."""
        stream = self.r.stream
        with torch.cuda.stream(stream):
            for op in sorted((*self.sends, *self.recvs), key=lambda o: o.id):
                if op.rank == self.r.rank:
                    self.done.wait_for(lambda: all(d in self.done.ids for d in op.deps), self.deadline,
                                       self._what(op, "sending"))
                    for d in op.deps:
                        event = self.ready_events.get(d)
                        if event is not None:
                            stream.wait_event(event)
                    work = self.r.p2p.isend(self._send_buffer(op), op.peer, self._tag(op))
                    self.send_works.append((op, work))
                    self._count(op)
                else:
                    work = self.r.p2p.irecv(self._recv_buffer(op), op.rank, self._tag(op))
                    work.wait()                       # orders the stream after the receive
                    event = torch.cuda.Event()
                    event.record(stream)
                    self.ready_events[op.id] = event
                    self.done.mark(op.id)
            for _, work in self.send_works:
                work.wait()

    # ------------------------------------------------------------- compute
    def run_compute(self) -> None:
        pending = list(self.compute_ops)
        cuda = self.r.stream is not None
        while pending:
            chosen = None
            with self.done.cv:
                while chosen is None:
                    if self.done.error is not None:
                        raise self.done.error
                    chosen = next((op for op in pending if all(d in self.done.ids for d in op.deps)), None)
                    if chosen is None:
                        left = self.deadline - time.monotonic()
                        if left <= 0:
                            raise CommTimeoutError(self._what(pending[0], "computing")())
                        self.done.cv.wait(min(left, 1.0))
            pending.remove(chosen)
            if cuda:
                for d in chosen.deps:
                    event = self.ready_events.get(d)
                    if event is not None:
                        torch.cuda.current_stream().wait_event(event)
            start = time.monotonic_ns()
            self.binding.compute(chosen)
            if cuda:
                event = torch.cuda.Event()
                event.record()
                self.ready_events[chosen.id] = event
            if self.trace is not None:
                self.trace.start_ns[chosen.id] = start
                self.trace.end_ns[chosen.id] = time.monotonic_ns()
            self.done.mark(chosen.id)

    def wait(self) -> None:
        """Wait for both communication lanes (deadline included) and re-raise their errors."""
        for thread in self.threads:
            thread.join(max(self.deadline - time.monotonic(), 0.001) + 5.0)
        for future in self.futures:
            try:
                future.result(timeout=max(self.deadline - time.monotonic(), 0.001) + 5.0)
            except TimeoutError:
                pass
        if self.done.error is None and (any(t.is_alive() for t in self.threads)
                                        or any(not f.done() for f in self.futures)):
            self.done.fail(CommTimeoutError(
                f"rank {self.r.rank}: communication lanes did not complete within --timeout "
                f"{self.r.timeout.total_seconds():g} s: a peer stalled or died (check the other ranks)"))
        if self.done.error is not None:
            raise self.done.error
        if self.trace is not None:
            self.trace.finish_ns = time.monotonic_ns()
