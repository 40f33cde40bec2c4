"""Ops, lanes and the schedule container.

An :class:`Op` is either a *compute* op (runs on its rank's compute lane) or a
*comm* op: one point-to-point transfer ``rank -> peer`` (a whole message, or one
leg of a routed piece).  A transfer sits on the communication lane of both its
ends: the sender posts it once its data dependencies are done, the receiver has
its buffer posted in advance.

Ops are stored in one global order that is a topological order of the
dependencies.  Two rules run it, in the engine and in the simulator alike:

* a rank's transfers travel on one communication lane per link class
  (:func:`lane_of`: inside a node, or through a NIC); a lane posts them a
  *wave* at a time (:meth:`Schedule.waves`), all of the rank's transfers of a
  wave on that lane (sends and receives) in one batch, once every send of the
  batch has its data; the batch is done when all its transfers are, and only
  then do its received bytes count as landed and does the lane post its next
  batch (NCCL runs a batch as one grouped kernel on the lane's stream);
* a compute lane, whenever it is free, runs the *first op in its order whose
  dependencies are done* -- so local sequences, which depend on nothing inside
  a layer, fill every gap in which ring or Ulysses work waits for a transfer.

That makes any schedule deadlock-free on any transport: every rank sees the
same waves, and a transfer of wave ``w`` depends only on transfers of earlier
waves; so once every batch of the waves before ``w`` is done, every rank can
post its batches of wave ``w`` (their data is there, or computed from what is),
and they complete -- also on NCCL, where a pair's transfers must be posted in
the same order on both ends, and a stream runs its kernels in posting order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from itertools import chain
from typing import Any, Callable, Iterable, Sequence

import numpy as np

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


_NO_OPS = RankOps((), ())
"""The lanes of a rank without ops."""


class Schedule:
    """Ops of every rank in one global topological order.

    A builder's schedule keeps each op as its fields and dependency ids, and
    makes the :class:`Op` objects the first time :attr:`ops` is read: the
    simulator's replay reads the fields as columns (:meth:`column`) and a
    64-GPU step has 10^4-10^5 ops, most of which it would never look at."""

    def __init__(self, world_size: int, ops: Sequence[Op] = (), messages: dict[int, tuple] | None = None, *,
                 rows: tuple[list[dict[str, Any]], list[tuple[int, ...]]] | None = None,
                 calls: Sequence[int] | None = None, waves: Sequence[int] | None = None) -> None:
        """``waves``: every op's wave, when the dependencies do not say it (a
        rank's projection, :meth:`projection`, keeps its ops' waves in the whole
        schedule but not the other ranks' ops they were computed through)."""
        self.world_size = world_size
        """Ranks the schedule spans."""
        self.calls: list[int] | None = None if calls is None else list(calls)
        """A whole step's schedule: each op's engine call (segment), in op order;
        None: the schedule is one call."""
        self.messages: dict[int, tuple] = {} if messages is None else messages
        """Message id -> what the engine binds it to (e.g. ``("kv", job, step, src_pos)``);
        a transfer op's ``key`` starts with its message id."""
        self._ops: tuple[Op, ...] | None = None
        self._fields: list[dict[str, Any]] | None = None
        if rows is None:
            self._ops = tuple(ops)
            self._deps = [op.deps for op in self._ops]
        else:
            self._fields, self._deps = rows
        self._columns: dict[str, list] = {}
        self._arrays: OpArrays | None = None
        self._dep_arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._lanes: dict[int, RankOps] | None = None
        self._waves: list[int] | None = None if waves is None else list(waves)
        self._wave_levels: np.ndarray | None = None
        self._tags: dict[int, dict[int, int]] = {}
        self._own: dict[int, dict[int, int]] = {}
        self._batches: dict[int, dict[str, list[list[Op]]]] = {}
        _validate(self)

    @property
    def ops(self) -> tuple[Op, ...]:
        """``ops[i].id == i``."""
        if self._ops is None:
            self._ops = tuple(Op(id=i, deps=deps, **fields)
                              for i, (fields, deps) in enumerate(zip(self._fields, self._deps)))
        return self._ops

    def __len__(self) -> int:
        return len(self._deps)

    def column(self, name: str, at: Sequence[int] | None = None) -> list:
        """Field ``name`` of every op in op order, or of the ops ``at`` (without
        making the ops)."""
        if at is None and name in self._columns:
            return self._columns[name]
        if self._fields is None:
            ops = self._ops if at is None else [self._ops[i] for i in at]
            values = [getattr(op, name) for op in ops]
        else:
            rows = self._fields if at is None else [self._fields[i] for i in at]
            default = _OP_DEFAULTS.get(name)      # None for the fields every op names
            values = [fields.get(name, default) for fields in rows]
        if at is None:
            self._columns[name] = values
        return values

    def arrays(self) -> "OpArrays":
        """The fields the replay reads, as numpy columns (built once)."""
        if self._arrays is None:
            self._arrays = OpArrays.of(self)
        return self._arrays

    def rows(self, at: Sequence[int]) -> list[dict[str, Any]]:
        """The fields of the ops ``at``, each as a mapping of field name to value
        (a builder's ops name only the fields they set)."""
        if self._fields is None:
            return [vars(self._ops[i]) for i in at]
        fields = self._fields
        return [fields[i] for i in at]

    def deps(self) -> list[tuple[int, ...]]:
        """Every op's dependencies, in op order."""
        return self._deps

    def dependency_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(count, flat)``: every op's number of dependencies, and all of them in
        op order (computed once)."""
        if self._dep_arrays is None:
            count = np.fromiter(map(len, self._deps), np.int64, len(self._deps))
            flat = np.fromiter(chain.from_iterable(self._deps), np.int64, int(count.sum()))
            self._dep_arrays = (count, flat)
        return self._dep_arrays

    def lanes(self, rank: int) -> RankOps:
        """``rank``'s compute and communication lanes (computed once per rank)."""
        if self._lanes is None:      # every rank's in one pass over the ops (not one pass per rank)
            compute: dict[int, list[Op]] = {}
            comm: dict[int, list[Op]] = {}
            for op in self.ops:
                if op.kind == COMM:
                    comm.setdefault(op.rank, []).append(op)
                    if op.peer != op.rank:
                        comm.setdefault(op.peer, []).append(op)
                else:
                    compute.setdefault(op.rank, []).append(op)
            # Only the ranks with ops (a rank's projection holds one rank's).
            self._lanes = {r: RankOps(tuple(compute.get(r, ())), tuple(comm.get(r, ())))
                           for r in compute.keys() | comm.keys()}
        return self._lanes.get(rank, _NO_OPS)

    def waves(self) -> list[int]:
        """Every op's wave, in op order (computed once, from the columns): a
        transfer's is one more than the latest wave it depends on (0: none), a
        compute op's two more (1: none).  Transfers of one wave never depend on
        each other, so a lane posts each wave as one batch, and every rank sees
        the same waves.  A compute op counts two so that a transfer waiting for
        one goes a wave after the transfers that leave beside that compute: in a
        backward ring the next K/V is posted before the dK/dV that waits for
        the step's kernel, not in its batch (where it would wait for the kernel
        too, and the ring would lose its overlap)."""
        if self._waves is None:
            level: list[int] = []
            for deps, kind in zip(self._deps, self.column("kind")):
                if not deps:
                    before = -1
                elif len(deps) == 1:
                    before = level[deps[0]]
                else:
                    before = max(map(level.__getitem__, deps))
                level.append(before + 1 if kind == COMM else before + 2)
            self._waves = level
        return self._waves

    def wave_levels(self) -> np.ndarray:
        """:meth:`waves` as an int64 array (made once), as the columnar view takes it."""
        if self._wave_levels is None:
            self._wave_levels = np.asarray(self.waves(), np.int64)
        return self._wave_levels

    def calls_apart(self) -> list[tuple["Schedule", list[int]]]:
        """A whole step's schedule (:attr:`calls` set) as one schedule per engine
        call, in call order, each with the ids its ops have here.  Dependencies
        on earlier calls are dropped: they say that both ends of a transfer have
        finished their previous call, which is how the engine enters a call."""
        ids_of: dict[int, list[int]] = {}
        for i, call in enumerate(self.calls or [0] * len(self)):
            ids_of.setdefault(call, []).append(i)
        out = []
        for call in sorted(ids_of):
            ids = ids_of[call]
            new_id = {old: j for j, old in enumerate(ids)}
            deps = [tuple(new_id[d] for d in self._deps[i] if d in new_id) for i in ids]
            if self._fields is not None:
                fields = [self._fields[i] for i in ids]
            else:
                fields = [{f: getattr(self._ops[i], f) for f in _ROW_FIELDS} for i in ids]
            out.append((Schedule(self.world_size, messages=self.messages, rows=(fields, deps)), ids))
        return out

    def wave(self, op_id: int) -> int:
        """The transfer wave of op ``op_id`` (:meth:`waves`)."""
        return self.waves()[op_id]

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

    def pair_tags(self, rank: int) -> dict[int, int]:
        """Transfer op id -> its index among the transfers between its two ends,
        in op order (computed once per rank).  Both ends count the same
        transfers in the same order, in the whole schedule and in either end's
        :meth:`projection` alike: what tags a transfer on the wire."""
        if rank not in self._tags:
            seen: dict[int, int] = {}
            tags = self._tags[rank] = {}
            for op in self.lanes(rank).comm:
                other = op.peer if op.rank == rank else op.rank
                tags[op.id] = seen[other] = seen.get(other, -1) + 1
        return self._tags[rank]

    def own_index(self, rank: int) -> dict[int, int]:
        """Op id -> its index among ``rank``'s ops, in op order: the op's id in
        ``rank``'s :meth:`projection` (computed once per rank)."""
        if rank not in self._own:
            lanes = self.lanes(rank)
            ids = sorted(op.id for op in (*lanes.compute, *lanes.comm))
            self._own[rank] = {op_id: i for i, op_id in enumerate(ids)}
        return self._own[rank]

    def projection(self, rank: int) -> "Schedule":
        """The ops on ``rank``'s lanes (:meth:`Op.on`), in op order and renumbered,
        with their waves here and the messages they carry.  A dependency on an
        op off ``rank`` is dropped: only a receive has one (it is posted ahead,
        and its wave is kept), a send or compute op waits for its own rank's
        ops only (else :class:`ScheduleError`)."""
        new_id = self.own_index(rank)
        ids = sorted(new_id, key=new_id.__getitem__)
        kinds, peers = self.column("kind", ids), self.column("peer", ids)
        deps = []
        for i, kind, peer in zip(ids, kinds, peers):
            mine = tuple(new_id[d] for d in self._deps[i] if d in new_id)
            if len(mine) != len(self._deps[i]) and not (kind == COMM and peer == rank):
                raise ScheduleError(f"schedule: op {i} on rank {rank} waits for op(s) off its rank; "
                                    "its projection cannot run it")
            deps.append(mine)
        waves = self.waves()
        fields = self.rows(ids) if self._fields is not None else [
            {f: getattr(self._ops[i], f) for f in _ROW_FIELDS} for i in ids]
        carried = {f["key"][0] for f, kind in zip(fields, kinds) if kind == COMM}
        return Schedule(self.world_size, messages={m: b for m, b in self.messages.items() if m in carried},
                        rows=(list(fields), deps), waves=[waves[i] for i in ids])


