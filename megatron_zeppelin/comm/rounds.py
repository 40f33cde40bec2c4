"""``Communicator.start_round`` on top of the lane runner.

A round's messages become a transfer-only schedule -- the same construction a
layout switch has in the step schedule (``schedule/step.py``), so the remap's
executed ops carry the ids the simulator gives them.  Both communicators are
this class: the direct one never routes, the routed one routes every
cross-node message of at least ``min_routed_bytes``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.base import ByteCounters, Message
from megatron_zeppelin.comm.collectives import warm_up_nccl
from megatron_zeppelin.comm.lanes import LaneRunner, StepRecorder, _Call
from megatron_zeppelin.comm.p2p import TorchP2P
from megatron_zeppelin.comm.streams import StreamOps
from megatron_zeppelin.schedule.attention import Transport, add_transfer, reaches
from megatron_zeppelin.schedule.ops import Op, Schedule, ScheduleBuilder
from megatron_zeppelin.topology import Topology


class RoundPending:
    """A round in flight on this rank."""

    def __init__(self, call: _Call | None) -> None:
        self._call = call

    def wait(self) -> None:
        if self._call is not None:
            call, self._call = self._call, None
            call.wait()


class _RoundBinding:
    def __init__(self, ids: dict[int, int], sends: Mapping[int, torch.Tensor],
                 recvs: Mapping[int, torch.Tensor]) -> None:
        self.ids, self.sends, self.recvs = ids, sends, recvs

    def compute(self, op: Op) -> None:          # rounds hold transfers only
        raise AssertionError(f"a round has no compute op, got {op.name}")

    def send_tensor(self, message: int) -> torch.Tensor:
        return self.sends[self.ids[message]]

    def recv_buffer(self, message: int) -> torch.Tensor:
        return self.recvs[self.ids[message]]


class LaneCommunicator:
    """:class:`~megatron_zeppelin.comm.base.Communicator` executing schedules on
    worker threads (gloo) or a stream of its own (NCCL)."""

    def __init__(self, group: dist.ProcessGroup | None, topology: Topology,
                 counters: ByteCounters | None = None, min_routed_bytes: float = math.inf, *,
                 dtype: torch.dtype | None = None, device: torch.device | None = None,
                 timeout: timedelta | None = None, streams: StreamOps | None = None,
                 inter_group: dist.ProcessGroup | None = None) -> None:
        """``min_routed_bytes``: messages crossing nodes at least this large are
        routed over every NIC (inf: never).  ``dtype``: element type of messages
        that do not carry their own itemsize (a proxy sizes its buffers from it).
        ``timeout``: the deadline of every wait (default ``lanes.DEFAULT_TIMEOUT``).
        ``streams``: how the lanes reach streams (default: the device's own).
        ``inter_group``: a second group over the same ranks for the inter-node lane
        (NCCL: its own communicator and stream, ``comm/groups.py``); None: ``group``."""
        rank = dist.get_rank(group)
        topology.check_world_size(dist.get_world_size(group))
        nccl = dist.get_backend(group) == "nccl"
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        warm_up_nccl(group)  # collective: every rank builds the communicator
        lane_p2p = None
        if inter_group is not None:
            warm_up_nccl(inter_group)
            lane_p2p = {"inter": TorchP2P(inter_group)}
        counters = counters if counters is not None else ByteCounters()
        self._bind(group, rank, topology, counters, min_routed_bytes, dtype, device,
                   LaneRunner(group, rank, counters, device=device, timeout=timeout, streams=streams,
                              lane_p2p=lane_p2p))

    def _bind(self, group: dist.ProcessGroup | None, rank: int, topology: Topology, counters: ByteCounters,
              min_routed_bytes: float, dtype: torch.dtype | None, device: torch.device,
              runner: LaneRunner) -> None:
        """Every field of a communicator, given its rank and lane runner (a process
        group's, or a stand-in's that has no group: ``benchmarks/loopback.py``)."""
        self.group, self.rank, self.device = group, rank, device
        self.topology = topology
        self.counters = counters
        self.min_routed_bytes = min_routed_bytes
        self.itemsize = torch.empty((), dtype=dtype or torch.get_default_dtype()).element_size()
        self.transport = Transport(topology, min_routed_bytes)
        self.runner = runner
        self._rounds: OrderedDict[tuple, tuple[Schedule, dict[int, int]]] = OrderedDict()
        """Round schedules by their messages: every layer of a step switches with the
        same ones, and rebuilding a routed round costs milliseconds at 64 ranks."""
        self._prepared: OrderedDict[tuple[int, bool], _PreparedRound] = OrderedDict()
        """Prepared rounds by (id of the messages tuple, routed): see ``start_round``."""
        self.recorder: StepRecorder | None = None
        """When set, every call's executed op times are recorded here (``--dump-trace``)."""

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The communication stream on CUDA (None on CPU)."""
        return self.runner.stream

    def transport_for(self, routed: bool) -> Transport:
        """The transport of a plan whose ``routed`` flag is given: this
        communicator's, or direct for every message (``Plan.routed``)."""
        return self.transport if routed else self.transport.direct()

    def start_round(self, messages: Sequence[Message], sends: Mapping[int, torch.Tensor],
                    recvs: Mapping[int, torch.Tensor], *, routed: bool = True) -> RoundPending:
        """Start a round (collective: every rank passes the same messages and
        ``routed``, the step plan's ``Plan.routed``); returns at once.  A tuple of
        messages passed again (the remap keeps one per direction and row size for
        the step) reuses its prepared round: work of this rank's own messages only."""
        prepared = self._prepared_round(messages, sends, recvs, routed)
        for mid in prepared.self_copies:
            recvs[mid].copy_(sends[mid])
        _check(prepared.own, sends, recvs, self.rank)
        # Started on every rank, with lanes or without: calls are numbered
        # collectively (their tags must agree).
        return RoundPending(self.runner.start(prepared.schedule, _RoundBinding(prepared.ids, sends, recvs),
                                              self.recorder))

    def _prepared_round(self, messages: Sequence[Message], sends: Mapping[int, torch.Tensor],
                        recvs: Mapping[int, torch.Tensor], routed: bool) -> "_PreparedRound":
        transport = self.transport_for(routed)
        # By identity: hashing the sizes of every rank's messages costs O(world)
        # per call.  Only tuples (immutable; the entry holds the tuple, so its id
        # is not reused while cached), and only while this rank's tensors give the
        # itemsizes they gave when it was built.
        key = (id(messages), routed)
        hit = self._prepared.get(key)
        if hit is not None and all(self._local_itemsize(m, sends, recvs, transport) == itemsize
                                   for m, itemsize in hit.tensor_sized):
            self._prepared.move_to_end(key)
            return hit
        sizes = tuple((m.id, m.src, m.dst, m.numel, m.itemsize or self._local_itemsize(m, sends, recvs, transport))
                      for m in messages)
        round_key = (routed, sizes)
        if round_key not in self._rounds:
            self._rounds[round_key] = _round_schedule(sizes, transport, self.topology.world_size, self.rank)
            if len(self._rounds) > ROUND_SCHEDULES_KEPT:
                self._rounds.popitem(last=False)
        schedule, ids = self._rounds[round_key]
        own = tuple(m for m in messages if self.rank in (m.src, m.dst))
        prepared = _PreparedRound(messages, schedule, ids, tuple(m.id for m in own if m.src == m.dst), own,
                                  tuple((m, size[4]) for m, size in zip(messages, sizes)
                                        if not m.itemsize and self.rank in (m.src, m.dst)))
        if isinstance(messages, tuple):
            self._prepared[key] = prepared
            if len(self._prepared) > ROUND_SCHEDULES_KEPT:
                self._prepared.popitem(last=False)
        return prepared

    def _local_itemsize(self, m: Message, sends, recvs, transport: Transport) -> int:
        # Direct transfers have no proxy to size: the tensor's own element size
        # serves.  A routed message needs the same itemsize on every rank.
        if transport.min_routed_bytes == math.inf:
            t = sends.get(m.id) if m.src == self.rank else recvs.get(m.id) if m.dst == self.rank else None
            if t is not None:
                return t.element_size()
        return self.itemsize

    def close(self) -> None:
        """Stop the worker threads."""
        self.runner.close()


#: Round schedules (and prepared rounds) a communicator keeps (a step's switches use a handful).
ROUND_SCHEDULES_KEPT = 16


@dataclass(frozen=True)
class _PreparedRound:
    """What ``start_round`` derives from a round's messages on this rank."""

    messages: Sequence[Message]
    """The messages it was built from (held: the cache key is their id)."""
    schedule: Schedule
    """This rank's projection of the round's transfer schedule."""
    ids: dict[int, int]
    """Schedule message id -> round message id."""
    self_copies: tuple[int, ...]
    """Ids of the messages this rank sends to itself, in message order."""
    own: tuple[Message, ...]
    """The messages this rank sends or receives (the tensors it must pass), in message order."""
    tensor_sized: tuple[tuple[Message, int], ...]
    """This rank's messages without an itemsize, and the itemsize they were given
    (direct: their tensor's element size)."""


def _round_schedule(sizes: tuple, transport: Transport, world_size: int,
                    rank: int | None = None) -> tuple[Schedule, dict[int, int]]:
    """A round's messages ``(id, src, dst, numel, itemsize)`` as a transfer-only
    schedule, and schedule message id -> round message id.  ``rank``: the
    schedule's projection onto ``rank`` (``Schedule.projection``), built from
    the messages that reach it only (its own, and routed ones it may relay): a
    message's hops wait only for each other, so each keeps its wave."""
    b = ScheduleBuilder(world_size)
    for index, (mid_, src, dst, numel, itemsize) in enumerate(sizes):
        if src == dst:
            continue
        if rank is not None and not reaches((src, dst), rank, transport):
            b.skip_messages(1)
            continue
        add_transfer(b, (index,), transport, ("round", mid_), src, dst, numel, itemsize, [],
                     tier="remap", name="remap", backward=False, route_id=mid_)
    built = b.build()
    schedule = built if rank is None else built.projection(rank)
    return schedule, {mid: binding[1] for mid, binding in schedule.messages.items()}


def _check(messages: Sequence[Message], sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor],
           rank: int) -> None:
    for m in messages:
        for side, table, owner in (("send", sends, m.src), ("receive", recvs, m.dst)):
            if owner != rank:
                continue
            t = table.get(m.id)
            if t is None:
                raise ValueError(f"message {m.id} ({m.src} -> {m.dst}) has no {side} tensor on this rank")
            if t.numel() != m.numel or not t.is_contiguous():
                raise ValueError(f"message {m.id} ({m.src} -> {m.dst}) declares {m.numel} elements, the "
                                 f"{side} tensor has {t.numel()} (contiguous: {t.is_contiguous()})")
