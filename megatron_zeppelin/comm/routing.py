"""Routed communicator: cross-node messages spread over every NIC of the node.

Without routing, a message from a GPU on node A to a GPU on node B leaves
through the one NIC next to the sender; an inter-node ring therefore loads the
one or two NICs at its node boundary while the others idle.  Here such a
message is cut into ``P`` pieces (``P`` = NICs per node) and piece ``j``
travels in three hops::

    dispatch   src    -> proxy_j   intra-node (skipped when src is on NIC j)
    nic        proxy_j -> peer_j   through NIC j (peer_j: proxy_j's local index on dst's node)
    combine    peer_j -> dst       intra-node (skipped when peer_j is dst)

Messages inside a node, and messages too small for the two extra hops to pay
(:func:`min_routed_bytes`, from the cost model), go direct.  Every rank holds
the round's global message list (``comm/base.py``), so every rank derives the
same hop list with :func:`route_plan` and knows which pieces it must forward.

Rounds run on one background worker thread per communicator (FIFO), so
``start_round`` returns at once and the caller's compute overlaps the
transfers; proxies forward pieces without involving their caller at all.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.base import ByteCounters, Message
from megatron_zeppelin.comm.deadline import DEFAULT_TIMEOUT_S, CommTimeoutError, Deadline
from megatron_zeppelin.cost.model import CostModel
from megatron_zeppelin.plan.shards import chunk_bounds
from megatron_zeppelin.topology import Topology


class Phase(IntEnum):
    """Which leg of its route a hop is."""

    DIRECT = 0
    DISPATCH = 1
    NIC = 2
    COMBINE = 3


@dataclass(frozen=True)
class Hop:
    """One point-to-point transfer of a round (a whole direct message or one leg of a piece)."""

    msg: int
    """Message id."""
    piece: int
    """Piece index (0 for direct messages)."""
    phase: Phase
    """Leg of the route."""
    src: int
    """Sending rank."""
    dst: int
    """Receiving rank."""
    offset: int
    """First element of the message this hop carries."""
    numel: int
    """Elements carried."""
    nic: int | None
    """Sender's local NIC index when the hop leaves the node; None inside a node."""
    itemsize: int
    """Bytes per element of the message."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def min_routed_bytes(cost: CostModel) -> float:
    """Smallest message for which routing beats a direct NIC send under ``cost``.

    Routing adds two intra-node hops of latency and raises the bandwidth from
    one NIC to all of them (capped by the sender's NVLink dispatch); it pays
    once the bytes saved outweigh the latency: ``b * (1/B_direct - 1/B_routed)
    > lat_routed - lat_direct``.  ``inf`` when routing never pays (one NIC)."""
    gpn = cost.cluster.topology.gpus_per_node
    pair = [0, gpn]  # any two ranks on different nodes
    direct, routed = cost.routed(False).link_for(pair), cost.routed(True).link_for(pair)
    gain = 1 / (direct.bandwidth_GBps * 1e9) - 1 / (routed.bandwidth_GBps * 1e9)
    if gain <= 0:
        return math.inf
    return max(routed.latency_us - direct.latency_us, 0.0) * 1e-6 / gain


def route_plan(messages: Sequence[Message], topology: Topology, min_routed_bytes: float, *,
               itemsize: int) -> list[Hop]:
    """Every hop of a round, as every rank derives it (a pure function).

    ``itemsize`` (bytes per element) applies to messages that do not carry
    their own (``Message.itemsize == 0``).  Pieces
    are cut on element boundaries with :func:`chunk_bounds`; empty pieces and
    empty messages produce no hop."""
    P = topology.nics_per_node
    hops: list[Hop] = []
    for m in messages:
        if m.numel == 0:
            continue
        isz = m.itemsize or itemsize
        cross = not topology.same_node(m.src, m.dst)
        if not cross or P == 1 or m.numel * isz < min_routed_bytes:
            hops.append(Hop(m.id, 0, Phase.DIRECT, m.src, m.dst, 0, m.numel,
                            topology.nic_of(m.src) if cross else None, isz))
            continue
        bounds = chunk_bounds(m.numel, P)
        for j in range(P):
            lo, n = bounds[j], bounds[j + 1] - bounds[j]
            if n == 0:
                continue
            proxy = _proxy(topology, m, j)
            peer = topology.rank_of(topology.node_of(m.dst), topology.local_of(proxy))
            if proxy != m.src:
                hops.append(Hop(m.id, j, Phase.DISPATCH, m.src, proxy, lo, n, None, isz))
            hops.append(Hop(m.id, j, Phase.NIC, proxy, peer, lo, n, j, isz))
            if peer != m.dst:
                hops.append(Hop(m.id, j, Phase.COMBINE, peer, m.dst, lo, n, None, isz))
    return hops


def _proxy(topology: Topology, m: Message, nic: int) -> int:
    """The GPU of the sender's node that pushes piece ``nic`` through NIC ``nic``.

    The sender itself when it sits on that NIC (no dispatch hop); else the GPU
    whose twin on the destination node is the receiver (no combine hop); else
    one of the NIC's GPUs, rotated by message id so that concurrent messages
    share the proxies' NVLink ports."""
    node = topology.node_of(m.src)
    on_nic = [r for r in topology.node_ranks(node) if topology.nic_of(r) == nic]
    twin = topology.rank_of(node, topology.local_of(m.dst))
    for preferred in (m.src, twin):
        if preferred in on_nic:
            return preferred
    return on_nic[m.id % len(on_nic)]


def hop_bytes(hops: Sequence[Hop], rank: int) -> ByteCounters:
    """Bytes ``rank`` puts on each link class for ``hops`` (what the communicator
    counts; the simulator and tests use it as the prediction)."""
    out = ByteCounters()
    for h in hops:
        if h.src != rank or h.src == h.dst:
            continue
        if h.nic is None:
            out.intra_node += h.nbytes
        else:
            out.inter_node_per_nic[h.nic] = out.inter_node_per_nic.get(h.nic, 0) + h.nbytes
    return out


class RoutedCommError(CommTimeoutError):
    """A routed transfer did not complete (a peer died, or ranks disagree on a round)."""


class _RoutedPending:
    """A round in flight on the worker thread."""

    def __init__(self, future: Future, counters: ByteCounters, deadline: Deadline, what: str) -> None:
        self._future, self._counters = future, counters
        self._deadline, self._what = deadline, what
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        # Re-raises the worker's RoutedCommError; bounded if the worker itself is stuck.
        done_event, sent = self._deadline.result(self._future, lambda: self._what)
        if done_event is not None:
            # NCCL: the worker's stream saw the receives land; order the caller's after it.
            torch.cuda.current_stream().wait_event(done_event)
        # Counted in the caller's thread once the bytes are sent, so that counters
        # shared with another communicator are never updated from two threads.
        self._counters.intra_node += sent.intra_node
        for nic, n in sent.inter_node_per_nic.items():
            self._counters.inter_node_per_nic[nic] = self._counters.inter_node_per_nic.get(nic, 0) + n
        self._done = True


class RoutedCommunicator:
    """:class:`~megatron_zeppelin.comm.base.Communicator` spreading cross-node
    messages over all NICs of the node through proxy GPUs.

    Ranks in messages are ranks of ``group``.  On NCCL give it a group of its
    own (``dist.new_group``): its worker thread issues NCCL calls, and one NCCL
    communicator must not be driven from two threads at once."""

    def __init__(self, group: dist.ProcessGroup | None, topology: Topology,
                 counters: ByteCounters | None = None, min_routed_bytes: float = 0.0, *,
                 dtype: torch.dtype | None = None, device: torch.device | None = None,
                 timeout: timedelta | None = None) -> None:
        """``min_routed_bytes``: pass :func:`min_routed_bytes` of the run's cost
        model (``math.inf`` turns routing off).  ``dtype``: element type of every
        routed message; a proxy with no tensor of its own in a round allocates its
        forwarding buffers from it.  ``timeout``: how long a hop (and the caller's
        wait on the worker) may block on gloo before the round fails (default
        ``DEFAULT_TIMEOUT_S``); on NCCL the group's timeout and watchdog apply.
        Collective on NCCL."""
        self.group = group or dist.group.WORLD
        self.topology = topology
        self.counters = counters if counters is not None else ByteCounters()
        self.min_routed_bytes = min_routed_bytes
        self.itemsize = torch.empty((), dtype=dtype or torch.get_default_dtype()).element_size()
        self.rank = dist.get_rank(self.group)
        topology.check_world_size(dist.get_world_size(self.group))
        self._global = [dist.get_global_rank(self.group, r) for r in range(topology.world_size)]
        nccl = dist.get_backend(self.group) == "nccl"
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        if nccl:
            # batch_isend_irecv's first call on a group must involve every rank of it;
            # a barrier here (every rank builds the communicator) creates the NCCL comm.
            dist.barrier(group=self.group)
        self.device = device
        # NCCL: the group's timeout and watchdog bound a transfer (see Deadline.seconds).
        self.deadline = Deadline(None if nccl else timeout.total_seconds() if timeout else DEFAULT_TIMEOUT_S)
        """How long any wait on a peer may block (worker hops and the caller's wait)."""
        self._rounds = 0
        # The worker posts the NCCL calls and records events: it must be on our GPU.
        init = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeppelin-routing",
                                          initializer=init[0], initargs=init[1])

    def start_round(self, messages: Sequence[Message], sends: Mapping[int, torch.Tensor],
                    recvs: Mapping[int, torch.Tensor]) -> _RoutedPending:
        hops = route_plan(messages, self.topology, self.min_routed_bytes, itemsize=self.itemsize)
        self._check_tensors(messages, hops, sends, recvs)
        ready = None
        if any(t.is_cuda for t in (*sends.values(), *recvs.values())):
            # The caller's stream produced the send data; the worker must not read it earlier.
            ready = torch.cuda.Event()
            ready.record()
        round_no, self._rounds = self._rounds, self._rounds + 1
        future = self._worker.submit(self._run_round, round_no, list(messages), hops, dict(sends),
                                     dict(recvs), ready)
        return _RoutedPending(future, self.counters, self.deadline,
                              f"rank {self.rank}: routed round {round_no}")

    def close(self) -> None:
        """Finish queued rounds and stop the worker thread."""
        self._worker.shutdown(wait=True)

    # ---------------------------------------------------------------- worker
    def _tag(self, hop: Hop, round_no: int) -> int:
        # Unique per (message, piece, leg) within a round; the round's parity
        # keeps a fast rank's next round apart from a slow rank's current one.
        return ((hop.msg * self.topology.nics_per_node + hop.piece) * 4 + hop.phase) * 2 + round_no % 2

    def _run_round(self, round_no: int, messages: list[Message], hops: list[Hop],
                   sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor],
                   ready: torch.cuda.Event | None) -> tuple[torch.cuda.Event | None, ByteCounters]:
        """Post the round stage by stage: stage ``s`` holds the ``s``-th leg of every
        piece's chain, so its sends only need data received in stage ``s-1``.
        Every stage is one self-contained batch (each send's receive is in the same
        stage on the peer), which is what NCCL needs: a batch waiting on a later
        batch of a peer would deadlock its stream."""
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        me = self.rank
        ends = {m.id: (m.src, m.dst) for m in messages}

        def view(t: torch.Tensor, h: Hop) -> torch.Tensor:
            # Byte view of the hop's slice of a user buffer (shares memory: no combine copy).
            return t.reshape(-1).view(torch.uint8)[h.offset * h.itemsize:(h.offset + h.numel) * h.itemsize]

        sent = ByteCounters()  # what this rank's sends actually carry
        in_transit: dict[tuple[int, int], torch.Tensor] = {}  # pieces this rank forwards next stage
        for stage in _stages(hops):
            ops, mine = [], []
            for h in stage:
                src, dst = ends[h.msg]
                if h.src == me == h.dst:  # a message to oneself never touches a link
                    view(recvs[h.msg], h).copy_(view(sends[h.msg], h))
                elif h.src == me:
                    buf = view(sends[h.msg], h) if me == src else in_transit.pop((h.msg, h.piece))
                    self._count(sent, h, buf.numel())
                    ops.append(dist.P2POp(dist.isend, buf, self._global[h.dst], self.group,
                                          self._tag(h, round_no)))
                    mine.append(h)
                elif h.dst == me:
                    if me == dst:
                        buf = view(recvs[h.msg], h)
                    else:  # a proxy or peer keeps the piece until the next stage
                        buf = in_transit[(h.msg, h.piece)] = torch.empty(
                            h.nbytes, dtype=torch.uint8, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buf, self._global[h.src], self.group,
                                          self._tag(h, round_no)))
                    mine.append(h)
            if ops:
                self._wait(dist.batch_isend_irecv(ops), mine, round_no)
        done = None
        if ready is not None:
            done = torch.cuda.Event()
            done.record()
        return done, sent

    @staticmethod
    def _count(sent: ByteCounters, h: Hop, nbytes: int) -> None:
        if h.nic is None:
            sent.intra_node += nbytes
        else:
            sent.inter_node_per_nic[h.nic] = sent.inter_node_per_nic.get(h.nic, 0) + nbytes

    def _wait(self, works: list, mine: list[Hop], round_no: int) -> None:
        # gloo returns one work per op (in op order), NCCL one for the whole batch.
        for i, work in enumerate(works):
            hops = [mine[i]] if len(works) == len(mine) else mine
            try:
                self.deadline.wait(work, lambda: f"routed round {round_no}: rank {self.rank} could not " + "; ".join(
                    f"{'receive from' if h.dst == self.rank else 'send to'} rank "
                    f"{h.src if h.dst == self.rank else h.dst} ({h.phase.name.lower()} leg of piece "
                    f"{h.piece} of message {h.msg})" for h in hops[:4]))
            except CommTimeoutError as exc:
                raise RoutedCommError(str(exc)) from None

    def _check_tensors(self, messages: Sequence[Message], hops: list[Hop],
                       sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        routed = {h.msg for h in hops if h.phase is not Phase.DIRECT}
        for m in messages:
            for side, table, owner in (("send", sends, m.src), ("receive", recvs, m.dst)):
                if owner != self.rank or m.numel == 0:
                    continue
                t = table.get(m.id)
                if t is None or t.numel() != m.numel or not t.is_contiguous():
                    raise ValueError(f"rank {self.rank}: message {m.id} needs a contiguous {side} tensor "
                                     f"of {m.numel} elements, got "
                                     f"{None if t is None else (tuple(t.shape), t.is_contiguous())}")
                isz = m.itemsize or self.itemsize
                if m.id in routed and t.element_size() != isz:
                    raise TypeError(f"rank {self.rank}: message {m.id} is routed through proxies that "
                                    f"allocate {isz}-byte elements, but its {side} tensor is "
                                    f"{t.dtype}; set Message.itemsize or build the RoutedCommunicator "
                                    f"with dtype={t.dtype}")


def _stages(hops: Sequence[Hop]) -> list[list[Hop]]:
    """Hops grouped by their position in their piece's chain (route_plan lists
    each chain in order), each group in route_plan order."""
    stages: list[list[Hop]] = []
    seen: dict[tuple[int, int], int] = {}
    for h in hops:
        k = seen.get((h.msg, h.piece), 0)
        seen[(h.msg, h.piece)] = k + 1
        if k == len(stages):
            stages.append([])
        stages[k].append(h)
    return stages
