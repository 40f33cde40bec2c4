"""Modeled timeline of one training step of a Plan, per rank.

A rank's step is three phases, all on its critical path:

* attention: the engine runs its inter-node rings, then intra-node rings, then
  local sequences.  Ring transfers overlap the ring's own compute step by step
  (``CostModel.ring_cost``); what they cannot hide (``exposed_s``) is a gap the
  local work fills, because local attention needs no transfer.  Ulysses
  all-to-alls are blocking collectives: nothing hides them.
* remap: the all-to-all-v between the attention and the linear layout.  It is
  collective, so every rank waits for the busiest link of the whole world.
* linear: projections, MLP and output layer over the rank's linear tokens.

Sequences whose rings share the exact same rank tuple are packed into one ring
(TransformerEngine's THD layout sends all of them each step); a ring holding
one sequence is Zeppelin's case; Ulysses groups pack the same way (one
all-to-all per layer for all their sequences).  Concurrent inter-node rings
share NICs (``cost/contention.py``).  The step ends when the slowest rank
ends, plus what the gradient all-reduce leaves exposed and the optimizer
(``cost/step_sync.py``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.cost import CostModel, RingCost
from megatron_zeppelin.cost.contention import ring_links
from megatron_zeppelin.cost.step_sync import StepSync, forward_backward_split, step_sync
from megatron_zeppelin.plan import Mode, Plan, TierCounts

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
    """Attention communication neither ring compute nor local work could hide."""
    remap_s: float
    """Layout switches attention <-> linear (the world's busiest link)."""
    total_s: float
    """``linear_s + attn_compute_s + exposed_comm_s + remap_s``."""
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


def attention_phase(cost: CostModel, plan: Plan) -> list[tuple[float, float]]:
    """(compute_s, exposed_comm_s) of every rank's attention phase."""
    w = plan.world_size
    rings: dict[tuple[int, ...], list[int]] = defaultdict(list)
    ulysses: dict[tuple[int, ...], list[int]] = defaultdict(list)
    local = [0.0] * w
    grouped = [0.0] * w      # compute of rings and Ulysses groups
    ring_exposed = [0.0] * w
    ulysses_comm = [0.0] * w
    for p in plan.attention:
        length = plan.seq_lens[p.seq]
        if p.mode is Mode.LOCAL:
            local[p.ranks[0]] += cost.local_attn_s(length)
        elif p.mode is Mode.RING:
            rings[p.ranks].append(length)
        else:
            ulysses[p.ranks].append(length)
    # A group's sequences share one all-to-all per layer and pass (packed).
    for ranks, lengths in ulysses.items():
        _add(grouped, ulysses_comm, ranks,
             cost.ulysses_cost(lengths, len(ranks), cost.alltoall_link(ranks)))
    kv = cost.model.kv_bytes_per_token
    links = ring_links(cost, [(ranks, kv * sum(lengths) / len(ranks)) for ranks, lengths in rings.items()])
    for (ranks, lengths), link in zip(rings.items(), links):
        _add(grouped, ring_exposed, ranks, cost.ring_cost(lengths, len(ranks), link))
    # Local work runs inside the ring gaps; only the part of the gaps it cannot
    # fill stays exposed.  phase = sum(total) + max(0, local - ring_exposed).
    return [(grouped[r] + local[r], ulysses_comm[r] + max(0.0, ring_exposed[r] - local[r]))
            for r in range(w)]


def _add(compute: list[float], exposed: list[float], ranks: Sequence[int], c: RingCost) -> None:
    for r in ranks:
        compute[r] += c.compute_s
        exposed[r] += c.exposed_s


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


def step_timeline(plan: Plan, cost: CostModel, *, sync: bool = True) -> StepTimeline:
    """Per-rank modeled time of one step of ``plan`` (see the module docstring);
    ``sync=False`` leaves out the gradient sync (one micro-batch of several)."""
    remap = remap_time(cost, plan)
    linear_tokens = plan.linear_tokens_per_rank()
    ranks = []
    for rank, (compute, exposed) in enumerate(attention_phase(cost, plan)):
        linear = cost.linear_s(linear_tokens[rank])
        durations = dict(zip(SEGMENT_KINDS, (compute, exposed, remap, linear)))
        segments, t = [], 0.0
        for kind in SEGMENT_KINDS:
            if durations[kind] > 0:
                segments.append(Segment(kind, t, durations[kind]))
                t += durations[kind]
        ranks.append(RankTimeline(rank=rank, linear_s=linear, attn_compute_s=compute,
                                  exposed_comm_s=exposed, remap_s=remap,
                                  total_s=linear + compute + exposed + remap,
                                  segments=tuple(segments)))
    slowest = max(ranks, key=lambda r: r.total_s)
    tail = step_sync(cost, *forward_backward_split(slowest.attn_compute_s, slowest.linear_s)) if sync else None
    return StepTimeline(strategy=plan.strategy, ranks=tuple(ranks),
                        step_s=slowest.total_s + (tail.exposed_s if tail else 0.0), sync=tail,
                        attn_imbalance=imbalance(plan.attn_pairs_per_rank()),
                        linear_imbalance=imbalance(linear_tokens),
                        tiers=plan.tier_counts())
