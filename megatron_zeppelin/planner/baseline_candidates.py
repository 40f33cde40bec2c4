"""The baselines' plans of a batch, as candidates of Zeppelin's per-batch decision.

Every baseline's layout of a batch that fits one pass under the per-GPU cap
is a plan Zeppelin's engine runs: a sequence local on one rank, zigzag-split
over a ring, or contiguous over a Ulysses group, the linear layout equal to
the attention layout (no remap).  So the decision (``planner/zeppelin_decide.py``)
offers them beside its own, and the plan it keeps is not modeled slower than
any of them *run by Zeppelin's engine*, beyond the misorderings of the
surrogate it compares them by (``planner/surrogate.py``):

* static CP's uniform layouts (``te_cp``; ``c = 1`` is ``packing_dp``'s
  whole-sequence packing), the two smallest ``c`` that hold the batch in one
  pass, the sizes a static run picks (a run whose maximum length is longer
  than the batch's longest sequence launches a wider ``c``: not held);
* static Ulysses SP (``ulysses_sp``), every ``d >= 2`` that does on up to
  16 GPUs; beyond, every such ``d`` up to a node (the two smallest beyond a
  node when none within does; the simulator's layout search also tries wider
  groups: not held there);
* Megatron-Core's hybrid CP groups (``megatron_hybrid_cp``) when its schedule
  is one round: as they are where no rank holds more than the cap, else (it
  runs a group's sub-samples one after another, so its round may exceed the
  cap), on up to 16 GPUs, with the sub-samples that put a group over it moved
  to groups with room;
* FlexSP's heterogeneous Ulysses groups from its greedy (``flexsp``: first fit
  under a bisected makespan), and FlexSP's own plan (its MILP's grouping) where
  the MILP is small (up to 16 GPUs and 400 columns), solved without a time
  limit so that every rank gets the same plan.

What does not carry over is how TE *executes* a plan: its ring sends dK/dV
in the model dtype where the engine accumulates and sends them in fp32.  The
baselines' packing does carry over: static CP's layouts are offered as they
are and with every CP group's ring sequences in one packed ring
(``Plan.packed_rings``, which the engine runs as TE does), and Ulysses SP's
and FlexSP's with every group's sequences in one packed group
(``Plan.packed_ulysses``: one all-to-all each way, as FlexSP and
DeepSpeed-Ulysses run it; ``sim/timeline.py: PACKED_STRATEGIES``).
A candidate here is relabelled ``zeppelin`` and is timed, and run, as the
engine runs it.

Above :data:`MAX_SEQUENCES_ALL_SOURCES` sequences only static CP's layouts
are offered: building the others' plans costs seconds at 1,024 GPUs.

A source lays out :class:`Draft`\s, placements as columns without a Plan: the
decision bounds and prices each from its columns and builds (and validates)
only the plan that wins (:func:`baseline_drafts`); :func:`baseline_candidates`
builds them all.

Baselines run every crossing direct (NCCL p2p, each GPU through its own NIC):
each candidate is offered direct, and, where the run routes and the plan has a
ring across nodes, also routed (the only messages routing changes).  With the
remap forced on every batch (``remap_decided`` False) there are none: these
layouts do not remap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Plan, rings_by_ranks, ulysses_by_ranks
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.flexsp import MilpLimits, greedy_groups, one_pass_groups, seq_time_fn, ulysses_sizes
from megatron_zeppelin.planner.flexsp import group_layout as flexsp_layout
from megatron_zeppelin.planner.hybrid_cp import CpGroup, HybridCpPlanner, hybrid_cp_schedule, workload
from megatron_zeppelin.planner.hybrid_cp import group_layout as cp_layout
from megatron_zeppelin.planner.packing import check_lengths
from megatron_zeppelin.planner.plan_arrays import PlanArrays, Placements, has_inter_node_ring, layout_arrays, pack_rings
from megatron_zeppelin.planner.rounds import RoundsPlan, merge_rounds
from megatron_zeppelin.planner.static_groups import StaticGroupPlanner
from megatron_zeppelin.planner.te_cp import TeCpPlanner
from megatron_zeppelin.planner.ulysses_sp import UlyssesSpPlanner
from megatron_zeppelin.planner.zeppelin import ZeppelinPlanner
from megatron_zeppelin.topology import Topology

#: Static CP sizes tried (and Ulysses sizes beyond a node): a wider ring holds
#: the same tokens in more steps, so a user (and the simulator's layout
#: search, ``planner/te_cp.py: CP_SIZES_PER_TP``) stops after the first two
#: that fit.
STATIC_CP_SIZES = 2
#: Worlds of up to this many GPUs get every static Ulysses SP size the simulator
#: tries, FlexSP's MILP (its columns counted, :data:`FLEXSP_MILP`), hybrid CP's
#: round over the cap moved within it and its rounds as passes; larger ones
#: none: cutting 1,024 sequences into FlexSP's buckets alone took 26 ms of
#: the decision's 50 ms at 64 GPUs (where the MILP has 127 slots, well over its
#: column limit), and Ulysses groups across nodes 820 ms.
SMALL_WORLD_GPUS = 16


@dataclass
class Draft:
    """A baseline's one-pass layout of the batch, as columns; its placements and
    Plan (the linear layout equal to the attention layout, validated) are built
    on first use, so the decision builds only the plans it prices by them or runs."""

    strategy: str
    """The baseline that laid it out."""
    topology: Topology
    """The cluster's ranks."""
    seq_lens: tuple[int, ...]
    """The batch."""
    layout: Placements
    """Every sequence's placement, as columns."""
    token_cap: int
    """The per-GPU cap it holds."""
    built: Plan | None = field(default=None, repr=False)
    """The Plan once :meth:`plan` built it."""
    read: PlanArrays | None = field(default=None, repr=False)
    """Its plan's arrays once :meth:`arrays` read them."""
    unpacked: "Draft | None" = field(default=None, repr=False)
    """Set on a packed copy: the draft whose layout it runs with every ring rank
    tuple's sequences in one packed ring (``Plan.packed_rings``, TE's THD ring)
    and every Ulysses rank tuple's in one packed group (``Plan.packed_ulysses``,
    FlexSP's and DeepSpeed's all-to-all); its rings' arrays are derived from
    that draft's."""

    def plan(self) -> Plan:
        if self.built is None:
            built = merge_rounds(self.strategy, self.topology, self.seq_lens,
                                 [self.layout.build(self.seq_lens)], self.token_cap)
            if self.unpacked is not None:
                built = dataclasses.replace(built, packed_rings=rings_by_ranks(built.attention),
                                            packed_ulysses=ulysses_by_ranks(built.attention)).validate()
            self.built = built
        return self.built

    def candidate(self, routed: bool) -> Plan:
        """Its plan as Zeppelin's, ``routed`` or direct: relabelled, the engine
        runs it, and the replay times it, as Zeppelin's own."""
        return dataclasses.replace(self.plan(), strategy=ZeppelinPlanner.name, routed=routed)

    def arrays(self) -> PlanArrays:
        """Its plan's :func:`~megatron_zeppelin.planner.plan_arrays.plan_arrays`,
        read from the columns (the surrogate prices a draft without its plan)."""
        if self.read is None:
            w = self.topology.world_size
            if self.unpacked is None:
                self.read = layout_arrays(w, self.seq_lens, self.layout, None)
            elif (self.layout.mode == 2).any():          # Ulysses groups: packed from the columns
                self.read = pack_rings(layout_arrays(w, self.seq_lens, self.layout, None,
                                                     packed_ulysses=self.layout.ulysses_packs()))
            else:
                self.read = pack_rings(self.unpacked.arrays())
        return self.read

    def packs_any(self) -> bool:
        """Whether a packed copy packs anything (a ring or group of 2 or more)."""
        mine, theirs = self.arrays(), self.unpacked.arrays()
        return bool(mine.packed) or len(mine.group_len) < len(theirs.group_len)

    def tokens_per_rank(self) -> list[int]:
        """Every rank's tokens, in both layouts."""
        return self.linear_tokens().astype(np.int64).tolist()

    def linear_tokens(self) -> np.ndarray:
        """Every rank's tokens in the linear layout, the attention layout's (float64)."""
        return self.arrays().linear_tokens

    def crosses_nodes_in_a_ring(self) -> bool:
        """Whether routing changes any message of the plan: only rings route (an
        all-to-all and the remap it does not have run direct)."""
        return has_inter_node_ring(self.arrays(), self.topology.gpus_per_node)


