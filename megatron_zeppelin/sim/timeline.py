"""Modeled timeline of one training step of a Plan, per rank.

The step is the schedule the engine executes (``schedule/step.py``): every
layer's attention (rings, Ulysses groups, local sequences as separate ops with
their dependencies), the layout switches and the linear work, forward and
backward.  :func:`step_timeline` replays it event by event with cost-model
durations and link contention (``sim/replay.py``) -- what a rank waits for is
what the engine would wait for, no more and no less.  The per-rank numbers
below are read off that replay.

Strategies the engine does not run keep a schedule of their own shape built
through the same machinery: ``te_cp`` packs all sequences of a CP group into
one ring (TransformerEngine's THD layout sends all of them each step), and
``flexsp`` / ``ulysses_sp`` pack a Ulysses group's sequences into one
all-to-all per layer.  The step ends when the slowest rank ends, plus what the
gradient all-reduce leaves exposed and the optimizer (``cost/step_sync.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.plan import Plan, TierCounts
from megatron_zeppelin.schedule.attention import AttnShape, Transport, add_attention
from megatron_zeppelin.schedule.ops import Schedule, ScheduleBuilder
from megatron_zeppelin.schedule.routing import min_routed_bytes
from megatron_zeppelin.schedule.step import StepShape, add_linear, add_switch, remap_messages
from megatron_zeppelin.cost.step_sync import StepSync, forward_backward_split, step_sync
from megatron_zeppelin.sim.replay import REPLAYED_LAYERS, replay_step

#: Segment kinds, in the order a rank runs them (plots use the same order).
SEGMENT_KINDS = ("attention", "exposed_comm", "remap", "linear")


@dataclass(frozen=True)
class Segment:
    """One bar of a rank's timeline plot."""

    kind: str
    """One of :data:`SEGMENT_KINDS`."""
    start_s: float
    """Offset from the start of the step, seconds."""
    duration_s: float
    """Length, seconds."""


@dataclass(frozen=True)
class RankTimeline:
    """Where one rank's step time goes (all layers, forward + backward)."""

    rank: int
    """Global rank."""
    linear_s: float
    """Projections, MLP and output layer over the rank's linear-layout tokens."""
    attn_compute_s: float
    """Attention kernel time: rings, Ulysses shares and local sequences."""
    exposed_comm_s: float
    """Time the rank's compute lane waited for transfers outside the layout
    switches (communication neither ring compute nor local work could hide)."""
    remap_s: float
    """Time the rank spent in layout switches attention <-> linear."""
    total_s: float
    """When the rank finished its step (``linear_s + attn_compute_s + exposed_comm_s
    + remap_s``)."""
    segments: tuple[Segment, ...]
    """The same numbers laid out in time, for plotting."""


@dataclass(frozen=True)
class StepTimeline:
    """Modeled step of one Plan on one cost model."""

    strategy: str
    """Planner that produced the plan."""
    ranks: tuple[RankTimeline, ...]
    """One entry per rank, indexed by rank."""
    step_s: float
    """Step time: the slowest rank's total."""
    attn_imbalance: float
    """max / mean of causal attention pairs per rank (1.0 is perfect)."""
    linear_imbalance: float
    """max / mean of linear-layout tokens per rank (1.0 is perfect)."""
    tiers: TierCounts
    """Sequences per tier (local / intra / inter / ulysses)."""
    sync: StepSync | None = None
    """Gradient all-reduce (exposed part) and optimizer after the slowest rank;
    None for one round of several (the step adds it once)."""

    @property
    def compute_s(self) -> float:
        """The slowest rank's total, before the gradient sync."""
        return max(r.total_s for r in self.ranks)

    @property
    def slowest_rank(self) -> int:
        return max(self.ranks, key=lambda r: r.total_s).rank


def imbalance(values: Sequence[float]) -> float:
    """max / mean; 1.0 for an all-zero (or empty) load, which is balanced."""
    if not values or not any(values):
        return 1.0
    return max(values) * len(values) / sum(values)


def remap_time(cost: CostModel, plan: Plan) -> float:
    """Seconds of the layout switches of one step, the same on every rank.

    Per layer and direction, the busiest NVLink carries max(sent, received) of
    one GPU.  Across nodes, with routing a node's traffic is spread over all its
    NICs, so the busiest *node* counts; without routing each GPU's bytes go
    through its own NIC, so the busiest *NIC* counts (``CostModel.remap_s``
    divides by the matching bandwidth).  The all-to-all-v sends one message per
    peer."""
    topo = cost.cluster.topology
    per_token = cost.model.hidden_bytes_per_token
    w = plan.world_size
    intra_out, intra_in = [0] * w, [0] * w
    link_out: dict[tuple[int, int], int] = defaultdict(int)
    link_in: dict[tuple[int, int], int] = defaultdict(int)
    peers: list[set[int]] = [set() for _ in range(w)]
    for t in plan.remap_schedule():
        peers[t.src].add(t.dst)
        peers[t.dst].add(t.src)
        if topo.same_node(t.src, t.dst):
            intra_out[t.src] += t.length
            intra_in[t.dst] += t.length
        else:
            link_out[_inter_link(cost, t.src)] += t.length
            link_in[_inter_link(cost, t.dst)] += t.length
    intra = max(max(intra_out, default=0), max(intra_in, default=0))
    inter = max(list(link_out.values()) + list(link_in.values()), default=0)
    messages = max((len(p) for p in peers), default=0)
    return cost.remap_s(intra * per_token, inter * per_token, messages)


