"""Executes one rank's lanes of a schedule (``schedule/ops.py``) with real overlap.

* **Communication lanes**, one per link class (``intra``: inside a node;
  ``inter``: through a NIC), each a worker thread with a stream of its own.  A
  lane posts its transfers a *wave* at a time (``Schedule.wave``: transfers
  that do not depend on each other), all of a wave in one batch, so a ring step
  costs one transfer, not k; inter-node transfers never queue behind intra-node
  ones, or the reverse.
* **Compute lane** (the caller's thread, on the caller's stream): whenever
  free, runs the first op in lane order whose dependencies have *fired* -- on
  CUDA, whose events the device has passed -- so local sequences fill every gap
  in which ring or Ulysses work waits for a transfer, also on a GPU, where an
  op enqueued early would hold the stream behind its wait.

Streams and events are reached through :class:`~megatron_zeppelin.comm.streams.StreamOps`
only, so the same code runs on CUDA, on CPU, and on CPU under the recording
checker (``comm/stream_check.py``).  The stream protocol (``docs/engine.md``):

1. a lane's stream waits on the caller's stream at the call's start (the
   call's inputs were written there);
2. a send waits on the events of the ops that produced its data; a receive
   lands in a buffer allocated on the caller's stream, and its event is
   recorded on the lane after the transfer's ``work.wait()``;
3. a compute op waits on the events of its dependencies, and records its own;
4. the caller's stream waits on every lane's last event at the call's end, and
   only then are the call's transfer buffers released.

No rank waits for the world: a rank only waits for the ops it depends on.
Every wait has a deadline: a stalled or dead peer ends the call with
:class:`CommTimeoutError` naming the rank, the op and its peer, never a hang.
Transfers are tagged with their index among the transfers between their two
ends (``Schedule.pair_tags``: the same in the whole schedule and in either
end's projection, which is what a rank's engine runs) and the call's number
modulo :data:`CALLS_IN_FLIGHT` (so a fast rank's next call never matches a slow
rank's current one).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.comm.deadline import CommTimeoutError
from megatron_zeppelin.comm.lane_trace import OpTrace, StepRecorder
from megatron_zeppelin.comm.p2p import TorchP2P, Transfer
from megatron_zeppelin.comm.streams import StreamOps, streams_for
from megatron_zeppelin.errors import brief
from megatron_zeppelin.schedule.ops import Op, Schedule, lane_of

__all__ = ["CALLS_IN_FLIGHT", "DEFAULT_TIMEOUT", "LANES", "Binding", "LaneRunner", "OpTrace", "StepRecorder",
           "lane_of", "run_without_transfers"]

#: Calls of one runner that may be in flight at once with distinct tags.
CALLS_IN_FLIGHT = 64
#: Default deadline of a wait (the trainer's ``--timeout`` overrides it).
DEFAULT_TIMEOUT = timedelta(seconds=300)
#: Communication lanes, by link class.
LANES = ("inter", "intra")
#: Seconds between looks at unfired events (CUDA: a receive still in flight).
POLL_S = 0.0002


class Binding(Protocol):
    """What the ops of a schedule do on this rank."""

    def compute(self, op: Op) -> None: ...

    def send_tensor(self, message: int) -> torch.Tensor:
        """The contiguous tensor this rank sends as ``message`` (called on the
        sending lane, its stream current, once the data's producers are done)."""

    def recv_buffer(self, message: int) -> torch.Tensor:
        """The contiguous tensor ``message`` lands in on this rank (called with
        the caller's stream current: the buffer belongs to its consumer)."""


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
        """Keep the first error -- or, of two lanes' timeouts, the earlier op's:
        the root cause, whichever lane noticed first."""
        with self.cv:
            if self.error is None or getattr(exc, "op_id", -1) < getattr(self.error, "op_id", -1):
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


def _timeout(text: str, op: Op) -> CommTimeoutError:
    exc = CommTimeoutError(text)
    exc.op_id = op.id
    return exc


def _group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> timedelta:
    """The process group's own timeout (what its collectives honour), else the default."""
    try:
        return (group or dist.group.WORLD)._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT


class _LaneWorker:
    """One daemon thread running a lane's calls in call order (NCCL wants one
    thread per communicator; a daemon never holds a dying process open)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None]) -> Future:
        future: Future = Future()
        self.tasks.put((fn, future))
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, daemon=True, name=f"zeppelin-{self.name}")
            self.thread.start()
        return future

    def _loop(self) -> None:
        while (item := self.tasks.get()) is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001  handed to the caller through the future
                future.set_exception(exc)

    def close(self) -> None:
        if self.thread is not None:
            self.tasks.put(None)


class LaneRunner:
    """Runs schedules for one rank of ``group`` (one per communicator)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, counters: ByteCounters, *,
                 device: torch.device, timeout: timedelta | None = None, p2p=None,
                 lane_p2p: dict[str, Any] | None = None, streams: StreamOps | None = None) -> None:
        """``p2p``: what moves tensors between ranks (``post(transfers) -> works``
        whose ``wait(timeout)`` completes them); default ``torch.distributed`` over
        ``group``.  ``lane_p2p``: a transport per lane (NCCL: a communicator per
        link class, so their transfers run side by side); default ``p2p`` for both.
        ``streams``: how streams are reached (default: the device's own)."""
        self.group = group
        self.rank = rank
        """This rank's index in the schedules (its rank in ``group``)."""
        self.counters = counters
        self.device = device
        self.timeout = timeout or _group_timeout(group, device)
        self.streams = streams if streams is not None else streams_for(device)
        base = p2p if p2p is not None else TorchP2P(group)
        self.p2p = {lane: self.streams.transport((lane_p2p or {}).get(lane, base)) for lane in LANES}
        self.lane_streams = {lane: self.streams.new_stream() for lane in LANES}
        self.workers = {lane: _LaneWorker(lane) for lane in LANES}
        self._calls = 0

    @property
    def stream(self) -> Any:
        """The intra-node lane's stream (never the caller's)."""
        return self.lane_streams["intra"]

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()

    def start(self, schedule: Schedule, binding: Binding, recorder: StepRecorder | None = None) -> "_Call":
        """Post this rank's communication lanes of ``schedule`` and return the call;
        ``call.run_compute()`` then runs the compute lane, ``call.wait()`` finishes.
        Collective: every rank starts every schedule, also one without ops of its
        own, because calls are numbered in order and the number is in the tags."""
        trace = recorder.new_call(schedule, self.rank) if recorder is not None else None
        call = _Call(self, schedule, binding, trace, self._calls % CALLS_IN_FLIGHT)
        self._calls += 1
        call.launch()
        return call

    def run(self, schedule: Schedule, binding: Binding, recorder: StepRecorder | None = None) -> None:
        """Run every op of this rank in ``schedule``; returns when all are enqueued
        and the caller's stream is ordered after them."""
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
        me = runner.rank
        lanes = schedule.lanes(me)
        self.compute_ops = lanes.compute
        self.batches = schedule.wave_batches(me)
        self.tags = schedule.pair_tags(me)
        self.own = schedule.own_index(me) if trace is not None else {}
        self.done = _Done()
        self.events: dict[int, Any] = {}
        """Op id -> the event recorded after it (compute: caller's stream; receive: its lane's)."""
        self.finals: list[Any] = []
        self.deadline = time.monotonic() + runner.timeout.total_seconds()
        self.in_transit: dict[tuple[int, int], torch.Tensor] = {}   # (message, piece) -> forwarded bytes
        self.futures: list[Future] = []
        self.send_tensors: dict[int, tuple] = {}   # message -> the binding's send tensor, its event, its stream
        self.recv_tensors: dict[int, torch.Tensor] = {}   # message -> the binding's receive buffer
        self.lock = threading.Lock()
        sends = {(o.key[0], o.key[1]) for o in lanes.comm if o.rank == me}
        received = {(o.key[0], o.key[1]) for o in lanes.comm if o.peer == me}
        self.forwarded = sends & received
        """(message, piece) this rank receives and sends on: its proxy or peer legs."""
        self.held: list[torch.Tensor]
        """Every tensor a transfer touched: released only once the caller's stream
        is ordered after the lanes (rule 4), so no block is reused under a transfer."""
        s = runner.streams
        self.caller = s.current_stream()
        self.landing = {op.id: self._recv_buffer(op) for op in lanes.comm if op.peer == me}
        self.held = list(self.landing.values())
        self.start_event = s.new_event()
        s.record(self.start_event, self.caller)
        self.timed: list[tuple[dict[int, int], int, Any]] = []
        """(trace.start_ns or trace.end_ns, op id, timed event): on CUDA the trace's
        times are the device's, read from events once the call is done."""
        self.zero = None
        if trace is not None:
            self.zero = s.new_event(timing=True)
            s.record(self.zero, self.caller)
            trace.begin_ns = time.monotonic_ns()

    def _what(self, op: Op, doing: str, cause: BaseException | None = None) -> Callable[[], str]:
        """The one line a missed deadline gives: this rank, the op (its id in this
        rank's schedule: its projection), the peer (and, for a compute or send op,
        the ops it still waits for)."""
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
        return self.tags[op.id] * CALLS_IN_FLIGHT + self.parity

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

    # ------------------------------------------------------------- lanes
    def launch(self) -> None:
        for lane, batches in self.batches.items():
            self.futures.append(self.r.workers[lane].submit(lambda lane=lane, b=batches: self._guard(lane, b)))

    def _guard(self, lane: str, batches: list[list[Op]]) -> None:
        try:
            self._run_lane(lane, batches)
        except BaseException as exc:          # surfaced by the compute thread
            self.done.fail(exc)

    def _send_buffer(self, op: Op, stream: Any) -> torch.Tensor:
        mid, piece = op.key[0], op.key[1]
        s = self.r.streams
        with self.lock:                              # a routed message's pieces leave on both lanes
            if (mid, piece) in self.in_transit:      # a proxy or peer forwarding a piece
                return self.in_transit.pop((mid, piece))
            if mid not in self.send_tensors:         # a routed message sends a piece per NIC
                tensor, made = self.binding.send_tensor(mid), s.new_event()
                s.record(made, stream)
                self.send_tensors[mid] = (tensor, made, stream)
            tensor, made, maker = self.send_tensors[mid]
        if maker is not stream:
            # Made on the other lane's stream (a dK/dV sum, a Ulysses piece):
            # read here only after it is made, and its block kept for this reader.
            s.wait_event(stream, made)
            s.record_stream(tensor, stream)
        return self._view(op, tensor)

    def _recv_buffer(self, op: Op) -> torch.Tensor:
        """Where ``op`` lands: allocated on the caller's stream before the call's
        start event (rule 2), so the lane's write is ordered after any earlier use
        of the block there."""
        mid, piece = op.key[0], op.key[1]
        if (mid, piece) in self.forwarded:           # a proxy or peer: the piece moves on
            buf = self.in_transit[(mid, piece)] = torch.empty(op.nbytes, dtype=torch.uint8, device=self.r.device)
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

    def _run_lane(self, lane: str, batches: list[list[Op]]) -> None:
        s, me = self.r.streams, self.r.rank
        stream, p2p = self.r.lane_streams[lane], self.r.p2p[lane]
        sent: list[tuple[Op, Any]] = []
        with s.lane_thread(), s.use(stream):
            s.wait_event(stream, self.start_event)           # rule 1
            for batch in batches:
                transfers = []
                for op in batch:
                    if op.rank == me:
                        self.done.wait_for(lambda op=op: all(d in self.done.ids for d in op.deps), self.deadline,
                                           self._what(op, "sending"))
                        for d in op.deps:                    # rule 2: after the data's producers
                            s.wait_event(stream, self.events[d])
                        buf = self._send_buffer(op, stream)
                        transfers.append(Transfer(True, buf, op.peer, self._tag(op)))
                        self.held.append(buf)
                    else:
                        transfers.append(Transfer(False, self.landing[op.id], op.rank, self._tag(op)))
                works = p2p.post(transfers)
                landing = []
                for op, work in zip(batch, works):
                    if op.rank == me:
                        self._stamp(self.trace and self.trace.start_ns, op, stream)
                        sent.append((op, work))
                        self._count(op)
                    else:
                        landing.append((op, work))
                for op, work in landing:
                    self._wait_work(op, work, "receiving")   # NCCL: orders this lane's stream after it
                    event = s.new_event()
                    s.record(event, stream)
                    self.events[op.id] = event
                    self._stamp(self.trace and self.trace.end_ns, op, stream)
                    self.done.mark(op.id)
            for op, work in sent:
                self._wait_work(op, work, "sending")
            final = s.new_event()
            s.record(final, stream)
            self.finals.append(final)

    def _wait_work(self, op: Op, work, doing: str) -> None:
        left = self.deadline - time.monotonic()
        try:
            if left <= 0 or work.wait(timedelta(seconds=max(left, 0.001))) is False:
                raise RuntimeError("deadline passed")
        except RuntimeError as exc:
            raise _timeout(self._what(op, doing, exc)(), op) from None

    # ------------------------------------------------------------- compute
    def _ready(self, op: Op) -> bool | None:
        """True: every dependency has fired; None: all done, some still in flight
        on the device; False: some not done yet."""
        if not all(d in self.done.ids for d in op.deps):
            return False
        fired = self.r.streams.fired
        return True if all(fired(self.events[d]) for d in op.deps) else None

    def _next_ready(self, pending: list[Op]) -> Op:
        """The first op of ``pending`` whose dependencies have fired (waits for one)."""
        with self.done.cv:
            while True:
                if self.done.error is not None:
                    raise self.done.error
                states = [(op, self._ready(op)) for op in pending]
                ready = next((op for op, state in states if state), None)
                if ready is not None:
                    return ready
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(self._what(pending[0], "computing")())
                in_flight = any(state is None for _, state in states)
                self.done.cv.wait(min(left, POLL_S if in_flight else 1.0))

    def run_compute(self) -> None:
        try:
            self._run_compute()
        except BaseException as exc:
            self.done.fail(exc)          # the lanes stop waiting for ops that will never run
            raise

    def _run_compute(self) -> None:
        s = self.r.streams
        pending = list(self.compute_ops)
        while pending:
            op = self._next_ready(pending)
            pending.remove(op)
            for d in op.deps:                                # rule 3
                s.wait_event(self.caller, self.events[d])
            self._stamp(self.trace and self.trace.start_ns, op, self.caller)
            self.binding.compute(op)
            event = s.new_event()
            s.record(event, self.caller)
            self.events[op.id] = event
            self._stamp(self.trace and self.trace.end_ns, op, self.caller)
            self.done.mark(op.id)

    def wait(self) -> None:
        """Wait for the communication lanes (deadline included), order the caller's
        stream after them, and re-raise their errors."""
        for future in self.futures:
            try:
                future.result(timeout=max(self.deadline - time.monotonic(), 0.001) + 5.0)
            except TimeoutError:
                pass
        if self.done.error is None and any(not f.done() for f in self.futures):
            self.done.fail(CommTimeoutError(
                f"rank {self.r.rank}: communication lanes did not complete within --timeout "
                f"{self.r.timeout.total_seconds():g} s: a peer stalled or died (check the other ranks)"))
        if self.done.error is not None:
            raise self.done.error
        for final in self.finals:                            # rule 4
            self.r.streams.wait_event(self.caller, final)
        self.held.clear()
        self.in_transit.clear()
        if self.trace is not None:
            self._device_times()
            self.trace.finish_ns = time.monotonic_ns()

    def _stamp(self, times: dict[int, int] | None, op: Op, stream: Any) -> None:
        """``times[op] = now``, under the op's index among this rank's ops (``OpTrace``):
        the host's clock, and on CUDA a timed event on ``stream`` that
        :meth:`_device_times` turns into the device's time."""
        if times is None:
            return
        index = self.own[op.id]
        times[index] = time.monotonic_ns()
        event = self.r.streams.new_event(timing=True)
        self.r.streams.record(event, stream)
        self.timed.append((times, index, event))

    def _device_times(self) -> None:
        """Replace host stamps by device times (CUDA), on the host clock of the call's start."""
        for times, index, event in self.timed:
            ms = self.r.streams.elapsed_ms(self.zero, event)
            if ms is not None:
                times[index] = self.trace.begin_ns + round(ms * 1e6)
