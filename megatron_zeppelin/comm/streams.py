"""The one door through which the engine reaches CUDA streams and events.

The lanes (``comm/lanes.py``), the engine's bindings and the remap order their
work only through a :class:`StreamOps`: the caller's stream, new streams, events
(record, query, wait), ``record_stream`` and the thread a lane runs on.  Three
implementations share that interface, so one code path runs everywhere:

* :class:`CudaStreams`: ``torch.cuda`` itself (a GPU run);
* :class:`HostStreams`: CPU tensors, where every kernel has finished when its
  call returns (gloo runs): streams are names, events fire when recorded;
* ``comm/stream_check.py``'s ``RecordingStreams``: CPU tensors again, but every
  kernel, event and wait is recorded with vector clocks, and a read or a free
  that CUDA would not order is an error.  It runs the CUDA branch's decisions on
  gloo ranks, as CUDA's own sanitizer does on a GPU.

The protocol the lanes follow with it is written in ``docs/engine.md``
("Stream protocol").
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol

import torch


class StreamOps(Protocol):
    """Streams and events of one device, as the engine uses them."""

    device: torch.device

    def current_stream(self) -> Any:
        """The stream the calling thread enqueues on now (the caller's, for the engine)."""

    def new_stream(self) -> Any:
        """A stream of the engine's own (one per communication lane)."""

    def use(self, stream: Any) -> ContextManager:
        """Make ``stream`` the calling thread's current stream inside the block."""

    def lane_thread(self) -> ContextManager:
        """Entered once by every worker thread before it enqueues anything (CUDA:
        selects the device, which a new thread does not inherit)."""

    def new_event(self, timing: bool = False) -> Any:
        """An event, not yet recorded (``timing``: it can be timed, for ``--dump-trace``)."""

    def elapsed_ms(self, start: Any, end: Any) -> float | None:
        """Device milliseconds from ``start`` to ``end`` (timed events; waits for
        ``end``: only a trace dump calls it), or None where the host's clock is the
        device's (the CPU)."""

    def record(self, event: Any, stream: Any) -> None:
        """``event`` marks everything enqueued on ``stream`` so far."""

    def fired(self, event: Any) -> bool:
        """Whether the device has passed ``event`` (never blocks the host)."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work enqueued on ``stream`` from now on runs after ``event``."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is not reused before ``stream`` has passed its current end."""

    def transport(self, p2p: Any) -> Any:
        """The point-to-point transport the lanes use (a recording one wraps it)."""


class CudaStreams:
    """:class:`StreamOps` of one CUDA device: ``torch.cuda`` as it is."""

    def __init__(self, device: torch.device) -> None:
        # A device without an index (``torch.device("cuda")``) means the current one.
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def use(self, stream: torch.cuda.Stream) -> ContextManager:
        return torch.cuda.stream(stream)

    def lane_thread(self) -> ContextManager:
        return torch.cuda.device(self.device)

    def new_event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def fired(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def transport(self, p2p: Any) -> Any:
        return p2p


class _HostStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


class HostStreams:
    """:class:`StreamOps` of the CPU: kernels finish before their call returns,
    so ordering is the host's and every event has fired once it is recorded."""

    _CALLER = _HostStream("caller")

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device

    def current_stream(self) -> _HostStream:
        return self._CALLER

    def new_stream(self) -> _HostStream:
        return _HostStream("lane")

    def use(self, stream: Any) -> ContextManager:
        return contextlib.nullcontext()

    def lane_thread(self) -> ContextManager:
        return contextlib.nullcontext()

    def new_event(self, timing: bool = False) -> object:
        return object()

    def elapsed_ms(self, start: Any, end: Any) -> None:
        return None

    def record(self, event: Any, stream: Any) -> None:
        pass

    def fired(self, event: Any) -> bool:
        return True

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def transport(self, p2p: Any) -> Any:
        return p2p


def streams_for(device: torch.device) -> StreamOps:
    """The implementation a device runs on (CUDA, else the host's)."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams(device)
