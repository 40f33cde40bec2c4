"""``megatron_hybrid_cp``: Megatron-Core's hybrid (dynamic) context parallelism.

Follows ``BalancedCPScheduler`` in megatron-core 0.16
(``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``), enabled by
``--hybrid-context-parallel`` with ``max_seqlen_per_dp_cp_rank`` = our
``tokens_per_gpu``:

* a sub-sample of length ``L`` needs ``cp = max(1, 2**ceil(log2(L / cap)))``
  ranks (``gpus_needed``); its workload estimate is ``L**2 / cp``
  (``get_total_workload``);
* the DP x CP ranks are scheduled in *rounds* (Megatron calls them groups; a
  barrier separates them): each round opens CP groups from free ranks, assigns
  sub-samples longest first to a new group or the least-loaded group of the
  right size, stops early once balanced, trims overload, then doubles the
  smallest groups until no rank is idle (``next_hdp_group``);
* each rank runs its sub-samples one after another as separate micro-batches,
  each zigzag-split over its group (``get_batch_on_this_hybrid_cp_rank``).

One deliberate difference: Megatron places a new group on the lowest free ranks,
but the process groups it then uses (``create_hybrid_dp_cp_groups``) are aligned
blocks ``[i*cp, (i+1)*cp)``.  We keep the scheduler's decisions (which depend on
group sizes and loads, not rank ids) and lay each round's groups out largest
first, so every group is exactly one of those aligned blocks.

Because sub-samples are separate micro-batches, memory holds one at a time
(``L / cp <= cap`` by construction) while a rank's step total may exceed the
cap: the Plan carries no ``token_cap``.  Round boundaries are barriers:
``plan_rounds`` gives one Plan per round and the simulator adds them up.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import chain
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator, Sequence

import numpy as np

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode, SeqPlacement
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.packing import check_lengths
from megatron_zeppelin.planner.plan_arrays import MODE_CODE, Placements
from megatron_zeppelin.planner.rounds import MergedRounds, RoundsPlan, build_rounds

#: ``next_hdp_group`` defaults: balance slack (5 %) and bucket overshoot (10 %).
BALANCE_DELTA = 0.05
BUCKET_OVERSHOOT = 1.1


@dataclass
class CpGroup:
    """One CP group of a round: ``size`` consecutive ranks sharing its sub-samples."""

    size: int
    """Ranks in the group (a power of two, or the whole DP x CP world)."""
    seqs: list[int] = field(default_factory=list)
    """Sub-samples (sequence indices) in execution order."""
    load: float = 0.0
    """Scheduler workload estimate: sum of ``L**2 / gpus_needed(L)``."""
    first_rank: int = 0
    """First rank, set when the round is laid out."""
    tokens: float = 0.0
    """Tokens per rank, ``sum(L / size)`` (dynamic CP's packing bound; unused here)."""


# Cached: the scheduler asks it of every bucket's head at every step (thousands
# of times a batch), and batches repeat lengths.
@lru_cache(maxsize=1 << 16)
def gpus_needed(length: int, cap: int) -> int:
    """``BalancedCPScheduler.gpus_needed``: next power of two of ``length / cap``."""
    return max(1, 2 ** math.ceil(math.log2(length / cap)))


def check_groups_fit(name: str, lens: Sequence[int], tokens_per_gpu: int, world_size: int, world: str,
                     min_cp: int = 1) -> None:
    """Raise :class:`InfeasibleError` for the first sequence whose CP group (at
    least ``min_cp`` ranks) would be wider than ``world_size``."""
    for seq, L in enumerate(lens):
        if max(min_cp, gpus_needed(L, tokens_per_gpu)) > world_size:
            raise InfeasibleError(
                f"{name}: sequence {seq} ({L} tokens) needs {gpus_needed(L, tokens_per_gpu)} ranks at "
                f"{tokens_per_gpu} tokens per GPU, {world} has {world_size}; raise --tokens-per-gpu or add nodes")


def lay_out(groups: list[CpGroup]) -> list[CpGroup]:
    """Place a round's groups largest first: prefix sums of descending powers of
    two are aligned offsets, so each group is one of Megatron's aligned process
    groups ``[i*cp, (i+1)*cp)``."""
    groups.sort(key=lambda g: -g.size)
    offset = 0
    for g in groups:
        g.first_rank, offset = offset, offset + g.size
    return groups


def group_placements(groups: Sequence[CpGroup], lens: Sequence[int]) -> list[SeqPlacement]:
    """Each group's sequences zigzag-split over its ranks (a ring).  Megatron pads
    a sequence shorter than ``2*cp`` tokens; a Plan cannot, so such a
    (negligible) sequence runs on the group's first rank."""
    return list(group_layout(groups, lens).build(lens))


def group_layout(groups: Sequence[CpGroup], lens: Sequence[int]) -> Placements:
    """:func:`group_placements` as columns (the per-batch decision builds the
    placements of only the candidates it runs)."""
    seq = np.fromiter(chain.from_iterable(g.seqs for g in groups), np.int64)
    count = [len(g.seqs) for g in groups]
    first = np.repeat([g.first_rank for g in groups], count).astype(np.int64)
    size = np.repeat([g.size for g in groups], count).astype(np.int64)
    local = (size == 1) | (np.asarray(lens, np.int64)[seq] < 2 * size)
    return Placements.of_blocks(seq, np.where(local, 0, MODE_CODE[Mode.RING]), first, np.where(local, 1, size))


def workload(length: int, cap: int) -> float:
    """``get_total_workload`` of one sub-sample: ``L**2 / gpus_needed(L)``."""
    return length * length / gpus_needed(length, cap)


def _make_buckets(samples: list[tuple[int, int]], cap: int) -> list[deque]:
    """``make_buckets_equal``: as many buckets as distinct CP sizes, cut in order
    when a bucket would pass 110 % of the mean work or later buckets would starve
    (Megatron's bookkeeping, including its double count of closed buckets)."""
    k = len({gpus_needed(L, cap) for _, L in samples})
    target = sum(workload(L, cap) for _, L in samples) / k
    buckets: list[deque] = []
    cur: list[tuple[int, int]] = []
    cur_work, remaining_k = 0.0, k
    for i, (seq, L) in enumerate(samples):
        work = workload(L, cap)
        if cur and (cur_work + work > target * BUCKET_OVERSHOOT
                    or len(samples) - i <= remaining_k - len(buckets)):
            buckets.append(deque(cur))
            cur, cur_work = [], 0.0
            remaining_k -= 1
        cur.append((seq, L))
        cur_work += work
    if cur:
        buckets.append(deque(cur))
    return buckets


def _next_round(samples: list[tuple[int, int]], lens: Sequence[int], cap: int, world: int
                ) -> tuple[list[CpGroup], list[tuple[int, int]]]:
    """``next_hdp_group`` on abstract groups: returns the round and the leftovers."""
    buckets = _make_buckets(samples, cap)
    groups: list[CpGroup] = []
    first_needed, check_balance = None, False

    def free() -> int:
        return world - sum(g.size for g in groups)

    def slack() -> tuple[float, float]:
        hi = max((g.load for g in groups), default=0.0)
        lo = 0.0 if free() else min(g.load for g in groups)
        return hi, hi - lo

    # The loop keeps its sums as it goes (a scan of every group per sub-sample
    # cost most of the decision's hybrid CP candidate): ranks used, the groups
    # of each size by (load, creation order) in a heap, the highest load (loads
    # only grow here).
    used, top = 0, 0.0
    by_size: dict[int, list[tuple[float, int, CpGroup]]] = {}
    while buckets:
        pick = None
        for idx, bucket in enumerate(buckets):
            if not bucket:
                continue
            needed = gpus_needed(bucket[0][1], cap)
            if by_size.get(needed) or world - used >= needed:
                pick = idx
                break
        if pick is None:
            break
        seq, L = buckets[pick].popleft()
        needed = gpus_needed(L, cap)
        first_needed = needed if first_needed is None else first_needed
        same = by_size.setdefault(needed, [])
        # The least loaded group of the size (the first of them) takes it; a fresh
        # group starts at load 0, so it wins whenever enough ranks are free.
        if world - used >= needed and (not same or same[0][2].load > 0):
            best, order = CpGroup(needed), len(groups)
            groups.append(best)
            used += needed
        else:
            _, order, best = heapq.heappop(same)
        best.seqs.append(seq)
        best.load += workload(L, cap)
        heapq.heappush(same, (best.load, order, best))
        top = max(top, best.load)
        while buckets and not buckets[0]:
            buckets.pop(0)
        if needed < first_needed:
            check_balance = True
        if check_balance and buckets:
            gap = top - (0.0 if world - used else min(heap[0][0] for heap in by_size.values() if heap))
            if gap <= BALANCE_DELTA * top:
                break
    leftovers = [s for b in buckets for s in b]

    # trim_overload: drop the last sub-sample of the most loaded group while that helps.
    while True:
        hi, gap = slack()
        if gap <= BALANCE_DELTA * hi or free():  # idle ranks: fill_empty_gpus' job
            break
        top = next(g for g in groups if g.load == hi)
        if len(top.seqs) <= 1:
            break
        work = workload(lens[top.seqs[-1]], cap)
        loads = [g.load - work if g is top else g.load for g in groups]
        if max(loads) - min(loads) >= gap:
            break
        top.load -= work
        last = top.seqs.pop()
        leftovers.append((last, lens[last]))

    # fill_empty_gpus: double the first smallest group until no rank idles.
    while free():
        small = min(g.size for g in groups)
        grow = min(2 * small, world) - small
        if grow > free():
            raise InfeasibleError(f"megatron_hybrid_cp: {free()} idle ranks cannot grow a CP group "
                                  f"of {small}; use a DP x CP size that is a power of two")
        next(g for g in groups if g.size == small).size += grow
    return groups, leftovers


def hybrid_cp_rounds(seq_lens: Sequence[int], tokens_per_gpu: int, world_size: int
                     ) -> list[list[CpGroup]]:
    """Megatron's schedule of one global batch: rounds of aligned CP groups
    (``get_groups_and_subsamples``).  A round ends with a barrier over all ranks,
    so a step takes the sum over rounds of the slowest group's time."""
    return [groups for groups, _ in hybrid_cp_schedule(seq_lens, tokens_per_gpu, world_size)]


def hybrid_cp_schedule(seq_lens: Sequence[int], tokens_per_gpu: int, world_size: int
                       ) -> Iterator[tuple[list[CpGroup], bool]]:
    """:func:`hybrid_cp_rounds` one round at a time, each with whether another
    follows (a caller that needs the first round only does not schedule the rest)."""
    lens = check_lengths(seq_lens)
    check_groups_fit("megatron_hybrid_cp", lens, tokens_per_gpu, world_size, "the world")
    samples = sorted(enumerate(lens), key=lambda s: -s[1])
    while samples:
        groups, samples = _next_round(samples, lens, tokens_per_gpu, world_size)
        yield lay_out(groups), bool(samples)


class HybridCpPlanner(MergedRounds):
    """Per-sequence power-of-two CP groups from Megatron's BalancedCPScheduler,
    in rounds with a barrier after each (:mod:`~megatron_zeppelin.planner.rounds`)."""

    name = "megatron_hybrid_cp"
    #: Megatron-Core 0.16's argument check (``megatron/training/arguments.py``) asserts
    #: ``not args.pipeline_model_parallel_size > 1`` with ``--hybrid-context-parallel``.
    refuses_pipeline = "Megatron-Core 0.16 refuses --hybrid-context-parallel with pipeline parallelism"

    def plan_rounds(self, seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan:
        lens = check_lengths(seq_lens)
        return build_rounds(self.name, ctx.topology, lens, self._rounds(lens, ctx), None)

    def _rounds(self, lens: tuple[int, ...], ctx: PlanContext) -> list[list[SeqPlacement]]:
        return [group_placements(groups, lens)
                for groups in hybrid_cp_rounds(lens, ctx.tokens_per_gpu, ctx.topology.world_size)]
