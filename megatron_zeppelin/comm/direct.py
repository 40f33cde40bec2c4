"""Direct communicator: every message of a round is one point-to-point transfer.

All sends and receives of this rank in a round are posted at once with
``torch.distributed.batch_isend_irecv`` (tag = message id; on NCCL, where tags
are ignored, both ends post a pair's messages in id order, which keeps them
matched), and ``wait()`` waits on all of them.  Works on gloo and NCCL.
Bytes are counted per link class when a round starts, from the tensors actually
sent: intra-node, or inter-node on the NIC of the *sender's* GPU
(``Topology.nic_of``) -- a direct transfer leaves through the sender's own NIC.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.base import ByteCounters, Message
from megatron_zeppelin.comm.deadline import DEFAULT_TIMEOUT_S, CommTimeoutError, Deadline
from megatron_zeppelin.topology import Topology

__all__ = ["CommTimeoutError", "DirectCommunicator", "DirectPending"]


class DirectPending:
    """A round in flight on this rank."""

    def __init__(self, works: list, round_index: int, rank: int, waiting_on: list[Message],
                 deadline: Deadline) -> None:
        self._works = works
        self._round = round_index
        self._rank = rank
        self._waiting_on = waiting_on
        self._deadline = deadline

    def wait(self) -> None:
        for work in self._works:
            self._deadline.wait(work, lambda: (
                f"rank {self._rank}: round {self._round}, receiving from ranks "
                f"{sorted({m.src for m in self._waiting_on})} (every rank must call start_round with the "
                "same message lists in the same order),"))
        self._works = []


class DirectCommunicator:
    """Round-based point-to-point transfers with ``torch.distributed``."""

    def __init__(self, group: dist.ProcessGroup | None, topology: Topology,
                 counters: ByteCounters | None = None, deadline: Deadline | None = None) -> None:
        self.group = group
        """Process group whose global ranks the messages name (None: the default group)."""
        self.topology = topology
        """Which ranks share a node and which NIC each GPU sends through."""
        self.counters = counters if counters is not None else ByteCounters()
        """Bytes this rank sent, by link class."""
        self.rank = dist.get_rank()
        # NCCL: the group's timeout and watchdog bound a transfer (see Deadline.seconds).
        nccl = dist.get_backend(group) == "nccl"
        self.deadline = Deadline(None) if nccl else deadline or Deadline(DEFAULT_TIMEOUT_S)
        """How long a round's wait may block on a peer."""
        topology.check_world_size(dist.get_world_size(group))
        self._rounds = 0

    def start_round(self, messages: Sequence[Message], sends: Mapping[int, torch.Tensor],
                    recvs: Mapping[int, torch.Tensor]) -> DirectPending:
        """Post this rank's sends and receives of the round; returns at once."""
        ops, waiting_on = [], []
        for m in sorted(messages, key=lambda m: m.id):
            if m.src == self.rank:
                tensor = _checked(m, sends, "send")
                if m.dst == self.rank:
                    _checked(m, recvs, "receive").copy_(tensor)
                    continue
                ops.append(dist.P2POp(dist.isend, tensor, m.dst, self.group, m.id))
                self._count(m.dst, tensor.numel() * tensor.element_size())
            elif m.dst == self.rank:
                ops.append(dist.P2POp(dist.irecv, _checked(m, recvs, "receive"), m.src, self.group, m.id))
                waiting_on.append(m)
        works = dist.batch_isend_irecv(ops) if ops else []
        self._rounds += 1
        return DirectPending(works, self._rounds - 1, self.rank, waiting_on, self.deadline)

    def _count(self, dst: int, nbytes: int) -> None:
        if self.topology.same_node(self.rank, dst):
            self.counters.intra_node += nbytes
        else:
            nic = self.topology.nic_of(self.rank)
            self.counters.inter_node_per_nic[nic] = self.counters.inter_node_per_nic.get(nic, 0) + nbytes


def _checked(m: Message, tensors: Mapping[int, torch.Tensor], what: str) -> torch.Tensor:
    tensor = tensors.get(m.id)
    if tensor is None:
        raise ValueError(f"message {m.id} ({m.src} -> {m.dst}) has no {what} tensor on this rank")
    if tensor.numel() != m.numel or not tensor.is_contiguous():
        raise ValueError(f"message {m.id} ({m.src} -> {m.dst}) declares {m.numel} elements, the {what} "
                         f"tensor has {tensor.numel()} (contiguous: {tensor.is_contiguous()})")
    return tensor
