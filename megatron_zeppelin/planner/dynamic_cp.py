"""``megatron_dynamic_cp``: Megatron-LM's dynamic context parallelism.

Follows ``DefaultDynamicCPScheduler`` on Megatron-LM's ``dev`` branch
(``megatron/core/datasets/data_schedule.py``, with
``next_hdp_group_packing_aware`` and ``dcp_gpus_needed`` in
``megatron/core/datasets/data_schedule_utils.py``; read at dev commit
d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1, 2026-08-21), enabled by
``--dynamic-context-parallel`` (``--sequence-packing-scheduler
default_dynamic_cp``) with ``--max-seqlen-per-dp-cp-rank`` = our
``tokens_per_gpu`` and ``--min-dynamic-context-parallel-size`` 1 (its default):

* the global batch is re-packed into micro-batches over all DP x CP ranks; a
  micro-batch gives every rank one CP group of a power-of-two size, and the
  group runs all its sequences packed (THD), each zigzag-split over it;
* a sequence of length ``L`` needs ``cp >= 2**ceil(log2(L / cap))`` ranks; its
  per-rank work estimate is ``L**2 / cp`` (no communication term);
* a micro-batch is built longest first: the first sequence opens a group of its
  minimal size; every next one tries each power-of-two size from its minimal
  one up, adding to an existing group of that size (if the group's tokens per
  rank, ``sum(L / cp)``, stay within the cap) or opening a new group on free
  ranks, and takes the option with the lowest projected busiest-rank work that
  stays within ``tallest * cap * 1.05``; a sequence with no such option waits
  for a later micro-batch;
* idle ranks are then filled by doubling the first smallest group (shifting the
  groups after it); if no group can grow, the micro-batch is instead the whole
  DP x CP world as one group, packed longest first up to the cap.

Micro-batches run one after another (gradient accumulation; with PP, through
1F1B), so the simulator times them as rounds (``planner/rounds.py``).  As for
``megatron_hybrid_cp`` (whose group layout and placements this reuses), the
scheduler opens groups on the lowest free ranks while the process groups
Megatron then runs them on (``create_dynamic_dp_cp_groups``) are aligned
blocks: we keep the scheduler's decisions and lay each micro-batch's groups out
largest first, which makes every group an aligned block.  Sequences are not
padded to ``2 * cp`` (a Plan has no padding).
"""

from __future__ import annotations

from typing import Sequence

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.hybrid_cp import CpGroup, check_groups_fit, gpus_needed, group_placements, lay_out
from megatron_zeppelin.planner.packing import check_lengths
from megatron_zeppelin.planner.rounds import MergedRounds, RoundsPlan, build_rounds

#: ``_DYNAMIC_CP_WORKLOAD_CAP_DELTA``: slack over ``tallest * cap`` a rank's work may reach.
WORKLOAD_CAP_DELTA = 0.05

Sample = tuple[int, int]   # (sequence index, length)


def _work(length: int, cp: int) -> float:
    return length * length / cp


def _open(groups: list[CpGroup], size: int, seq: int, length: int) -> None:
    groups.append(CpGroup(size, [seq], _work(length, size), tokens=length / size))


