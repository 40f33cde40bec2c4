"""The communicator interface the attention engine and the remap talk to.

Communication happens in *rounds*.  A round is collective over the world: every
rank calls :meth:`Communicator.start_round` the same number of times in the same
order with the same global list of :class:`Message` s (derived from the Plan,
which every rank holds), passing tensors only for the messages it sends or
receives.  That lets a routed implementation (routing layer) make ranks that
are neither sender nor receiver act as proxies for a round, while the direct
implementation simply posts point-to-point operations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch


@dataclass(frozen=True)
class Message:
    """One transfer of a round, known to every rank."""

    id: int
    """Unique within the round; used as the message tag."""
    src: int
    """Sending global rank."""
    dst: int
    """Receiving global rank."""
    numel: int
    """Elements sent (the receiver's buffer has the same count and dtype)."""
    itemsize: int = 0
    """Bytes per element; 0 means the communicator's default.  Proxies that
    forward a piece size their buffers from it (dK/dV travel in fp32 beside
    bf16 K/V in the same round)."""


@dataclass
class ByteCounters:
    """Bytes this rank actually put on each link class (exact, hardware-independent)."""

    intra_node: int = 0
    """Bytes sent to GPUs of the same node (NVLink)."""
    inter_node_per_nic: dict[int, int] = field(default_factory=dict)
    """Bytes sent to other nodes, by local NIC index."""

    def reset(self) -> None:
        self.intra_node = 0
        self.inter_node_per_nic.clear()


class Pending(Protocol):
    """A round in flight."""

    def wait(self) -> None:
        """Block until every receive of this rank has landed and sends are done."""


class Communicator(Protocol):
    """Round-based point-to-point transfers between global ranks."""

    counters: ByteCounters

    def start_round(self, messages: Sequence[Message], sends: Mapping[int, torch.Tensor],
                    recvs: Mapping[int, torch.Tensor], *, routed: bool = True) -> Pending:
        """Start a round; ``sends``/``recvs`` map message ids to this rank's
        contiguous tensors; ``routed=False`` sends every message direct (a plan
        whose ``Plan.routed`` is off).  Returns immediately; call ``wait()`` before reading
        any receive buffer or writing any send buffer."""
