"""The forward/backward passes a strategy runs one batch as.

Most planners hold a batch in one pass.  The static baselines and FlexSP
cannot always: ``plan_rounds`` (``planner/rounds.py``) gives one Plan per
micro-batch -- te_cp and ulysses_sp pass what their fixed groups cannot hold
to a second pass, FlexSP's sequence blaster splits an oversized batch,
Megatron's hybrid CP runs its sub-sample rounds with a barrier after each.
The trainer runs each round as a micro-batch of its own (gradients accumulate,
one all-reduce per step), as those systems do, so the per-GPU token cap holds
in every pass instead of for a merged plan that stacks every round on the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.base import PlanContext, Planner
from megatron_zeppelin.sim.rounds import plan_batch


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
        return [Pass(tuple(range(len(seq_lens))), rounds[0])]
    # The merged plan lists every round's placements in round order, and each
    # round renumbers its sequences in placement order (planner/rounds.py).
    placements = iter(merged.attention)
    passes = [Pass(tuple(next(placements).seq for _ in r.attention), r) for r in rounds]
    for p in passes:
        if p.plan.seq_lens != tuple(seq_lens[s] for s in p.seqs):
            raise PlanError(f"{merged.strategy}: a round's sequences do not match the merged plan's placements")
    return passes