def _inter_link(cost: CostModel, rank: int) -> tuple[int, int]:
    """The unit of inter-node bandwidth ``rank``'s bytes share: its node with
    routing, its (node, NIC) without."""
    topo = cost.cluster.topology
    return (topo.node_of(rank), -1 if cost.routing else topo.nic_of(rank))


def step_shape(cost: CostModel, remap: bool) -> StepShape:
    """The step shape of ``cost``'s model: heads and dtypes as the engine sends them
    (K/V and outputs in the model dtype, dK/dV as ``cost.ring_grad_dtype`` says)."""
    m = cost.model
    return StepShape(num_layers=m.num_layers,
                     attn=AttnShape(m.num_attention_heads, m.num_query_groups, m.head_dim, m.dtype_bytes,
                                    cost.ring_grad_bytes),
                     hidden_size=m.hidden_size, remap=remap)


def transport_of(cost: CostModel) -> Transport:
    """Direct transfers, or routed above the cost model's break-even when ``cost.routing``."""
    topo = cost.cluster.topology
    return Transport(topo, min_routed_bytes(cost) if cost.routing else math.inf)


def step_parts(plan: Plan, cost: CostModel, *, pack: bool = False, attn: AttnShape | None = None,
               transport: Transport | None = None) -> list[tuple[str, Schedule, Schedule]]:
    """The segments of one layer of ``plan`` (forward and backward), as
    :func:`~megatron_zeppelin.sim.replay.replay_step` takes them.  ``attn`` and
    ``transport`` override what ``cost`` implies (a plan the trainer ran records
    its own dtypes and routing threshold)."""
    messages = remap_messages(plan)
    shape = step_shape(cost, bool(messages))
    if attn is not None:
        shape = dataclasses.replace(shape, attn=attn)
    elif plan.strategy in TE_RING_STRATEGIES:
        # TE's p2p ring (AttnFuncWithCPAndKVP2P.backward, non-FP8) sends dK/dV in
        # the K/V dtype: one buffer of two K/V-shaped halves per step, so its
        # backward moves twice the forward's bytes whatever cost.ring_grad_dtype says.
        shape = dataclasses.replace(shape, attn=dataclasses.replace(shape.attn, acc_itemsize=shape.attn.itemsize))
    transport = transport or transport_of(cost)
    if not plan.routed:          # the plan runs every crossing direct (Plan.routed), as the engine does
        transport = transport.direct()
    isz, row = shape.attn.itemsize, shape.hidden_size

    def segment(add) -> Schedule:
        # A segment allocates 10^4-10^5 acyclic tuples and dicts; the cyclic
        # collector would rescan them (and everything older) many times over
        # while finding nothing to free: it waits until the segment is built.
        enabled = gc.isenabled()
        gc.disable()
        try:
            b = ScheduleBuilder(plan.world_size)
            add(b)
            return b.build()
        finally:
            if enabled:
                gc.enable()

    parts = [("attn", *(segment(lambda b, bw=bw: add_attention(b, (), plan, shape.attn, transport, bw,
                                                                pack=pack))
                        for bw in (False, True)))]
    if messages:
        parts.append(("to_linear", *(segment(lambda b, bw=bw: add_switch(b, (), messages, transport, row, isz,
                                                                          bw, {}, reverse=bw))
                                     for bw in (False, True))))
    tokens = plan.linear_tokens_per_rank()
    parts.append(("linear", *(segment(lambda b, bw=bw: add_linear(b, (), tokens, bw, {})) for bw in (False, True))))
    if messages:
        parts.append(("to_attn", *(segment(lambda b, bw=bw: add_switch(b, (), messages, transport, row, isz,
                                                                        bw, {}, reverse=not bw))
                                   for bw in (False, True))))
    return parts


def sync_tail(cost: CostModel, busy_s: dict[tuple[int, str], float], finish_s: Sequence[float]) -> StepSync:
    """The gradient sync and optimizer after the slowest rank (``cost/step_sync.py``),
    its reduce-scatter overlapped with that rank's backward work as replayed."""
    slowest = max(range(len(finish_s)), key=lambda r: finish_s[r])
    linear = busy_s.get((slowest, "linear"), 0.0)
    attn = sum(v for (r, tier), v in busy_s.items() if r == slowest and tier != "linear")
    return step_sync(cost, *forward_backward_split(attn, linear))


