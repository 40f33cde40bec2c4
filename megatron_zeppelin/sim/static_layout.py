"""The static layout a competent user launches a static baseline with.

``te_cp`` (Megatron TP x CP) and ``ulysses_sp`` (DeepSpeed SP) fix their
layout for the whole run; Zeppelin, a Megatron plugin, fixes its TP size
(its CP is per sequence), so it gets the same search over TP.  A user who knows their model, maximum length and
cluster tries the layouts that fit and keeps the fastest on their data: here
every feasible layout (``planner/te_cp.py: te_cp_layouts``,
``planner/ulysses_sp.py: ulysses_layouts``) plans and times the first
global batch, and the fastest step wins.  No layout fitting is a
strategy-level infeasibility with every layout's reason, never a crash.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.tp import tp_view
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.planner.base import get_planner
from megatron_zeppelin.planner.te_cp import StaticLayout, te_cp_layouts, tp_problems
from megatron_zeppelin.planner.ulysses_sp import ulysses_layouts
from megatron_zeppelin.sim.rounds import TimedBatch, timed_batch
from megatron_zeppelin.sim.strategy import Strategy, plan_context

#: Batches a layout is tried on (a user's short benchmark run).  One: the
#: search times up to 8 TP x CP layouts (and Zeppelin's up to 4 TP sizes) per
#: configuration, and each further batch adds all of that again.  Two layouts
#: within a few percent of each other may then swap with the batch drawn.
TRIAL_BATCHES = 1


@dataclass(frozen=True)
class LayoutChoice:
    """What the search found."""

    layout: StaticLayout | None
    """The fastest feasible layout (None: none fits)."""
    cost: CostModel
    """The cost model of its ranks (a TP view when ``tp > 1``)."""
    report: str
    """One line: the choice and the mean modeled step of each layout tried, or
    why none fits."""


def layouts_for(name: str, cost: CostModel, max_seq_len: int, tokens_per_gpu: int) -> list[StaticLayout]:
    """The candidate layouts of strategy ``name``: TP x CP for ``te_cp`` and
    ``megatron_dp_balanced``, SP for ``ulysses_sp``, TP alone for Zeppelin and
    Megatron's hybrid and dynamic CP (their CP is decided per sequence)."""
    if name in ("te_cp", "megatron_dp_balanced"):
        return te_cp_layouts(cost, max_seq_len, tokens_per_gpu)
    if name == "ulysses_sp":
        return ulysses_layouts(cost, max_seq_len, tokens_per_gpu)
    return [StaticLayout(tp, 0, problem) for tp, problem in tp_problems(cost, max_seq_len, tokens_per_gpu).items()]


#: ``fits(view, timed)``: whether a layout's ranks (``view``, a TP view when TP > 1)
#: hold the trial batch as planned and timed (``timed``) in one GPU's memory.
FitsMemory = Callable[[CostModel, TimedBatch], bool]


def choose_layout(name: str, cost: CostModel, batches: Sequence[Sequence[int]], *, max_seq_len: int,
                  tokens_per_gpu: int, time_limit_s: float = 1.0, fits: FitsMemory | None = None) -> LayoutChoice:
    """Time every feasible layout of ``name`` on the first batch(es); keep the fastest
    -- of those that ``fits`` in memory when given (a user tuning TP under pipeline
    parallelism picks the fastest layout that runs; none fitting: the fastest)."""
    candidates = layouts_for(name, cost, max_seq_len, tokens_per_gpu)
    feasible = [c for c in candidates if c.problem is None]
    planner = get_planner(name)
    tried: list[tuple[float, StaticLayout, CostModel]] = []
    too_big: set[StaticLayout] = set()
    failures = []
    for layout in feasible:
        view = tp_view(cost, layout.tp) if layout.tp > 1 else cost
        # The context the simulator runs the strategy with, so that its
        # measurement of these batches afterwards is remembered (timed_batch).
        ctx = plan_context(Strategy(name, planner, view, layout.size or None, tp_size=layout.tp),
                           tokens_per_gpu, time_limit_s)
        try:
            timed = [timed_batch(planner, b, ctx) for b in batches[:TRIAL_BATCHES]]
        except InfeasibleError as exc:
            failures.append(f"{layout}: {exc}")
            continue
        if fits is not None and not all(fits(view, t) for t in timed):
            too_big.add(layout)
        tried.append((statistics.fmean(t.step.step_s for t in timed), layout, view))
    if not tried:
        # Per TP size, the reason of its widest group (the one likeliest to fit).
        widest = {c.tp: c for c in candidates}
        reasons = [f"{_label(name, c)}: {c.problem}" for c in widest.values() if c.problem] + failures
        return LayoutChoice(None, cost, f"{name}: no static layout fits: " + "; ".join(reasons))
    running = [t for t in tried if t[1] not in too_big] or tried
    best_s, best, view = min(running, key=lambda t: (t[0], t[1].tp, t[1].size))
    others = ", ".join(f"{_label(name, lay)} {s * 1e3:.0f} ms{' (over memory)' if lay in too_big else ''}"
                       for s, lay, _ in sorted(tried, key=lambda t: t[0]))
    return LayoutChoice(best, view, f"{name}: {_label(name, best)} (tried: {others})")


def _label(name: str, layout: StaticLayout) -> str:
    if name in ("te_cp", "megatron_dp_balanced"):
        return str(layout)
    return f"SP={layout.size}" if name == "ulysses_sp" else f"TP={layout.tp}"


def static_size(name: str, cost: CostModel, max_seq_len: int, tokens_per_gpu: int) -> int | None:
    """The group size a static baseline runs with at TP=1 for the whole run:
    the smallest feasible one for ``max_seq_len`` (None: not a static baseline,
    or nothing fits, which its planner then reports per batch)."""
    if name not in ("te_cp", "ulysses_sp"):
        return None
    feasible = [lay.size for lay in layouts_for(name, cost, max_seq_len, tokens_per_gpu)
                if lay.tp == 1 and lay.problem is None]
    return min(feasible, default=None)
