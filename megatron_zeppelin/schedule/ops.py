"""Ops, lanes and the schedule container.

An :class:`Op` is either a *compute* op (runs on its rank's compute lane) or a
*comm* op: one point-to-point transfer ``rank -> peer`` (a whole message, or one
leg of a routed piece).  A transfer sits on the communication lane of both its
ends: the sender posts it once its data dependencies are done, the receiver has
its buffer posted in advance.

Ops are stored in one global order that is a topological order of the
dependencies.  Two rules run it, in the engine and in the simulator alike:

* a communication lane posts its sends strictly in that order, each once its
  data is there (receives are posted ahead);
* a compute lane, whenever it is free, runs the *first op in its order whose
  dependencies are done* -- so local sequences, which depend on nothing inside
  a layer, fill every gap in which ring or Ulysses work waits for a transfer.

That makes any schedule deadlock-free on any transport: the first unfinished op
of the global order has all its dependencies done, heads every send lane it is
on and is ready on its compute lane, so it always runs -- also on NCCL, where a
pair's transfers must be posted in the same order on both ends, and a stream
runs its kernels in posting order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from megatron_zeppelin.errors import ZeppelinError

COMPUTE = "compute"
"""Kind of an op that runs kernels on its rank's compute lane."""
COMM = "comm"
"""Kind of an op that moves bytes from ``rank`` to ``peer``."""
#: Tiers an op can belong to (the trace's ``args.tier``).
TIERS = ("local", "intra", "inter", "ulysses", "remap", "linear")


class ScheduleError(ZeppelinError):
    """A schedule (built, or read from a trace) whose dependencies cannot be satisfied."""


@dataclass(frozen=True)
class Op:
    """One unit of work of a schedule, known to every rank."""

    id: int
    """Position in the schedule's global order (dependencies point to smaller ids)."""
    kind: str
    """:data:`COMPUTE` or :data:`COMM`."""
    tier: str
    """One of :data:`TIERS`."""
    name: str
    """What it is, e.g. ``ring_fwd``, ``kv``, ``dkv``, ``a2a_in``, ``local_bwd``, ``remap``."""
    rank: int
    """Compute: the rank running it.  Comm: the sending rank."""
    peer: int = -1
    """Comm: the receiving rank."""
    deps: tuple[int, ...] = ()
    """Ops that must be done before this one starts."""
    pairs: int = 0
    """Compute (attention): causal (query, key) pairs per head."""
    block: int = 0
    """Compute (attention): query rows per kernel call (sets the kernel efficiency)."""
    tokens: int = 0
    """Compute (linear): tokens the projections and MLP process."""
    nbytes: int = 0
    """Comm: bytes carried (elements times the itemsize they travel in)."""
    nic: int | None = None
    """Comm leaving the node: local index of the sender's NIC; None inside a node."""
    backward: bool = False
    """Part of the backward pass."""
    lengths: tuple[int, ...] = ()
    """Compute (local): lengths of the whole sequences packed into its one kernel call."""
    key: tuple = ()
    """What the engine binds the op to (job, position, step, message, piece, leg ...)."""

    @property
    def is_comm(self) -> bool:
        return self.kind == COMM

    def on(self, rank: int) -> bool:
        """Whether the op is on one of ``rank``'s lanes."""
        return self.rank == rank or (self.kind == COMM and self.peer == rank)


def lane_of(op: Op) -> str:
    """The lane a transfer travels on: ``inter`` through a NIC, else ``intra``."""
    return "intra" if op.nic is None else "inter"


@dataclass(frozen=True)
class RankOps:
    """One rank's lanes."""

    compute: tuple[Op, ...]
    """Compute ops in lane order (flexible ones included, in their global order)."""
    comm: tuple[Op, ...]
    """Transfers this rank sends or receives, in lane order."""