#: Strategies whose CP groups run TransformerEngine's THD p2p ring: static CP and
#: Megatron-LM's sequence-packing schedulers (a rank's packed micro-batch is one
#: THD tensor over its CP group).
TE_RING_STRATEGIES = ("te_cp", "megatron_dp_balanced", "megatron_dynamic_cp")
#: Strategies whose attention the engine does not run as Zeppelin does: TE packs
#: a CP group's sequences into one ring, FlexSP and DeepSpeed-Ulysses a group's
#: sequences into one all-to-all.
PACKED_STRATEGIES = (*TE_RING_STRATEGIES, "flexsp", "ulysses_sp")


def step_timeline(plan: Plan, cost: CostModel, *, attn: AttnShape | None = None,
                  transport: Transport | None = None, exact: bool = False, sync: bool = True,
                  replayed_layers: int = REPLAYED_LAYERS, reuse: bool = True) -> StepTimeline:
    """Per-rank modeled time of one step of ``plan`` (see the module docstring).
    ``exact`` replays every layer instead of extrapolating the steady state after
    ``replayed_layers``; ``sync=False`` leaves out the gradient sync (one
    micro-batch of several); ``reuse=False`` replays even if the same plan was
    timed the same way before."""
    key = (plan, cost, exact, sync, replayed_layers)
    memo = attn is None and transport is None
    if memo and reuse and (hit := _TIMELINES.get(key)) is not None:
        return hit
    timeline = _replayed_timeline(plan, cost, attn, transport, exact, sync, replayed_layers)
    if memo:
        _TIMELINES.put(key, timeline)
    return timeline


def replay_clock(cost: CostModel) -> Callable[[Plan], float]:
    """``PlanContext.settle_model`` under ``cost``: :func:`step_timeline`'s step
    (remembered, so the simulator's timing of the plan the decision settled on
    is the replay it already ran)."""
    return lambda plan: step_timeline(plan, cost).step_s


class RecentResults:
    """The ``size`` most recently used results by key (a bounded memo)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, key: tuple) -> Any | None:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
        return hit

    def put(self, key: tuple, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)


def decision_step_s(plan: Plan, cost: CostModel) -> float:
    """The replayed step of ``plan`` at the reported depth: what the surrogate
    (``planner/surrogate.py``) is certified against, what the trainer logs as a
    step's modeled time, and what tests compare decisions by."""
    return step_timeline(plan, cost).step_s


#: Timelines kept by :func:`step_timeline`.  The same plan is timed more than
#: once in one run -- a static layout search times the first batches' plans, the
#: simulation then plans and times those batches again, and Zeppelin's variants
#: often pick the same plan -- and a replay costs far more than hashing the plan.
_TIMELINES = RecentResults(512)


def _replayed_timeline(plan: Plan, cost: CostModel, attn: AttnShape | None, transport: Transport | None,
                       exact: bool, sync: bool, replayed_layers: int) -> StepTimeline:
    parts = step_parts(plan, cost, pack=plan.strategy in PACKED_STRATEGIES, attn=attn, transport=transport)
    replay = replay_step(parts, cost.model.num_layers, cost, plan.world_size, exact=exact,
                         replayed_layers=replayed_layers)
    ranks = []
    for rank in range(plan.world_size):
        busy = {tier: s for (r, tier), s in replay.busy_s.items() if r == rank}
        linear = busy.pop("linear", 0.0)
        compute = sum(busy.values())
        remap = sum(replay.segment_s[name][rank] for name in ("to_linear", "to_attn") if name in replay.segment_s)
        total = replay.finish_s[rank]
        waiting = total - linear - compute - remap
        waiting = waiting if waiting > 1e-9 * total else 0.0      # rounding of the extrapolation
        durations = dict(zip(SEGMENT_KINDS, (compute, waiting, remap, linear)))
        segments, t = [], 0.0
        for kind in SEGMENT_KINDS:
            if durations[kind] > 0:
                segments.append(Segment(kind, t, durations[kind]))
                t += durations[kind]
        ranks.append(RankTimeline(rank=rank, linear_s=linear, attn_compute_s=compute, exposed_comm_s=waiting,
                                  remap_s=remap, total_s=total, segments=tuple(segments)))
    tail = sync_tail(cost, replay.busy_s, replay.finish_s) if sync else None
    return StepTimeline(strategy=plan.strategy, ranks=tuple(ranks),
                        step_s=replay.step_s + (tail.exposed_s if tail else 0.0), sync=tail,
                        attn_imbalance=imbalance(plan.attn_pairs_per_rank()),
                        linear_imbalance=imbalance(plan.linear_tokens_per_rank()),
                        tiers=plan.tier_counts())
