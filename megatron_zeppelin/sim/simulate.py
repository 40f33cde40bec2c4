"""Run strategies side by side over the same global batches.

For every batch and every strategy: plan (timed, wall-clock ms), validate, then
model the step (:func:`~megatron_zeppelin.sim.timeline.step_timeline`).  A
strategy that cannot place a batch (:class:`InfeasibleError`) is recorded as
infeasible with its message and skipped for the remaining steps; it does not
stop the others.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE
from megatron_zeppelin.cost.tp import tp_view
from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.plan import Plan, TierCounts
from megatron_zeppelin.planner.base import PLANNERS, get_planner
from megatron_zeppelin.planner.micro_batches import Split
from megatron_zeppelin.sampler.batch_sampler import ZeppelinBatchSampler
from megatron_zeppelin.sim.progress import Progress
from megatron_zeppelin.sim.rounds import batch_groups, plan_batch, rounds_timeline
from megatron_zeppelin.sim.static_layout import FitsMemory, choose_layout
from megatron_zeppelin.sim.strategy import Strategy, plan_context
from megatron_zeppelin.sim.timeline import StepTimeline

#: The baseline every speedup is measured against.
BASELINE = "te_cp"


@dataclass(frozen=True)
class Variant:
    """Which of Zeppelin's layers a ``zeppelin*`` strategy switches on."""

    routing: bool
    """Inter-node transfers go through the NIC routing layer (``CostModel.routing``)."""
    remap: bool
    """Linear modules get a token-balanced layout (``PlanContext.remap_enabled``)."""
    decide: bool = True
    """Each batch's plan is the candidate the replay's surrogate puts fastest
    (``planner/zeppelin_decide.py``; ``pretrain_gpt.py --zeppelin-decide on``, the default); False: the planner's first plan,
    remapping every batch (``--zeppelin-decide off``, the ablation)."""


#: Zeppelin and its ablations: the same planner (hierarchical partitioning and
#: the attention engine) with the routing and remapping layers on or off.  The
#: ablation ladder is zeppelin_base -> zeppelin_noremap (+routing) -> zeppelin
#: (+remap); zeppelin_norouting is the other path to the top.  zeppelin_nodecide
#: is zeppelin without the per-batch decision (``--zeppelin-decide off``).
VARIANTS: dict[str, Variant] = {
    "zeppelin_base": Variant(routing=False, remap=False),
    "zeppelin_norouting": Variant(routing=False, remap=True),
    "zeppelin_noremap": Variant(routing=True, remap=False),
    "zeppelin_nodecide": Variant(routing=True, remap=True, decide=False),
    "zeppelin": Variant(routing=True, remap=True),
}
#: Strategy names the simulator accepts: the baseline, the other baselines, then
#: Zeppelin's variants in ablation order.
STRATEGY_NAMES: tuple[str, ...] = (BASELINE, *(n for n in PLANNERS if n not in VARIANTS and n != BASELINE),
                                   *VARIANTS)


def collect_garbage_rarely() -> None:
    """Run the cyclic garbage collector after 10^6 allocations instead of Python's 700.

    A simulator run allocates millions of short-lived acyclic tuples and dicts
    (plans, schedules) beside a large long-lived heap (the memoized timelines):
    at the default thresholds the collector rescans that heap thousands of times
    and frees next to nothing.  Measured on ``benchmarks/published_settings.py
    --quick``: 10.1-10.6 s of CPU at the defaults, 8.7-9.0 s with this, the same
    peak memory.  For the simulator's entry points (CLI, benchmarks), not for a
    library caller's process."""
    gc.set_threshold(1_000_000, 1000, 1000)


def uses_routing(name: str) -> bool:
    """Whether strategy ``name`` sends inter-node traffic through the routing
    layer: only Zeppelin's variants with it on (every baseline uses NCCL p2p,
    each GPU through its own NIC)."""
    variant = VARIANTS.get(name)
    return variant is not None and variant.routing


