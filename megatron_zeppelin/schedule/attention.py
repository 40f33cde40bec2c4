"""The schedule of one layer's attention under a Plan (forward or backward).

Per sequence, by tier:

* **ring** (zigzag, ``k`` ranks): per step ``s`` a compute op on every position
  (its blocks against the K/V of owner ``pos - s``) and the transfers of the
  next step's K/V -- plus, backward, the dK/dV travelling one step behind.  A
  step's compute and the K/V it forwards both wait for the previous step's
  arrival; nothing waits for a whole round of the world.
* **ulysses** (``d`` ranks): an all-to-all to heads, one compute op per
  position on its heads of the whole sequence, an all-to-all back.
* **local**: compute ops of whole sequences, consecutive ones of a rank packed
  into kernel calls of at least ``local_pack_tokens`` rows.

The global order is by step, transfers of a step before its computes, tiers in
queue order (inter-node rings, intra-node rings, Ulysses) and local work last:
so a rank posts its inter-node transfers first, and because a compute lane runs
the first *ready* op (``schedule/ops.py``), intra-node and local work run while
they are in flight.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from itertools import chain
from dataclasses import dataclass

from megatron_zeppelin.plan.plan import Mode, Plan
from megatron_zeppelin.plan.shards import causal_pairs
from megatron_zeppelin.schedule import geometry as geo
from megatron_zeppelin.schedule import packed
from megatron_zeppelin.schedule.ops import COMM, COMPUTE, Schedule, ScheduleBuilder
from megatron_zeppelin.schedule.routing import Phase, route_message
from megatron_zeppelin.topology import Topology

#: Queue order of the tiers (the slowest transfers start first, local work fills).
TIER_ORDER = {"inter": 0, "intra": 1, "ulysses": 2, "local": 3}
#: Order of local work in a segment: after every ring and Ulysses op.
_LAST = 1 << 30


@dataclass(frozen=True)
class AttnShape:
    """What sizes the ops of an attention layer besides the Plan."""

    q_heads: int
    """Query heads on this rank (after tensor parallelism)."""
    kv_heads: int
    """Key/value heads on this rank."""
    head_dim: int
    """Elements per head."""
    itemsize: int = 2
    """Bytes per element of q/k/v and outputs (K/V and Ulysses traffic travel in it)."""
    acc_itemsize: int = 4
    """Bytes per element of the dK/dV ring traffic: fp32 (fp64 for fp64) under
    ``ring_grad_dtype: fp32``, the K/V's ``itemsize`` under ``model``
    (``cost/model.py: ring_grad_itemsize``)."""
    local_pack_tokens: int = 512
    """Consecutive local sequences of a rank share one kernel call until it holds
    this many query rows: short sequences alone would pay a launch each, while
    calls much longer than a ring step could not fill its gaps."""


@dataclass(frozen=True)
class Transport:
    """How transfers travel: direct, or routed over every NIC of the node."""

    topology: Topology
    """Nodes, GPUs per node and each GPU's NIC."""
    min_routed_bytes: float = math.inf
    """Messages at least this large crossing nodes are routed (inf: routing off)."""

    def direct(self) -> "Transport":
        """The same topology with every message sent direct."""
        return dataclasses.replace(self, min_routed_bytes=math.inf)


def add_transfer(b: ScheduleBuilder, order: tuple, transport: Transport, binding: tuple, src: int, dst: int,
                 numel: int, itemsize: int, deps: list[int], *, tier: str, name: str,
                 backward: bool, route_id: int | None = None,
                 entry: dict[int, list[int]] | None = None,
                 touching: defaultdict[int, list[int]] | None = None) -> list[int]:
    """Add one message as transfer ops (one per hop); return the handles of the
    hops that land on ``dst`` (what a consumer waits for).  ``route_id`` (default:
    the message id) rotates the proxies among concurrent messages.  A hop also
    waits for its receiver's ``entry``: a rank posts its receives when it starts
    the segment, and no transfer lands before that.  ``touching``, when given,
    receives every hop's handle under both of its ranks."""
    mid = b.message(binding)
    arrivals, last_leg = [], {}
    route = mid if route_id is None else route_id
    entry = entry or {}
    for i, (_, piece, phase, a, c, offset, n, nic, isz) in enumerate(
            route_message(route, src, dst, numel, itemsize, transport.topology, transport.min_routed_bytes)):
        before = last_leg.get(piece)
        waits = [before] if before is not None else list(deps)
        if c in entry:
            waits += entry[c]
        handle = b.add((*order, i), waits, kind=COMM, tier=tier,
                       name=name if phase is Phase.DIRECT else f"{name}.{phase.name.lower()}",
                       rank=a, peer=c, nbytes=n * isz, nic=nic, backward=backward,
                       key=(mid, piece, int(phase), offset, n, isz))
        last_leg[piece] = handle
        if touching is not None:
            touching[a].append(handle)
            touching[c].append(handle)
        if c == dst:
            arrivals.append(handle)
    return arrivals