def _draft(strategy: str, ctx: PlanContext, lens: tuple[int, ...], layout: Placements) -> Draft:
    return Draft(strategy, ctx.topology, lens, layout, ctx.tokens_per_gpu)


def uniform_cp_drafts(seq_lens: Sequence[int], ctx: PlanContext) -> list[Draft]:
    """Static CP's layouts that hold the batch in one pass: the smallest such CP
    size and the next (``c = 1``: every sequence whole on one rank), each as it
    is and, where a CP group rings several sequences, packed as TE packs them."""
    drafts = _static_drafts(TeCpPlanner(), seq_lens, ctx, sizes=_powers_of_two(1, ctx.topology.world_size),
                            keep=STATIC_CP_SIZES)
    return _with_packed_copies(drafts)


def _with_packed_copies(drafts: list[Draft]) -> list[Draft]:
    """``drafts`` and, where one runs several sequences in a ring or Ulysses
    group, its packed copy (the baseline runs them packed)."""
    packed = [dataclasses.replace(d, unpacked=d) for d in drafts]
    return drafts + [p for p in packed if p.packs_any()]


def static_ulysses_drafts(seq_lens: Sequence[int], ctx: PlanContext) -> list[Draft]:
    """Static Ulysses SP's layouts that hold the batch in one pass, at SP sizes
    of at least 2 dividing the KV heads (size 1 is :func:`uniform_cp_plans`'
    ``c = 1``): on up to :data:`SMALL_WORLD_GPUS` GPUs every such size, the
    sizes the simulator's layout search tries (``ulysses_sp.ulysses_layouts``;
    on 2 x 4 GPUs a group across both nodes beat every group within one by
    2.5 %); on larger worlds every such size up to a node -- a wider group is
    not always slower, a whole node's all-to-all beats two half-node groups on
    some batches -- and the two smallest beyond it when none fits a node.
    Wider groups across nodes are left out there: the engine runs one
    all-to-all per sequence, and pricing 32-rank groups of 1,024 sequences
    took the decision at 64 GPUs from 39 to 860 ms of CPU."""
    kv, gpn = ctx.local_heads[1], ctx.topology.gpus_per_node
    sizes = [d for d in _powers_of_two(2, ctx.topology.world_size) if kv % d == 0]
    if ctx.topology.world_size <= SMALL_WORLD_GPUS:
        return _with_packed_copies(_static_drafts(UlyssesSpPlanner(), seq_lens, ctx, sizes=sizes, keep=len(sizes)))
    in_node = _static_drafts(UlyssesSpPlanner(), seq_lens, ctx, sizes=[d for d in sizes if d <= gpn],
                             keep=len(sizes))
    return _with_packed_copies(in_node or _static_drafts(UlyssesSpPlanner(), seq_lens, ctx,
                                                         sizes=[d for d in sizes if d > gpn], keep=STATIC_CP_SIZES))


