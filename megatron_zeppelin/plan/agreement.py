"""Proving that every rank computed the same Plan.

Each rank plans independently (deterministic planners); one tiny all-reduce of
the plan's fingerprint catches a rank that saw other data or flags before it
corrupts a step.  The reduction is passed in, so this stays pure.
"""

from __future__ import annotations

from typing import Callable, Sequence

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan.plan import Plan

AllReduceMax = Callable[[Sequence[int]], Sequence[int]]
"""All-reduce (MAX) of a few integers over every rank."""


class PlanMismatchError(PlanError):
    """Ranks computed different Plans for the same global batch."""


def check_same_plan(plan: Plan, batch_index: int, all_reduce_max: AllReduceMax) -> None:
    """Raise :class:`PlanMismatchError` unless every rank holds ``plan``.

    One all-reduce of ``[f, -f]`` with MAX gives ``max f`` and ``-min f``; they are
    equal exactly when every rank has the same fingerprint ``f``.
    """
    fp = plan.fingerprint()
    hi, neg_lo = all_reduce_max([fp, -fp])
    if hi != fp or -neg_lo != fp:
        raise PlanMismatchError(
            f"ranks computed different Plans for global batch {batch_index} (fingerprints from {-neg_lo} "
            f"to {hi}, this rank {fp}); every rank must see the same data and flags: check that "
            "the data files, --seed, the sequence length, the zeppelin flags and the megatron-zeppelin "
            "version are identical on every node")