@dataclass
class Schedule:
    """Ops of every rank in one global topological order."""

    world_size: int
    """Ranks the schedule spans."""
    ops: tuple[Op, ...]
    """``ops[i].id == i``."""
    messages: dict[int, tuple] = field(default_factory=dict)
    """Message id -> what the engine binds it to (e.g. ``("kv", job, step, src_pos)``);
    a transfer op's ``key`` starts with its message id."""
    _lanes: dict[int, RankOps] = field(default_factory=dict, repr=False, compare=False)
    _waves: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _batches: dict[int, dict[str, list[list[Op]]]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate(self.ops, self.world_size)

    def lanes(self, rank: int) -> RankOps:
        """``rank``'s compute and communication lanes (computed once per rank)."""
        if not self._lanes:      # every rank's in one pass over the ops (not one pass per rank)
            compute: list[list[Op]] = [[] for _ in range(self.world_size)]
            comm: list[list[Op]] = [[] for _ in range(self.world_size)]
            for op in self.ops:
                if op.kind == COMM:
                    comm[op.rank].append(op)
                    if op.peer != op.rank:
                        comm[op.peer].append(op)
                else:
                    compute[op.rank].append(op)
            for r in range(self.world_size):
                self._lanes[r] = RankOps(tuple(compute[r]), tuple(comm[r]))
        return self._lanes[rank]

    def wave(self, op_id: int) -> int:
        """The transfer wave of a comm op: 0 when no transfer precedes it, else one
        more than the latest transfer it depends on (through compute ops too).
        Transfers of one wave never depend on each other, so a lane posts each
        wave as one batch, and every rank sees the same waves."""
        if not self._waves:
            level: list[int] = []
            for op in self.ops:
                before = max((level[d] for d in op.deps), default=-1)
                level.append(before + 1 if op.kind == COMM else before)
            self._waves = tuple(level)
        return self._waves[op_id]

    def wave_batches(self, rank: int) -> dict[str, list[list[Op]]]:
        """``rank``'s transfers by lane (:func:`lane_of`), each lane's as its waves in
        order, each wave in lane order: what the engine posts a batch at a time
        (computed once per rank: every layer of a step runs the same schedule)."""
        if rank not in self._batches:
            by_lane: dict[str, dict[int, list[Op]]] = {}
            for op in self.lanes(rank).comm:
                by_lane.setdefault(lane_of(op), {}).setdefault(self.wave(op.id), []).append(op)
            self._batches[rank] = {lane: [waves[w] for w in sorted(waves)] for lane, waves in by_lane.items()}
        return self._batches[rank]

    def shifted(self, offset: int) -> tuple[Op, ...]:
        """The ops renumbered by ``offset`` (to concatenate schedules)."""
        return tuple(replace(op, id=op.id + offset, deps=tuple(d + offset for d in op.deps))
                     for op in self.ops)


def validate(ops: Sequence[Op], world_size: int) -> None:
    """Ids are positions and every dependency points to an earlier op; else a
    :class:`ScheduleError` naming the op ids (a cycle, or a transfer whose data
    never arrives, would otherwise hang the engine)."""
    for i, op in enumerate(ops):
        if op.id != i:
            raise ScheduleError(f"schedule: op at position {i} has id {op.id}; ids must be 0..n-1 in order")
        late = [d for d in op.deps if not 0 <= d < i]
        if late:
            raise ScheduleError(f"schedule: op {i} ({op.name} on rank {op.rank}) depends on op(s) {late}, "
                                "which are not earlier in the schedule: a dependency cycle or a missing op")
        ends = (op.rank, op.peer) if op.kind == COMM else (op.rank,)
        if any(not 0 <= r < world_size for r in ends):
            raise ScheduleError(f"schedule: op {i} ({op.name}) names rank(s) {ends} outside 0..{world_size - 1}")
        if op.kind == COMM and op.rank == op.peer:
            raise ScheduleError(f"schedule: op {i} ({op.name}) sends from rank {op.rank} to itself")


class ScheduleBuilder:
    """Collects ops with sort keys and dependencies by handle, then orders them.

    ``add`` returns a handle; ``build`` sorts by ``(order, insertion)`` and turns
    handles into ids.  Sorting by a key that increases along every dependency is
    what makes the global order topological; :func:`validate` checks it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._ops: list[tuple[tuple, dict[str, Any], tuple[int, ...]]] = []
        self.messages: dict[int, tuple] = {}

    def add(self, order: tuple, deps: Iterable[int] = (), **fields: Any) -> int:
        self._ops.append((order, fields, tuple(deps)))
        return len(self._ops) - 1

    def deps(self, handle: int) -> tuple[int, ...]:
        return self._ops[handle][2]

    def message(self, binding: tuple) -> int:
        """A new message id, bound to ``binding``."""
        mid = len(self.messages)
        self.messages[mid] = binding
        return mid

    def build(self) -> Schedule:
        index = sorted(range(len(self._ops)), key=lambda h: (self._ops[h][0], h))
        new_id = {h: i for i, h in enumerate(index)}
        ops = tuple(Op(id=i, deps=tuple(sorted({new_id[d] for d in self._ops[h][2]})), **self._ops[h][1])
                    for i, h in enumerate(index))
        return Schedule(self.world_size, ops, dict(self.messages))
