"""Exact answer to 'does any Plan hold this batch under the token cap?' (tests only).

A small integer program (HiGHS) over every placement a Plan can hold
(``Plan.validate``): each sequence local on one rank, a zigzag ring of ``k``
ranks or a Ulysses group of ``d`` ranks (``d`` dividing the heads), with its
shard sizes and any rank order; every rank's attention tokens at most the
cap.  The linear layout never binds: with remap the token-balanced layout
fits whenever the batch does, without it the layout is the attention one.
Ranks are interchangeable, so the shards of one size of a group are one
column per rank (not one per shard), and the longest sequence's placement is
pinned to the first ranks.  Seconds at 16 ranks and ~20 sequences: for
checking a planner's failure, not for planning.
"""

from __future__ import annotations

from typing import Sequence

import highspy
import numpy as np

from megatron_zeppelin.plan.shards import contiguous_shards
from megatron_zeppelin.planner.zeppelin import zigzag_shard_tokens


def shard_choices(length: int, cap: int, world: int, ulysses_sizes: Sequence[int]) -> list[np.ndarray]:
    """Tokens per rank of every placement of one sequence whose shards fit the cap."""
    out = [np.array([length])] if length <= cap else []
    for k in range(2, min(world, length // 2) + 1):
        out.append(zigzag_shard_tokens(length, k))
        if k in ulysses_sizes:
            out.append(np.array([e - s for ((s, e),) in contiguous_shards(length, k)]))
    return [s for s in out if int(s.max()) <= cap]


def has_placement(lens: Sequence[int], cap: int, world: int, ulysses_sizes: Sequence[int] = (),
                  time_limit_s: float = 60.0) -> bool:
    """True/False: a placement exists / none does.  Raises if HiGHS runs out of time."""
    n_cols, rows = 0, []                       # rows: (lower, upper, columns, coefficients)
    load: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    longest = int(np.argmax(lens)) if len(lens) else -1
    for seq, length in enumerate(lens):
        picks = []
        for shards in shard_choices(int(length), cap, world, ulysses_sizes):
            chosen, n_cols = n_cols, n_cols + 1
            picks.append(chosen)
            sizes, counts = np.unique(shards, return_counts=True)
            held: list[list[int]] = [[] for _ in range(world)]
            for size, count in zip(sizes.tolist(), counts.tolist()):
                cols = list(range(n_cols, n_cols + world))
                n_cols += world
                for r, c in enumerate(cols):
                    held[r].append(c)
                    load[r].append((c, size))
                rows.append((0.0, 0.0, cols + [chosen], [1.0] * world + [-float(count)]))
            for r, cols in enumerate(held):
                # A group's ranks are distinct; the longest sequence's are the first ones.
                upper = 1.0 if seq != longest or r < len(shards) else 0.0
                rows.append((-np.inf, upper, cols, [1.0] * len(cols)))
        rows.append((1.0, 1.0, picks, [1.0] * len(picks)))
    for terms in load:
        rows.append((-np.inf, float(cap), [c for c, _ in terms], [float(v) for _, v in terms]))
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.addCols(n_cols, np.zeros(n_cols), np.zeros(n_cols), np.ones(n_cols), 0,
              np.zeros(n_cols + 1, np.int32), np.zeros(0, np.int32), np.zeros(0))
    starts = np.cumsum([0] + [len(r[2]) for r in rows[:-1]]).astype(np.int32)
    h.addRows(len(rows), np.array([r[0] for r in rows]), np.array([r[1] for r in rows]),
              sum(len(r[2]) for r in rows), starts, np.array([c for r in rows for c in r[2]], np.int32),
              np.array([v for r in rows for v in r[3]]))
    h.changeColsIntegrality(n_cols, np.arange(n_cols, dtype=np.int32), np.ones(n_cols, np.uint8))
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        return True
    if status == highspy.HighsModelStatus.kInfeasible:
        return False
    raise AssertionError(f"placement oracle: HiGHS stopped with {h.modelStatusToString(status)}")