def next_micro_batch(samples: Sequence[Sample], world: int, cap: int, min_cp: int = 1
                     ) -> tuple[list[CpGroup], list[Sample]]:
    """``next_hdp_group_packing_aware``: one micro-batch's groups (in rank
    order, before :func:`lay_out`) and the samples left for later ones."""
    samples = sorted(samples, key=lambda s: s[1], reverse=True)
    limit = float(samples[0][1]) * float(cap) * (1.0 + WORKLOAD_CAP_DELTA)
    needed = [max(min_cp, gpus_needed(L, cap)) for _, L in samples]
    groups: list[CpGroup] = []
    _open(groups, needed[0], *samples[0])
    leftovers = []
    for (seq, L), cp in zip(samples[1:], needed[1:]):
        best = None     # (projected busiest-rank work, group to add to or None, size)
        while cp <= world:
            work = _work(L, cp)
            for g in groups:
                if g.size != cp or g.tokens + L / cp > cap:
                    continue
                projected = max([h.load for h in groups if h is not g] + [g.load + work])
                if projected <= limit and (best is None or projected < best[0]):
                    best = (projected, g, cp)
            if world - sum(g.size for g in groups) >= cp:
                # Free ranks carry no work yet.
                projected = max([h.load for h in groups] + [work])
                if projected <= limit and (best is None or projected < best[0]):
                    best = (projected, None, cp)
            cp *= 2
        if best is None:
            leftovers.append((seq, L))
            continue
        _, group, size = best
        if group is None:
            _open(groups, size, seq, L)
        else:
            group.seqs.append(seq)
            group.load += _work(L, size)
            group.tokens += L / size
    while sum(g.size for g in groups) < world:
        if not _grow_smallest(groups, world, {seq: L for seq, L in samples}):
            return _whole_world(samples, world, cap)
    return groups, leftovers


def _grow_smallest(groups: list[CpGroup], world: int, lens: dict[int, int]) -> bool:
    """``fill_empty_gpus_once``: double the first group of the smallest size
    that can grow without passing the last rank; False if none can."""
    smallest = min(g.size for g in groups)
    grown = min(2 * smallest, world)
    start = 0
    for g in groups:
        if g.size == smallest and start + grown <= world:
            if sum(h.size for h in groups) + grown - smallest > world:
                # Megatron would shift the later groups past the last rank.
                raise InfeasibleError(f"megatron_dynamic_cp: {world} DP x CP ranks cannot be filled with "
                                      "power-of-two CP groups; use a DP x CP size that is a power of two")
            g.size = grown
            g.load = sum(_work(lens[s], grown) for s in g.seqs)
            g.tokens = sum(lens[s] / grown for s in g.seqs)
            return True
        start += g.size
    return False


def _whole_world(samples: list[Sample], world: int, cap: int) -> tuple[list[CpGroup], list[Sample]]:
    """``fill_with_full_dpxcp_group``: the micro-batch is one group of every rank
    holding the longest samples that fit the cap (the rest wait)."""
    group, rest = CpGroup(world), []
    for seq, L in samples:
        if group.tokens + L / world <= cap:
            group.seqs.append(seq)
            group.load += _work(L, world)
            group.tokens += L / world
        else:
            rest.append((seq, L))
    return [group], rest


def dynamic_cp_micro_batches(seq_lens: Sequence[int], tokens_per_gpu: int, world_size: int,
                             min_cp: int = 1) -> list[list[CpGroup]]:
    """``DefaultDynamicCPScheduler.get_groups_and_subsamples``: the micro-batches
    of one global batch, each a list of aligned CP groups."""
    lens = check_lengths(seq_lens)
    check_groups_fit("megatron_dynamic_cp", lens, tokens_per_gpu, world_size, "the DP x CP world", min_cp)
    samples: list[Sample] = list(enumerate(lens))
    out = []
    while samples:
        groups, samples = next_micro_batch(samples, world_size, tokens_per_gpu, min_cp)
        out.append(lay_out(groups))
    return out


class DynamicCpPlanner(MergedRounds):
    """Power-of-two CP groups per micro-batch from Megatron-LM's dynamic-CP scheduler."""

    name = "megatron_dynamic_cp"
    #: It cuts the whole global batch into its micro-batches (``sim/rounds.py: batch_groups``).
    schedules_global_batch = True

    def plan_rounds(self, seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan:
        lens = check_lengths(seq_lens)
        rounds = [group_placements(groups, lens) for groups in
                  dynamic_cp_micro_batches(lens, ctx.tokens_per_gpu, ctx.topology.world_size)]
        return build_rounds(self.name, ctx.topology, lens, rounds, None)
