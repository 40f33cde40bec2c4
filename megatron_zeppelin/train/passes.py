"""The forward/backward passes a strategy runs one batch as.

Most planners hold a batch in one pass.  The static baselines and FlexSP
cannot always: ``plan_rounds`` (``planner/rounds.py``) gives one Plan per
micro-batch -- te_cp and ulysses_sp pass what their fixed groups cannot hold
to a second pass, FlexSP's sequence blaster splits an oversized batch,
Megatron's hybrid CP runs its sub-sample rounds with a barrier after each,
and inside a round each group's sub-samples one after another.
The trainer runs each round (hybrid CP: each sub-sample) as a micro-batch of
its own (gradients accumulate, one all-reduce per step), as those systems do,
so the per-GPU token cap holds in every pass instead of for a merged plan that
stacks every round on the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan import Plan, SeqPlacement
from megatron_zeppelin.planner.base import PlanContext, Planner
from megatron_zeppelin.planner.hybrid_cp import HybridCpPlanner
from megatron_zeppelin.planner.rounds import round_plan
from megatron_zeppelin.sim.rounds import plan_batch
from megatron_zeppelin.topology import Topology

HYBRID_CP = HybridCpPlanner.name


@dataclass(frozen=True)
class Pass:
    """One forward/backward pass over some sequences of a batch."""

    seqs: tuple[int, ...]
    """Indices into the planned lengths: sequence ``i`` of ``plan`` is ``seqs[i]``."""
    plan: Plan
    """Plan of those sequences only (indices renumbered from 0)."""


def planned_passes(planner: Planner, seq_lens: Sequence[int], ctx: PlanContext) -> list[Pass]:
    """The passes ``planner`` runs ``seq_lens`` as, in execution order."""
    merged, rounds = plan_batch(planner, list(seq_lens), ctx)
    if len(rounds) == 1:
        passes = [Pass(tuple(range(len(seq_lens))), rounds[0])]
    else:
        # The merged plan lists every round's placements in round order, and each
        # round renumbers its sequences in placement order (planner/rounds.py).
        placements = iter(merged.attention)
        passes = [Pass(tuple(next(placements).seq for _ in r.attention), r) for r in rounds]
        for p in passes:
            if p.plan.seq_lens != tuple(seq_lens[s] for s in p.seqs):
                raise PlanError(f"{merged.strategy}: a round's sequences do not match the merged plan's placements")
    if planner.name == HYBRID_CP:
        return [q for p in passes for q in sub_sample_passes(p, ctx.topology)]
    return passes


def sub_sample_passes(round_pass: Pass, topo: Topology) -> list[Pass]:
    """Megatron's hybrid CP runs each CP group's sub-samples one after another,
    each a micro-batch of its own: pass ``k`` of a round holds the ``k``-th
    sub-sample of every group (a group's placements come in execution order and
    all start at its first rank, ``planner/hybrid_cp.py``)."""
    plan = round_pass.plan
    groups: dict[int, list[SeqPlacement]] = {}
    for q in plan.attention:
        groups.setdefault(q.ranks[0], []).append(q)
    depth = max(len(g) for g in groups.values())
    if depth == 1:
        return [round_pass]
    out = []
    for k in range(depth):
        attention = [g[k] for g in groups.values() if k < len(g)]
        out.append(Pass(tuple(round_pass.seqs[q.seq] for q in attention),
                        round_plan(plan.strategy, topo, plan.seq_lens, attention, plan.token_cap)))
    return out