@dataclass(frozen=True)
class OpArrays:
    """A schedule's ops as numpy columns, in op order: what a replay reads
    (``sim/replay.py: CompiledSegment``), read from the rows once per schedule
    (a schedule is replayed for every cost model and chain it is timed in)."""

    is_comm: np.ndarray
    """bool: a transfer."""
    rank: np.ndarray
    """A compute op's rank, a transfer's sender."""
    peer: np.ndarray
    """A transfer's receiver (-1: a compute op)."""
    ndeps: np.ndarray
    """Each op's number of dependencies."""
    dep: np.ndarray
    """All dependencies, op after op (``Schedule.dependency_arrays``)."""
    wave: np.ndarray
    """Each op's wave (:meth:`Schedule.waves`)."""
    tier: np.ndarray
    """A compute op's tier, as its index in :data:`TIERS` (0: a transfer)."""
    work: np.ndarray
    """A compute op's index among the distinct works (-1: a transfer): the
    distinct ``(tier, backward, tokens, pairs, block, lengths)`` of the compute
    ops, in order of first use, what prices a compute op.  The ``work_*``
    columns below hold them."""
    work_linear: np.ndarray
    """bool per work: a linear op (priced by its tokens), else attention."""
    work_backward: np.ndarray
    """bool per work: part of the backward pass."""
    work_tokens: list[int]
    """Per work: a linear op's tokens."""
    work_pairs: np.ndarray
    """Per work: an attention op's causal pairs (one without ``lengths``)."""
    work_block: np.ndarray
    """Per work: that op's query block."""
    work_lengths: np.ndarray
    """The whole local sequences of every work, work after work (``lengths``)."""
    work_nlengths: np.ndarray
    """Per work: how many of :attr:`work_lengths` are its."""
    nbytes: np.ndarray
    """A transfer's bytes (0: a compute op)."""
    nic: np.ndarray
    """A transfer's named NIC (-1: none named, or a compute op)."""

    @classmethod
    def of(cls, schedule: "Schedule") -> "OpArrays":
        n = len(schedule)
        is_comm = np.fromiter(map(COMM.__eq__, schedule.column("kind")), np.bool_, n)
        ids = np.arange(n, dtype=np.int64)
        compute, comm = ids[~is_comm].tolist(), ids[is_comm].tolist()
        # One pass over each compute op's fields (a builder's ops keep them as dicts);
        # a generator, so the cyclic collector does not see 10^4 new tuples.
        back, tokens, pairs, block, lengths = (_OP_DEFAULTS[f] for f in ("backward", "tokens", "pairs", "block",
                                                                         "lengths"))
        keys = ((f["tier"], f.get("backward", back), f.get("tokens", tokens), f.get("pairs", pairs),
                 f.get("block", block), f.get("lengths", lengths)) for f in schedule.rows(compute))
        index: dict[tuple, int] = {}
        work = np.full(n, -1, np.int64)
        work[compute] = [index.setdefault(key, len(index)) for key in keys]
        tier_index = {tier: i for i, tier in enumerate(TIERS)}
        work_tier = np.array([tier_index[key[0]] for key in index] + [0], np.int64)
        tier = np.zeros(n, np.int64)
        tier[compute] = work_tier[work[compute]]
        nbytes = np.zeros(n, np.int64)
        nic = np.full(n, -1, np.int64)
        if comm:
            rows = schedule.rows(comm)
            nbytes[comm] = [f.get("nbytes", 0) for f in rows]
            nic[comm] = [-1 if (x := f.get("nic")) is None else x for f in rows]
        _, backward, tokens, pairs, block, lengths = zip(*index) if index else ((),) * 6
        nlengths = np.fromiter(map(len, lengths), np.int64, len(index))
        return cls(is_comm, np.fromiter(schedule.column("rank"), np.int64, n),
                   np.fromiter(schedule.column("peer"), np.int64, n), *schedule.dependency_arrays(),
                   schedule.wave_levels(), tier, work, work_tier[:-1] == tier_index["linear"],
                   np.array(backward, np.bool_), list(tokens), np.array(pairs), np.array(block),
                   np.fromiter(chain.from_iterable(lengths), np.int64, int(nlengths.sum())), nlengths, nbytes, nic)


