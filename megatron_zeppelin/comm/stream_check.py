"""A happens-before checker for the CUDA branch, run on CPU tensors.

:class:`RecordingStreams` is a :class:`~megatron_zeppelin.comm.streams.StreamOps`
whose streams exist only as vector clocks.  The engine runs its CUDA branch on
it unchanged -- the same lanes, events, waits and ``record_stream`` calls -- on
CPU tensors (gloo ranks, or threads over a loopback transport), while a
``TorchDispatchMode`` sees every kernel and attributes it to the calling
thread's current stream.  As CUDA's own sanitizer does on a GPU, it checks:

* **reads after writes**: a kernel touching bytes another stream wrote (or, for
  a write, read) must be ordered after that access by stream order, events
  or waits;
* **frees**: when a block dies, every other stream that touched it must be
  ordered before the allocating stream's present, unless ``record_stream``
  named that stream -- else the caching allocator could hand the block to new
  work while the transfer still reads or writes it.

Point-to-point transfers run on a modelled NCCL stream per transport, as
NCCL's do: posting orders it after the lane's current stream, ``work.wait()``
orders the lane after it.  Events are never assumed fired by the host: a
compute op is ordered after a receive only by an explicit wait on its event.
Kernel order on the CPU is the host's; the clocks model what CUDA would allow.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from megatron_zeppelin.comm.p2p import Transfer


class OrderingViolation(AssertionError):
    """An access or free CUDA would not order (raised by :meth:`RecordingStreams.check`)."""


@dataclass(eq=False)
class RecordedStream:
    """A stream as a vector clock: ``clock[s]`` is how far it is ordered after stream ``s``."""

    name: str
    index: int
    clock: dict[int, int] = field(default_factory=dict)

    def tick(self) -> int:
        self.clock[self.index] = self.clock.get(self.index, 0) + 1
        return self.clock[self.index]

    def after(self, clock: dict[int, int]) -> None:
        for s, t in clock.items():
            if self.clock.get(s, 0) < t:
                self.clock[s] = t

    def __repr__(self) -> str:
        return f"stream {self.name}"


@dataclass(eq=False)
class RecordedEvent:
    clock: dict[int, int] | None = None
    """What it marks (None: never recorded, so a wait on it orders nothing)."""


@dataclass
class _Access:
    lo: int
    hi: int
    stream: RecordedStream
    time: int
    write: bool
    what: str


class _Block:
    """What the checker knows of one storage: where it was allocated, who touched it."""

    def __init__(self, stream: RecordedStream | None) -> None:
        self.stream = stream
        self.accesses: list[_Access] = []
        self.recorded: list[RecordedStream] = []


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte interval of ``t`` inside its storage."""
    size = t.element_size()
    lo = hi = t.storage_offset()
    for n, st in zip(t.shape, t.stride()):
        if n > 1:
            if st >= 0:
                hi += (n - 1) * st
            else:
                lo += (n - 1) * st
    return lo * size, (hi + 1) * size