def hybrid_cp_drafts(seq_lens: Sequence[int], ctx: PlanContext) -> list[Draft]:
    """Megatron's hybrid CP schedule when it is one round: as it is where no rank
    holds more than the cap, else, on up to :data:`SMALL_WORLD_GPUS` GPUs, with
    the sub-samples that put a group over it moved to groups with room
    (:func:`sub_samples_within_cap`; pricing that candidate cost the decision
    8 ms of its 50 at 64 GPUs, where it won no pick of
    ``tests/planner/golden/decision_picks.json``)."""
    lens = check_lengths(seq_lens)
    cap = ctx.tokens_per_gpu
    try:
        # The first round says whether another follows: no need to schedule it.
        groups, more = next(hybrid_cp_schedule(lens, cap, ctx.topology.world_size), ([], False))
    except InfeasibleError:
        return []
    if more:
        return []
    draft = _draft(HybridCpPlanner.name, ctx, lens, cp_layout(groups, lens))
    if max(draft.tokens_per_rank(), default=0) > cap:
        if ctx.topology.world_size > SMALL_WORLD_GPUS:
            return []
        within = sub_samples_within_cap(groups, lens, cap)
        if within is None:
            return []
        draft = _draft(HybridCpPlanner.name, ctx, lens, cp_layout(within, lens))
    return [draft] if max(draft.tokens_per_rank(), default=0) <= cap else []