_OP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Op) if f.default is not MISSING}
#: An op's fields besides its id and dependencies (a builder's row).
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(Op) if f.name not in ("id", "deps"))


def _validate(schedule: Schedule) -> None:
    """Ids are positions and every dependency points to an earlier op; else a
    :class:`ScheduleError` naming the op ids (a cycle, or a transfer whose data
    never arrives, would otherwise hang the engine).  Checked on columns; the
    first op that fails any check is then described."""
    n, world = len(schedule), schedule.world_size
    if schedule._ops is not None:
        for i, op in enumerate(schedule._ops):
            if op.id != i:
                raise ScheduleError(f"schedule: op at position {i} has id {op.id}; ids must be 0..n-1 in order")
    deps = schedule.deps()
    ndeps, dep = schedule.dependency_arrays()
    user = np.repeat(np.arange(n, dtype=np.int64), ndeps)
    comm = np.array(schedule.column("kind"), dtype=object) == COMM
    rank = np.fromiter(schedule.column("rank"), np.int64, n)
    peer = np.fromiter(schedule.column("peer"), np.int64, n)
    bad = np.zeros(n, np.bool_)
    bad[user[(dep < 0) | (dep >= user)]] = True
    bad |= (rank < 0) | (rank >= world) | (comm & ((peer < 0) | (peer >= world) | (peer == rank)))
    if not bad.any():
        return
    i = int(np.argmax(bad))
    op_rank, name = int(rank[i]), schedule.column("name")[i]
    late = [d for d in deps[i] if not 0 <= d < i]
    if late:
        raise ScheduleError(f"schedule: op {i} ({name} on rank {op_rank}) depends on op(s) {late}, "
                            "which are not earlier in the schedule: a dependency cycle or a missing op")
    ends = (op_rank, int(peer[i])) if comm[i] else (op_rank,)
    if any(not 0 <= r < world for r in ends):
        raise ScheduleError(f"schedule: op {i} ({name}) names rank(s) {ends} outside 0..{world - 1}")
    raise ScheduleError(f"schedule: op {i} ({name}) sends from rank {op_rank} to itself")