class _Segment:
    """Adds one segment's ops; roots on a rank depend on that rank's ``entry``."""

    def __init__(self, b: ScheduleBuilder, prefix: tuple, entry: dict[int, list[int]]) -> None:
        self.b, self.prefix, self.entry = b, prefix, entry
        self.touching: defaultdict[int, list[int]] = defaultdict(list)   # rank -> its compute ops and arrivals

    def compute(self, order: tuple, rank: int, deps: list[int], **fields) -> int:
        h = self.b.add((*self.prefix, *order), [*deps, *self.entry.get(rank, ())], kind=COMPUTE,
                       rank=rank, **fields)
        self.touching[rank].append(h)
        return h

    def transfer(self, order: tuple, transport: Transport, binding: tuple, src: int, dst: int, numel: int,
                 itemsize: int, deps: list[int], tier: str, name: str, backward: bool) -> list[int]:
        # A call ends once its sends are done too: every hop touches both its ranks.
        return add_transfer(self.b, (*self.prefix, *order), transport, binding, src, dst, numel, itemsize,
                            deps or list(self.entry.get(src, ())), tier=tier, name=name, backward=backward,
                            entry=self.entry, touching=self.touching)

    def frontier(self) -> dict[int, list[int]]:
        """Per rank, its ops of the segment (compute, sends, receives, forwarded
        pieces) that none of its other ops wait for: what the rank's next segment
        starts after, as the engine's call returns once all its lanes are done."""
        out = {}
        deps = self.b.deps
        for rank, hs in self.touching.items():
            inner = set(chain.from_iterable(map(deps, hs)))
            out[rank] = [h for h in hs if h not in inner]
        for rank, deps in self.entry.items():
            out.setdefault(rank, list(deps))   # a rank with nothing here carries its entry on
        return out