class RecordingStreams:
    """:class:`StreamOps` for CPU tensors that records and checks stream order.

    One instance serves a process (all its ranks, when they are threads):
    ``caller()`` gives a rank's caller stream, which a rank thread makes current
    with ``use`` before calling the engine."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device
        self._ids = itertools.count()
        self._local = threading.local()
        self._lock = threading.RLock()
        self._blocks: dict[int, _Block] = {}
        self.violations: list[str] = []
        self.default = self._stream("default")
        self.kernels = 0
        """Kernels seen (a check that ran nothing proves nothing)."""

    # ------------------------------------------------------------ StreamOps
    def _stream(self, name: str) -> RecordedStream:
        index = next(self._ids)
        return RecordedStream(f"{name}#{index}", index)

    def current_stream(self) -> RecordedStream:
        return getattr(self._local, "stream", None) or self.default

    def new_stream(self) -> RecordedStream:
        return self._stream("lane")

    def caller(self, name: str = "caller") -> RecordedStream:
        """A stream for a rank's caller (the stream its model's kernels run on)."""
        return self._stream(name)

    @contextlib.contextmanager
    def use(self, stream: RecordedStream):
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            with self.recording():
                yield
        finally:
            self._local.stream = before

    def lane_thread(self):
        return self.recording()

    def recording(self):
        """Record this thread's kernels (a dispatch mode is per thread; nested entries are free)."""
        if getattr(self._local, "mode", False):
            return contextlib.nullcontext()
        return _ThreadMode(self)

    def new_event(self, timing: bool = False) -> RecordedEvent:
        return RecordedEvent()

    def elapsed_ms(self, start: RecordedEvent, end: RecordedEvent) -> None:
        return None

    def record(self, event: RecordedEvent, stream: RecordedStream) -> None:
        with self._lock:
            event.clock = dict(stream.clock)

    def fired(self, event: RecordedEvent) -> bool:
        return event.clock is not None

    def wait_event(self, stream: RecordedStream, event: RecordedEvent) -> None:
        with self._lock:
            if event.clock is not None:
                stream.after(event.clock)

    def record_stream(self, tensor: torch.Tensor, stream: RecordedStream) -> None:
        with self._lock:
            self._block(tensor).recorded.append(stream)

    def transport(self, p2p: Any) -> "_RecordingTransport":
        return _RecordingTransport(self, p2p)

    # ------------------------------------------------------------ checking
    def _block(self, t: torch.Tensor, allocating: RecordedStream | None = None) -> _Block:
        storage = t.untyped_storage()
        key = id(storage)
        block = self._blocks.get(key)
        if block is None:
            block = self._blocks[key] = _Block(allocating)
            weakref.finalize(storage, self._freed, key)
        return block

    def access(self, t: torch.Tensor, stream: RecordedStream, write: bool, what: str) -> None:
        """``stream`` reads (or writes) ``t``'s bytes now."""
        if t.numel() == 0 or t.device.type != "cpu":
            return
        with self._lock:
            lo, hi = _span(t)
            block = self._block(t)
            for a in block.accesses:
                if a.stream is stream or a.hi <= lo or hi <= a.lo or not (write or a.write):
                    continue
                if stream.clock.get(a.stream.index, 0) < a.time:
                    kind = "writes" if write else "reads"
                    prior = "written" if a.write else "read"
                    self.violations.append(f"{what} on {stream} {kind} bytes [{lo}, {hi}) that {a.what} on "
                                           f"{a.stream} {prior}, with no event or wait ordering them")
            time = stream.tick()
            # A write by one stream hides its own earlier accesses of the same bytes.
            block.accesses = [a for a in block.accesses
                              if not (write and a.stream is stream and lo <= a.lo and a.hi <= hi)]
            block.accesses.append(_Access(lo, hi, stream, time, write, what))

    def allocated(self, t: torch.Tensor, stream: RecordedStream) -> None:
        with self._lock:
            self._blocks.pop(id(t.untyped_storage()), None)
            self._block(t, allocating=stream)

    def _freed(self, key: int) -> None:
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is None or block.stream is None:
                return
            # The allocator reuses the block once its stream -- and every stream
            # record_stream named, as they are now -- is past the block's accesses.
            guards = [block.stream, *block.recorded]
            for a in block.accesses:
                if all(g.clock.get(a.stream.index, 0) < a.time for g in guards if g is not a.stream) \
                        and a.stream not in guards:
                    self.violations.append(
                        f"a block allocated on {block.stream} was freed while {a.stream} may still touch it ({a.what}): "
                        "no record_stream, and the allocating stream never waited on that access")
                    return

    def check(self) -> None:
        """Raise :class:`OrderingViolation` listing what CUDA would not have ordered."""
        if self.violations:
            shown = "\n".join(self.violations[:10])
            raise OrderingViolation(f"{len(self.violations)} stream-order violation(s):\n{shown}")


_VIEWS = {"view", "_unsafe_view", "slice", "select", "as_strided", "expand", "transpose", "permute",
          "unsqueeze", "squeeze", "t", "alias", "reshape", "unbind", "split", "split_with_sizes", "chunk",
          "detach", "lift_fresh", "_reshape_alias", "view_as", "narrow", "unfold", "diagonal"}


class _ThreadMode(TorchDispatchMode):
    """Sees this thread's kernels: reads, writes and fresh allocations."""

    def __init__(self, streams: RecordingStreams) -> None:
        super().__init__()
        self.streams = streams

    def __enter__(self):
        self.streams._local.mode = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.streams._local.mode = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if not name.startswith("aten::") or func.__name__.split(".")[0] in _VIEWS:
            return out
        s = self.streams
        stream = s.current_stream()
        what = func.__name__
        written = set()
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if info is not None and info.is_write and isinstance(value, torch.Tensor):
                written.add(id(value))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        s.kernels += 1
        for t in inputs:
            s.access(t, stream, id(t) in written, what)
        bases = {t.untyped_storage().data_ptr() for t in inputs if t.device.type == "cpu"}
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and id(t) not in written
                    and t.untyped_storage().data_ptr() not in bases):
                s.allocated(t, stream)
                s.access(t, stream, True, what)
        return out


class _Work:
    def __init__(self, streams: RecordingStreams, work: Any, nccl: RecordedStream, clock: dict[int, int]) -> None:
        self.streams, self.work, self.nccl, self.clock = streams, work, nccl, clock

    def wait(self, timeout=None):
        with _disable_current_modes():              # the transport's own copies are the modelled transfer
            done = self.work.wait(timeout) if timeout is not None else self.work.wait()
        with self.streams._lock:                      # the waiting thread's stream is after the transfer
            self.streams.current_stream().after(self.clock)
        return done


class _RecordingTransport:
    """A transport whose transfers run on a modelled NCCL stream of their own."""

    def __init__(self, streams: RecordingStreams, p2p: Any) -> None:
        self.streams, self.p2p = streams, p2p
        self.nccl = streams._stream("nccl")

    def post(self, transfers: Sequence[Transfer]) -> list:
        s = self.streams
        with s._lock:
            self.nccl.after(s.current_stream().clock)    # NCCL's stream waits on the posting stream
            for t in transfers:
                s.access(t.tensor, self.nccl, not t.send, "a send" if t.send else "a receive")
            clock = dict(self.nccl.clock)
        with _disable_current_modes():
            works = self.p2p.post(transfers)
        return [_Work(s, w, self.nccl, clock) for w in works]