class ScheduleBuilder:
    """Collects ops with sort keys and dependencies by handle, then orders them.

    ``add`` returns a handle; ``build`` sorts by ``(order, insertion)`` and turns
    handles into ids.  Sorting by a key that increases along every dependency is
    what makes the global order topological; the schedule checks it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.orders: list[tuple] = []
        """Each handle's sort key."""
        self._deps: list[tuple[int, ...]] = []
        self._fields: list[dict[str, Any]] = []
        self.messages: dict[int, tuple] = {}
        self._next_message = 0

    def add(self, order: tuple, deps: Iterable[int] = (), **fields: Any) -> int:
        self.orders.append(order)
        self._deps.append(tuple(deps))
        self._fields.append(fields)
        return len(self.orders) - 1

    def deps(self, handle: int) -> tuple[int, ...]:
        return self._deps[handle]

    def message(self, binding: tuple) -> int:
        """A new message id, bound to ``binding``."""
        mid = self._next_message
        self._next_message += 1
        self.messages[mid] = binding
        return mid

    def skip_messages(self, count: int) -> None:
        """Leave out ``count`` message ids: those of a ring or group whose ops a
        rank's schedule leaves out, so that the ids after them are the whole
        schedule's."""
        self._next_message += count

    def sorted_handles(self) -> list[int]:
        """Handles in built order: by sort key, ties in insertion order (a stable sort)."""
        return sorted(range(len(self.orders)), key=self.orders.__getitem__)

    def build(self, call: Callable[[tuple], int] | None = None) -> Schedule:
        """The schedule; ``call``, for a whole step's ops: an op's engine call
        from its sort key (:attr:`Schedule.calls`)."""
        index = self.sorted_handles()
        new_id = [0] * len(index)
        for i, h in enumerate(index):
            new_id[h] = i
        deps = []
        for h in index:
            ds = self._deps[h]
            if len(ds) == 1:           # most ops wait for one op, or none
                deps.append((new_id[ds[0]],))
            else:
                deps.append(tuple(sorted({new_id[d] for d in ds})))
        calls = None if call is None else [call(self.orders[h]) for h in index]
        return Schedule(self.world_size, messages=dict(self.messages),
                        rows=([self._fields[h] for h in index], deps), calls=calls)