def add_attention(b: ScheduleBuilder, prefix: tuple, plan: Plan, shape: AttnShape, transport: Transport,
                  backward: bool, entry: dict[int, list[int]] | None = None, *,
                  pack: bool = False, rank: int | None = None) -> dict[int, list[int]]:
    """Add one layer's attention (forward or backward); return each rank's frontier.

    The plan's ``packed_rings`` run as one ring each and its ``packed_ulysses``
    as one group each, named by their first member in plan order
    (``Plan.packed_leads``), as the engine runs them.
    ``pack`` runs all ring sequences of the same rank tuple as one ring
    (TransformerEngine's THD layout: each step sends and computes all of them)
    and all Ulysses sequences of the same rank tuple as one group (FlexSP and
    DeepSpeed: one all-to-all per layer), for baselines the engine does not run.
    A plan that packs every ring and Ulysses rank tuple's sequences has the same
    schedule with and without ``pack`` (same ops, same order).

    ``rank``: add only the rings and groups with an op on ``rank``'s lanes
    (:func:`_reaches`), whole, and ``rank``'s local sequences; the ids of the
    messages left out are skipped, so every message keeps its id.  Without
    ``entry``, a ring's or group's ops wait only for its own ops, so each op
    keeps its wave too (``attention_schedule``)."""
    seg = _Segment(b, prefix, entry or {})
    kv_numel = shape.kv_heads * shape.head_dim
    local: dict[int, list[int]] = {}
    rings: dict[tuple, list[int]] = {}
    groups: dict[tuple, list[int]] = {}
    leads = plan.packed_leads()      # the plan's own packs, as the engine runs them
    # For one rank: the rings and groups and the rank's local sequences, in plan
    # order (the other ranks' local sequences would be left out below).
    indices = (range(len(plan.attention)) if rank is None
               else sorted({*plan.shared_indices(), *(i for i, _ in plan.placements_of(rank))}))
    for index in indices:
        p = plan.attention[index]
        if p.mode is Mode.LOCAL:
            if rank is None or p.ranks[0] == rank:
                local.setdefault(p.ranks[0], []).append(index)
        elif p.mode is Mode.RING:
            rings.setdefault(p.ranks if pack else (leads.get(index, index),), []).append(index)
        else:
            groups.setdefault(p.ranks if pack else (leads.get(index, index),), []).append(index)
    for members in rings.values():
        lead = plan.attention[members[0]]
        if rank is not None and not reaches(lead.ranks, rank, transport):
            b.skip_messages(geo.ring_message_count(lead.size, backward))
            continue
        tier = plan.tier_of(lead)
        _add_ring(seg, transport, [(i, plan.attention[i]) for i in members], TIER_ORDER[tier], tier, kv_numel,
                  shape, backward)
    for members in groups.values():
        lead = plan.attention[members[0]]
        if rank is not None and rank not in lead.ranks:      # all-to-alls go direct: members only
            b.skip_messages(geo.ulysses_message_count(lead.size))
            continue
        _add_ulysses(seg, transport, [(i, plan.attention[i]) for i in members], TIER_ORDER["ulysses"], shape,
                     backward)
    for owner, indices in local.items():
        for pack, members in enumerate(_packs(plan, indices, shape.local_pack_tokens)):
            lengths = tuple(plan.seq_lens[plan.attention[i].seq] for i in members)
            seg.compute((_LAST, pack), owner, [], tier="local",
                        name="local_bwd" if backward else "local_fwd", backward=backward,
                        pairs=sum(causal_pairs(0, n) for n in lengths), block=max(lengths),
                        lengths=lengths, key=("local", *members))
    return seg.frontier()