def strategy_cost(cost: CostModel, name: str) -> CostModel:
    """``cost`` as strategy ``name`` runs: the routing layer per :func:`uses_routing`;
    dK/dV ring messages in ``cost.ring_grad_dtype`` for Zeppelin's variants, in
    the K/V dtype for the baselines (TransformerEngine's ring, as their users run it)."""
    grad = cost.ring_grad_dtype if name in VARIANTS else DEFAULT_RING_GRAD_DTYPE
    return replace(cost, routing=uses_routing(name), ring_grad_dtype=grad)


def te_cp_size(max_seq_len: int, tokens_per_gpu: int) -> int:
    """Smallest power of two ``c`` with ``max_seq_len / c <= tokens_per_gpu``:
    the CP size a static-CP user must pick so the longest sequence fits."""
    c = 1
    while max_seq_len > c * tokens_per_gpu:
        c *= 2
    return c


def sample_batches(doc_lengths: np.ndarray, *, max_seq_len: int, tokens_per_batch: int, steps: int,
                   seed: int = 0) -> list[list[int]]:
    """Sequence lengths of the first ``steps`` global batches the training sampler yields."""
    sampler = ZeppelinBatchSampler(doc_lengths, max_seq_len=max_seq_len, tokens_per_batch=tokens_per_batch,
                                   seed=seed, num_batches=steps)
    return [batch.seq_lens for batch in sampler]