def sub_samples_within_cap(groups: Sequence[CpGroup], lens: Sequence[int], cap: int) -> list[CpGroup] | None:
    """A round of hybrid CP's groups with no rank over ``cap``: while a group's
    sub-samples (Megatron runs them one after another, each a micro-batch that
    holds the cap) hold more than ``cap`` tokens per rank together, its last
    (shortest) one moves to the least-loaded group (Megatron's workload) it fits.
    None when one fits nowhere.  Zeppelin's engine runs a batch in one pass
    under the cap, so it cannot run the round itself; the simulator times the
    round as one pass over the cap (docs/results/decision.md, "Containment")."""
    out = [CpGroup(g.size, list(g.seqs), g.load, g.first_rank) for g in groups]
    used = [sum(_rank_tokens(lens[s], g.size) for s in g.seqs) for g in out]
    for i, g in enumerate(out):
        while used[i] > cap and len(g.seqs) > 1:
            seq = g.seqs.pop()
            used[i] -= _rank_tokens(lens[seq], g.size)
            g.load -= workload(lens[seq], cap)
            room = [j for j, h in enumerate(out) if j != i and used[j] + _rank_tokens(lens[seq], h.size) <= cap]
            if not room:
                return None
            j = min(room, key=lambda j: (out[j].load, j))
            out[j].seqs.append(seq)
            used[j] += _rank_tokens(lens[seq], out[j].size)
            out[j].load += workload(lens[seq], cap)
        if used[i] > cap:
            return None
    return out