def reaches(ranks: tuple[int, ...], rank: int, transport: Transport) -> bool:
    """Whether the messages among ``ranks`` (a ring's, or one message's two ends)
    may have an op on ``rank``'s lanes: ``rank`` is one of them, or, where
    messages leaving a node may be routed, one shares ``rank``'s node (``rank``
    may then proxy a piece: its dispatch and NIC legs leave from the sender's
    node, its combine leg from the receiver's)."""
    if rank in ranks:
        return True
    topo = transport.topology
    if transport.min_routed_bytes == math.inf or topo.nics_per_node == 1:
        return False
    node, gpn = rank // topo.gpus_per_node, topo.gpus_per_node
    return any(r // gpn == node for r in ranks)


def _packs(plan: Plan, indices: list[int], pack_tokens: int) -> list[list[int]]:
    packs, tokens = [[]], 0
    for i in indices:
        if tokens >= pack_tokens:
            packs.append([])
            tokens = 0
        packs[-1].append(i)
        tokens += plan.seq_lens[plan.attention[i].seq]
    return packs


def _add_ring(seg: _Segment, transport: Transport, members: list[tuple[int, object]], tier_order: int,
              tier: str, kv_numel: int, shape: AttnShape, backward: bool) -> None:
    """A ring over the ranks of ``members`` (placements with one rank tuple): one
    sequence for Zeppelin, every sequence of a CP group when packed."""
    index, p = members[0]
    k = p.size
    size_of = {"kv": shape.itemsize, "dkv": shape.acc_itemsize}
    kv_in: dict[int, list[int]] = {}    # pos -> arrivals of the K/V it holds this step
    dkv_in: dict[int, list[int]] = {}   # pos -> arrivals of the dK/dV it holds this step
    computed: dict[int, int] = {}       # pos -> its compute op of the previous step
    summed = packed.summed_ring([q for _, q in members]) if len(members) > 1 else p
    work_pairs, work_rows = packed.ring_work(*packed.chunk_rows([q for _, q in members]))
    for step in range(geo.ring_steps(p, backward)):
        sent = geo.ring_messages(summed, step, backward, kv_numel)
        new_kv, new_dkv = {}, {}
        for i, (kind, a, c, numel) in enumerate(sent):
            if kind == "kv":
                deps = kv_in.get(a, [])
            else:
                deps = [computed[a], *dkv_in.get(a, [])] if a in computed else dkv_in.get(a, [])
            arrivals = seg.transfer((step, 0, tier_order, index, i), transport,
                                    (kind, index, step, a), p.ranks[a], p.ranks[c], numel, size_of[kind],
                                    list(deps), tier=tier, name=kind, backward=backward)
            (new_kv if kind == "kv" else new_dkv)[c] = arrivals
        if step < k:
            for pos in range(k):
                owner = (pos - step) % k
                pairs, block = work_pairs[pos][owner], work_rows[pos][owner]
                computed[pos] = seg.compute(
                    (step, 1, tier_order, index, pos), p.ranks[pos], list(kv_in.get(pos, [])), tier=tier,
                    name="ring_bwd" if backward else "ring_fwd", backward=backward,
                    pairs=pairs, block=block, key=("ring", index, pos, step))
        kv_in, dkv_in = new_kv, new_dkv


def _add_ulysses(seg: _Segment, transport: Transport, members: list[tuple[int, object]], tier_order: int,
                 shape: AttnShape, backward: bool) -> None:
    """A Ulysses group over the ranks of ``members`` (placements with one rank
    tuple): one sequence for Zeppelin, all of a group's when packed."""
    index, p = members[0]
    # An all-to-all loads every NIC of the node at once (each GPU sends its share
    # through its own): there is no idle NIC for routing to borrow, only two
    # extra hops to pay.  Its messages always go direct.
    transport = transport.direct()
    summed = packed.summed_ulysses([q for _, q in members]) if len(members) > 1 else p

    def messages(step: int) -> list[tuple[int, int, int]]:
        return geo.ulysses_messages(summed, step, backward, shape.q_heads, shape.kv_heads, shape.head_dim)

    arrived: dict[int, list[int]] = {}
    for i, (a, c, numel) in enumerate(messages(0)):
        arrived.setdefault(c, []).extend(seg.transfer(
            (0, 0, tier_order, index, i), transport, ("a2a_in", index, a, c), p.ranks[a], p.ranks[c], numel,
            shape.itemsize, [], tier="ulysses", name="a2a_in", backward=backward))
    pairs = [geo.ulysses_pairs(q) for _, q in members]
    lengths = [q.shards[-1][0][1] for _, q in members]
    block = sum(n * x for n, x in zip(pairs, lengths)) // max(sum(pairs), 1)   # pair-weighted length
    computed = {pos: seg.compute((1, 1, tier_order, index, pos), p.ranks[pos], arrived.get(pos, []),
                                 tier="ulysses", name="ulysses_bwd" if backward else "ulysses_fwd",
                                 backward=backward, pairs=sum(pairs), block=max(block, 1),
                                 key=("ulysses", index, pos))
                for pos in range(p.size)}
    for i, (a, c, numel) in enumerate(messages(2)):
        seg.transfer((2, 0, tier_order, index, i), transport, ("a2a_out", index, a, c), p.ranks[a],
                     p.ranks[c], numel, shape.itemsize, [computed[a]], tier="ulysses", name="a2a_out",
                     backward=backward)


def attention_schedule(plan: Plan, shape: AttnShape, transport: Transport, backward: bool,
                       rank: int | None = None) -> Schedule:
    """One layer's attention as the engine runs it (the same ops, in the same
    order, as that layer's segment of :func:`~megatron_zeppelin.schedule.step.step_schedule`).

    ``rank``: that schedule's projection onto ``rank`` (``Schedule.projection``:
    its ops, order, waves, message ids and bindings), built from the rings and
    groups that reach ``rank`` only -- what one rank executes, in work that
    grows with what touches the rank, not with the world."""
    b = ScheduleBuilder(plan.world_size)
    add_attention(b, (), plan, shape, transport, backward, rank=rank)
    built = b.build()
    return built if rank is None else built.projection(rank)