def build_strategies(names: Sequence[str], cost: CostModel, *, cp_size: int | None = None,
                     layout_batches: Sequence[Sequence[int]] | None = None, max_seq_len: int | None = None,
                     tokens_per_gpu: int | None = None, time_limit_s: float = 1.0,
                     fits: FitsMemory | None = None) -> list[Strategy]:
    """Strategies by name (:func:`strategy_cost` says which cost model each gets).
    Zeppelin's variants (:data:`VARIANTS`) run its planner with their layers.

    The static baselines (:data:`STATIC`) get the layout a competent user would
    launch, and Zeppelin's variants the TP size the full Zeppelin runs fastest
    with (``sim/static_layout.py``), when ``layout_batches``, ``max_seq_len``
    and ``tokens_per_gpu`` are given and no ``cp_size`` fixes it; else
    ``cp_size`` with TP=1.  ``fits``: the searches keep the fastest layout that
    fits in memory (pipeline parallelism's stage memory)."""
    unknown = [n for n in names if n not in STRATEGY_NAMES]
    if unknown or not names:
        what = f"unknown strategy {unknown[0]!r}" if unknown else "no strategy given"
        raise ConfigError(f"{what}; choose from {', '.join(STRATEGY_NAMES)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"strategy list {','.join(names)} names one twice; list each once")
    strategies = []
    searched = cp_size is None and layout_batches is not None
    zeppelin_tp = None
    if searched and any(n in VARIANTS for n in names):
        zeppelin_tp = _static_strategy("zeppelin", cost.routed(True), layout_batches, max_seq_len,
                                       tokens_per_gpu, time_limit_s, fits)
    for name in names:
        variant = VARIANTS.get(name)
        routed = strategy_cost(cost, name)
        if variant is not None and zeppelin_tp is not None and zeppelin_tp.infeasible is None:
            tp = zeppelin_tp.tp_size     # the TP size the full Zeppelin runs best with, for every variant
            strategies.append(Strategy(name, get_planner("zeppelin"), tp_view(routed, tp) if tp > 1 else routed,
                                       remap_enabled=variant.remap, decide=variant.decide, tp_size=tp,
                                       layout=zeppelin_tp.layout))
        elif variant is not None:
            why = zeppelin_tp.infeasible if zeppelin_tp is not None else None
            strategies.append(Strategy(name, get_planner("zeppelin"), routed, remap_enabled=variant.remap,
                                       decide=variant.decide, layout=why, infeasible=why))
        elif name in STATIC and searched:
            strategies.append(_static_strategy(name, routed, layout_batches, max_seq_len, tokens_per_gpu,
                                               time_limit_s, fits))
        else:
            strategies.append(Strategy(name, get_planner(name), routed, cp_size if name in STATIC else None))
    return strategies


#: Baselines whose layout is searched and then fixed for the whole run: TP x CP
#: (``te_cp``, ``megatron_dp_balanced``), SP, or TP alone where CP is per sequence.
STATIC = ("te_cp", "ulysses_sp", "megatron_dp_balanced", "megatron_hybrid_cp", "megatron_dynamic_cp")


def _static_strategy(name: str, cost: CostModel, batches: Sequence[Sequence[int]], max_seq_len: int | None,
                     tokens_per_gpu: int | None, time_limit_s: float, fits: FitsMemory | None = None) -> Strategy:
    if max_seq_len is None or tokens_per_gpu is None:
        raise ConfigError("the static layout search needs max_seq_len and tokens_per_gpu")
    choice = choose_layout(name, cost, batches, max_seq_len=max_seq_len, tokens_per_gpu=tokens_per_gpu,
                           time_limit_s=time_limit_s, fits=fits)
    if choice.layout is None:
        return Strategy(name, get_planner(name), cost, layout=choice.report, infeasible=choice.report)
    return Strategy(name, get_planner(name), choice.cost, choice.layout.size or None, tp_size=choice.layout.tp,
                    layout=choice.report)


@dataclass
class StrategyResult:
    """What one strategy did over all simulated steps."""

    name: str
    """Strategy name."""
    step_s: list[float] = field(default_factory=list)
    """Modeled step time of each step it placed."""
    planner_ms: list[float] = field(default_factory=list)
    """Wall-clock planning time of each step, milliseconds."""
    attn_imbalance: list[float] = field(default_factory=list)
    """Attention pairs max/mean of each step."""
    linear_imbalance: list[float] = field(default_factory=list)
    """Linear tokens max/mean of each step."""
    tiers: list[TierCounts] = field(default_factory=list)
    """Sequences per tier of each step."""
    error: str | None = None
    """Why it could not place a batch (None: feasible on every step)."""
    timeline: StepTimeline | None = None
    """Full timeline of the step chosen for plotting."""

    @property
    def feasible(self) -> bool:
        return self.error is None

    @property
    def step_time_s(self) -> float | None:
        """Mean modeled step time (None when infeasible)."""
        return statistics.fmean(self.step_s) if self.feasible and self.step_s else None


@dataclass
class SimResult:
    """All strategies over the same batches."""

    seq_lens: list[list[int]]
    """Lengths of every simulated global batch."""
    lower_bound_s: list[float]
    """``CostModel.lower_bound_s`` of every batch."""
    strategies: dict[str, StrategyResult]
    """Results by strategy name, in the order they were given."""

    @property
    def lower_bound_step_s(self) -> float:
        return statistics.fmean(self.lower_bound_s)

    def speedup(self, name: str) -> float | None:
        """Baseline's mean step time / this strategy's (None if either is missing)."""
        base = self.strategies.get(BASELINE)
        mine = self.strategies[name].step_time_s
        if base is None or base.step_time_s is None or mine is None:
            return None
        return base.step_time_s / mine

    def to_dict(self, config: dict[str, Any]) -> dict[str, Any]:
        """The ``--json`` document (keys may be added, never removed)."""
        out = {}
        for name, r in self.strategies.items():
            mine = r.step_time_s
            out[name] = {
                "step_time_s": mine,
                "planner_ms": statistics.median(r.planner_ms) if r.planner_ms else None,
                "planner_ms_p90": float(np.percentile(r.planner_ms, 90)) if r.planner_ms else None,
                "speedup_vs_te_cp": self.speedup(name),
                "ratio_to_lower_bound": mine / self.lower_bound_step_s if mine else None,
                "feasible": r.feasible,
                "error": r.error,
                "attn_imbalance": statistics.fmean(r.attn_imbalance) if r.attn_imbalance else None,
                "linear_imbalance": statistics.fmean(r.linear_imbalance) if r.linear_imbalance else None,
                "step_times_s": list(r.step_s),
                "tiers": [asdict(t) for t in r.tiers],
            }
        return {"config": config, "steps": len(self.seq_lens),
                "lower_bound_step_s": self.lower_bound_step_s, "strategies": out}


def simulate(batches: Iterable[Sequence[int]], strategies: Sequence[Strategy], *, tokens_per_gpu: int,
             time_limit_s: float = 10.0, plot_step: int = 0,
             on_plan: Callable[[int, str, Plan], None] | None = None,
             progress: Progress | None = None, split: Split | None = None) -> SimResult:
    """Plan and model every batch with every strategy.

    ``split`` cuts each global batch into micro-batches (gradient accumulation,
    ``planner/micro_batches.py``), the same ones for every strategy; each is
    planned on its own and the step is their sum plus one gradient sync.

    ``on_plan(step, strategy_name, plan)`` sees each valid plan (``--dump-plans``); the timeline
    of step ``plot_step`` is kept in full for plotting."""
    if not strategies:
        raise ConfigError("no strategy to simulate; pass at least one")
    results = {s.name: StrategyResult(s.name) for s in strategies}
    seq_lens: list[list[int]] = []
    lower: list[float] = []
    for step, batch in enumerate(batches):
        lens = [int(x) for x in batch]
        seq_lens.append(lens)
        lower.append(strategies[0].cost.lower_bound_s(lens))
        try:
            groups = split(lens) if split is not None else [list(range(len(lens)))]
        except InfeasibleError as exc:
            raise ConfigError(f"step {step}: {exc}") from None
        for s in strategies:
            r = results[s.name]
            if s.infeasible is not None:
                r.error = s.infeasible
            if r.feasible:
                _run_one(step, lens, s, r, tokens_per_gpu, time_limit_s, plot_step, on_plan, groups)
            if progress is not None:
                progress.advance(f"step {step} {s.name}")
    if progress is not None:
        progress.close()
    if not seq_lens:
        raise ConfigError("the sampler produced no global batch; use a longer lengths file or a "
                          "smaller --tokens-per-gpu")
    return SimResult(seq_lens, lower, results)


def _run_one(step: int, lens: list[int], s: Strategy, r: StrategyResult, tokens_per_gpu: int,
             time_limit_s: float, plot_step: int, on_plan: Callable[[int, str, Plan], None] | None,
             groups: list[list[int]]) -> None:
    ctx = plan_context(s, tokens_per_gpu, time_limit_s)
    try:
        t0 = time.perf_counter()
        planned = [plan_batch(s.planner, [lens[i] for i in g], ctx) for g in batch_groups(s.planner, lens, groups)]
        elapsed_ms = (time.perf_counter() - t0) * 1e3
    except InfeasibleError as exc:
        r.error = f"step {step}: {exc}"
        return
    for i, (plan, _) in enumerate(planned):
        plan.validate()
        if on_plan is not None:
            on_plan(step, s.name if len(planned) == 1 else f"{s.name}_mb{i}", plan)
    # Micro-batches run one after another and share one gradient sync, like rounds.
    tl = rounds_timeline([p for _, rounds in planned for p in rounds], s.cost)
    r.planner_ms.append(elapsed_ms)
    r.step_s.append(tl.step_s)
    r.attn_imbalance.append(tl.attn_imbalance)
    r.linear_imbalance.append(tl.linear_imbalance)
    r.tiers.append(tl.tiers)
    if step == plot_step:
        r.timeline = tl


def format_table(result: SimResult) -> str:
    """Markdown table, one row per strategy (the CLI's output)."""
    head = ("strategy", "step time (ms)", f"speedup vs {BASELINE}", "x lower bound",
            "planner ms (median)", "attn imbalance", "linear imbalance")
    rows = [head]
    for name, r in result.strategies.items():
        mine = r.step_time_s
        if mine is None:
            rows.append((name, "infeasible", "-", "-", "-", "-", "-"))
            continue
        speedup = result.speedup(name)
        rows.append((name, _ms(mine), f"{speedup:.2f}x" if speedup else "-",
                     f"{mine / result.lower_bound_step_s:.2f}",
                     _ms(statistics.median(r.planner_ms) / 1e3),
                     f"{statistics.fmean(r.attn_imbalance):.2f}",
                     f"{statistics.fmean(r.linear_imbalance):.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    """Milliseconds with one decimal, or three significant digits below 10 ms."""
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}"


def infeasible_notes(result: SimResult) -> list[str]:
    """One line per infeasible strategy, with the planner's reason."""
    return [f"{name}: infeasible ({r.error})" for name, r in result.strategies.items() if not r.feasible]