def _rank_tokens(length: int, size: int) -> int:
    """The most tokens a rank of a group of ``size`` holds of one sequence
    (zigzag: two of ``2 size`` chunks; local on the first rank when shorter
    than ``2 size``: ``hybrid_cp.group_layout``)."""
    return length if size == 1 or length < 2 * size else 2 * -(-length // (2 * size))


def hybrid_cp_passes(seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan | None:
    """Megatron's hybrid CP schedule of several rounds, each within the cap, as
    Zeppelin's passes (each round a pass; relabelled, direct, capped); None for
    one round (:func:`hybrid_cp_drafts`), a round over the cap (its
    sub-samples, one after another, are what holds the cap: Zeppelin would run
    each as a pass, with the trainer's barrier between passes), more than
    :data:`SMALL_WORLD_GPUS` GPUs (the decision times it by the replay), or the
    remap forced on.  The simulator times hybrid CP as these very rounds."""
    lens = check_lengths(seq_lens)
    cap = ctx.tokens_per_gpu
    if ctx.topology.world_size > SMALL_WORLD_GPUS or (ctx.remap_enabled and not ctx.remap_decided):
        return None
    try:
        rounds = HybridCpPlanner().plan_rounds(lens, ctx)
    except InfeasibleError:
        return None
    return _as_passes(rounds, cap, packed=False)


def static_passes(seq_lens: Sequence[int], ctx: PlanContext) -> list[RoundsPlan]:
    """Static Ulysses SP's and static CP's schedules of several passes -- what
    they run where a batch does not fit one pass of their smallest group that
    holds the longest sequence (the size the simulator's layout search keeps
    there) -- as Zeppelin's passes, each group's sequences packed as they run
    them (relabelled, direct, capped).  One-pass layouts are
    :func:`baseline_drafts`'; none above :data:`MAX_SEQUENCES_ALL_SOURCES`
    sequences (each schedule is replayed to be compared) or with the remap
    forced on."""
    lens = check_lengths(seq_lens)
    if len(lens) > MAX_SEQUENCES_ALL_SOURCES or (ctx.remap_enabled and not ctx.remap_decided):
        return []
    out = []
    smallest = dataclasses.replace(ctx, cp_size=None)
    for planner in (UlyssesSpPlanner(), TeCpPlanner()):
        try:
            if planner.one_pass(lens, smallest) is not None:
                continue        # one pass: a draft of baseline_drafts (and cheaper to find than the rounds)
            rounds = planner.plan_rounds(lens, smallest)
        except InfeasibleError:
            continue
        passes = _as_passes(rounds, ctx.tokens_per_gpu, packed=True)
        if passes is not None:
            out.append(passes)
    return out


def _as_passes(rounds: RoundsPlan, cap: int, packed: bool) -> RoundsPlan | None:
    """A baseline's rounds as Zeppelin's passes (relabelled, direct, capped;
    ``packed``: each ring's and Ulysses group's sequences on the same ranks
    packed, as TE and DeepSpeed-Ulysses run them), or None for one round or a
    round over the cap."""
    if len(rounds.rounds) == 1 or any(max(r.attention_tokens_per_rank()) > cap for r in rounds.rounds):
        return None
    mine = dict(strategy=ZeppelinPlanner.name, routed=False)

    def packs(plan: Plan) -> dict:
        return dict(packed_rings=rings_by_ranks(plan.attention), packed_ulysses=ulysses_by_ranks(plan.attention)) \
            if packed else {}
    return RoundsPlan(dataclasses.replace(rounds.merged, **mine).validate(),
                      tuple(dataclasses.replace(r, token_cap=cap, **mine, **packs(r)).validate()
                            for r in rounds.rounds))


def flexsp_greedy_drafts(seq_lens: Sequence[int], ctx: PlanContext) -> list[Draft]:
    """FlexSP's heterogeneous Ulysses groups by its greedy, on the real lengths,
    when they hold the batch in one pass."""
    lens = check_lengths(seq_lens)
    cap, topo = ctx.tokens_per_gpu, ctx.topology
    sizes = ulysses_sizes(topo.world_size, ctx.local_heads[1])
    groups = greedy_groups(lens, lens, sizes, topo.world_size, cap, seq_time_fn(ctx.cost).column)
    if groups is None:
        return []
    # Shortest first in each group, as FlexSP's MILP assigns them (buckets in
    # ascending order): the engine posts a group's all-to-alls in placement
    # order, and a short sequence's arrives, and its compute starts, while a
    # long one's is still in flight.
    shortest_first = [(d, sorted(members, key=lambda i: (lens[i], i))) for d, members in groups]
    return _with_packed_copies([_draft("flexsp", ctx, lens, flexsp_layout(shortest_first, range(len(lens))))])


#: FlexSP's MILP as the decision solves it: no time limit (where one stops a
#: solve, the incumbent depends on the machine's speed, and every rank plans
#: alike), a node limit, and only MILPs of at most this many columns (its size:
#: group slots x the length buckets each may hold).  On the property test's
#: batches (2-16 GPUs) the MILPs have up to 283 columns and solve in 2 ms of
#: CPU (median) to 0.3 s; 128 sequences on 8 GPUs (391 columns) took 0.86 s.
#: At 64 GPUs and 64 sequences FlexSP's MILP took 2 s, at 1,024 sequences it ran
#: into a 5 s limit (docs/results/decision.md, "Containment").
FLEXSP_MILP = MilpLimits(time_limit_s=float("inf"), max_nodes=2000, max_columns=400)



def flexsp_drafts(seq_lens: Sequence[int], ctx: PlanContext) -> list[Draft]:
    """FlexSP's own plan of a batch it runs in one pass (its grouping by the
    MILP, started from the greedy, or the greedy where that models faster:
    ``flexsp.one_pass_groups``, what ``FlexSpPlanner`` runs), in its order,
    when its MILP is small enough (:data:`FLEXSP_MILP`, :data:`SMALL_WORLD_GPUS`).
    Where FlexSP's own solve also ends before its time limit, this is the
    very plan the simulator's ``flexsp`` runs."""
    lens = check_lengths(seq_lens)
    cap, topo = ctx.tokens_per_gpu, ctx.topology
    sizes = ulysses_sizes(topo.world_size, ctx.local_heads[1])
    if topo.world_size > SMALL_WORLD_GPUS:
        return []
    if sum(lens) > topo.world_size * cap or any(-(-L // sizes[-1]) > cap for L in lens):
        return []       # FlexSP splits it into micro-batches, or cannot place it
    # Priced as FlexSP plans it: direct crossings (its all-to-alls do not route).
    groups = one_pass_groups(lens, sizes, topo.world_size, cap, ctx.cost.routed(False), FLEXSP_MILP)
    if groups is None:
        return []
    return _with_packed_copies([_draft("flexsp", ctx, lens, flexsp_layout(groups, range(len(lens))))])


#: Every source of candidates (``benchmarks/containment.py --latency`` times each).
SOURCES: dict[str, Callable[[Sequence[int], PlanContext], list[Draft]]] = {
    "te_cp": uniform_cp_drafts,
    "ulysses_sp": static_ulysses_drafts,
    "megatron_hybrid_cp": hybrid_cp_drafts,
    "flexsp_greedy": flexsp_greedy_drafts,
    "flexsp_milp": flexsp_drafts,
}
#: Batches of more sequences get static CP's layouts only (as before these
#: candidates existed).  Building a baseline's Plan costs about 0.05 ms of CPU
#: per sequence and plan (every placement's shards, then ``Plan.validate``), and
#: FlexSP's greedy grows with sequences x groups: on 16,384 sequences over
#: 1,024 GPUs the other sources took 1.6 s (Ulysses SP, 2 plans), 1.5 s (hybrid
#: CP, no plan) and 20 s (FlexSP's greedy) of CPU, against the decision's 500 ms
#: (``benchmarks/containment.py --latency``).
MAX_SEQUENCES_ALL_SOURCES = 1024


def baseline_candidates(seq_lens: Sequence[int], ctx: PlanContext) -> list[Plan]:
    """Every source's plans as Zeppelin's (static CP's alone above
    :data:`MAX_SEQUENCES_ALL_SOURCES` sequences), each distinct layout once,
    direct and (see the module docstring) routed; none when the remap is
    forced on."""
    return [draft.candidate(routed) for draft, routed in baseline_drafts(seq_lens, ctx)]


def baseline_drafts(seq_lens: Sequence[int], ctx: PlanContext) -> list[tuple[Draft, bool]]:
    """:func:`baseline_candidates` before their plans are built: each candidate's
    draft and whether it runs routed (:meth:`Draft.candidate` builds it)."""
    if ctx.remap_enabled and not ctx.remap_decided:
        return []
    layouts: list[Draft] = []
    sources = SOURCES.values() if len(seq_lens) <= MAX_SEQUENCES_ALL_SOURCES else (uniform_cp_drafts,)
    for source in sources:
        for draft in source(seq_lens, ctx):
            if not any((draft.unpacked is None) == (kept.unpacked is None) and draft.layout.same(kept.layout)
                       for kept in layouts):
                layouts.append(draft)
    out = []
    for draft in layouts:
        if ctx.cost.routing and draft.crosses_nodes_in_a_ring():
            out.append((draft, True))
        out.append((draft, False))
    return out


def _static_drafts(planner: StaticGroupPlanner, seq_lens: Sequence[int], ctx: PlanContext,
                   sizes: Sequence[int], keep: int) -> list[Draft]:
    """``planner``'s layouts at the first ``keep`` of ``sizes`` that hold the
    longest sequence and the whole batch in one pass."""
    world, cap = ctx.topology.world_size, ctx.tokens_per_gpu
    lens = check_lengths(seq_lens)
    longest = max(lens, default=1)
    out = []
    for size in sizes:
        if len(out) == keep:
            break
        if world % size or -(-longest // size) > cap:
            continue
        try:
            layout = planner.one_pass(lens, dataclasses.replace(ctx, cp_size=size))
        except InfeasibleError:
            continue
        if layout is not None:
            out.append(_draft(planner.name, ctx, lens, layout))
    return out


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, d = [], lo
    while d <= hi:
        out.append(d)
        d *= 2
    return out
