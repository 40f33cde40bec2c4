"""``python -m megatron_zeppelin.sim --pp P``: every strategy through 1F1B, side by side.

The cluster's nodes form ``P`` stages of ``nodes / P`` whole nodes; the
strategies, their static layout searches, the global batches and their
micro-batch split are those of the simulator on one stage's nodes (the
data-parallel ranks a plan spans).  Each planned pass is a pipeline
micro-batch (the trainer runs a strategy's passes as micro-batches too);
:mod:`megatron_zeppelin.sim.pipeline` replays them.  Pure: no torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.sim.pipeline import (GIB, PipelineStep, StageMemory, batch_works, ideal_bubble,
                                            pipeline_step, stage_memory)
from megatron_zeppelin.sim.rounds import batch_groups, timed_batch
from megatron_zeppelin.sim.simulate import BASELINE, Strategy, plan_context


@dataclass
class PipelineResult:
    """One strategy over every simulated global batch."""

    name: str
    steps: list[PipelineStep] = field(default_factory=list)
    memory: list[StageMemory] = field(default_factory=list)
    """Per stage, the step with the largest total."""
    error: str | None = None
    memory_gib: float = 0.0
    """Memory of one of the strategy's GPUs."""

    def mean(self, value: Callable[[PipelineStep], float]) -> float:
        return statistics.fmean(value(s) for s in self.steps)


def parse_pp(text: str) -> tuple[int, ...]:
    """``--pp``: one size, or a comma-separated list to search."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size or a comma-separated list of sizes, got {text!r}") from None
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"--pp {text} names a size twice")
    return sizes


def check_pipeline_args(args: argparse.Namespace, pp: int, nodes: int) -> None:
    """``--pp`` combinations the simulator cannot model on ``nodes``, one line
    each (``args.micro_batches``: this size's count)."""
    if pp < 1:
        raise ConfigError(f"--pp must be >= 1, got {pp}")
    if nodes % pp:
        raise ConfigError(f"--pp {pp} does not divide --nodes {nodes}: the simulator models stages of whole "
                          "nodes; pick a --pp that divides the nodes")
    layers = load_model(args.model).num_layers
    if layers % pp:
        raise ConfigError(f"--pp {pp} does not divide model {args.model}'s {layers} layers; pick a --pp that "
                          "divides them")
    if args.micro_batches < pp:
        raise ConfigError(f"--micro-batches {args.micro_batches} is fewer than the {pp} pipeline stages; pass "
                          f"--micro-batches {pp} or more")
    if args.plan is not None or args.trace is not None or args.plot is not None:
        raise ConfigError("--plan, --trace and --plot time one plan on the whole cluster; drop them with --pp")


def run_pipeline(args: argparse.Namespace, setup: Callable,
                 default_nodes: int) -> dict[int, dict[str, PipelineResult]]:
    """Every ``--pp`` size: check it, set up the simulator on one stage's nodes
    (each strategy's TP searched there), replay, print; with several sizes, each
    strategy's fastest layout that fits in memory (a user tuning TP x PP)."""
    nodes = args.nodes or default_nodes
    # Each size's layout searches keep the fastest layout whose stages fit in memory.
    runs = {pp: argparse.Namespace(**{**vars(args), "nodes": nodes // max(pp, 1), "pipeline_stages": pp})
            for pp in args.pp}
    if len(args.pp) > 1:
        same_batches(args, runs, nodes)
    for pp, stage_args in runs.items():
        check_pipeline_args(stage_args, pp, nodes)
    by_pp, docs, skipped = {}, {}, {}
    for pp, stage_args in runs.items():
        try:
            config, strategies, batches, split = setup(stage_args)
        except ConfigError as exc:   # a search goes on without a size the stage cannot hold
            if len(args.pp) == 1:
                raise
            skipped[pp] = str(exc)
            print(f"PP {pp}: not simulated: {exc}")
            continue
        config["recompute"] = args.recompute
        by_pp[pp] = {s.name: simulate_strategy(s, batches, split, pp, stage_args) for s in strategies}
        print(format_pipeline(config, by_pp[pp], pp, len(batches)))
        docs[pp] = pipeline_json(config, by_pp[pp], pp)
    if not by_pp:
        raise ConfigError(f"no --pp size could be simulated ({'; '.join(f'PP {p}: {e}' for p, e in skipped.items())})")
    doc = docs[args.pp[0]] if len(args.pp) == 1 else None
    if len(args.pp) > 1:
        tuned = tuned_layouts(by_pp, {pp: d["config"]["tp_sizes"] for pp, d in docs.items()})
        print(format_tuned(tuned, nodes))
        doc = {"layouts": {str(pp): d for pp, d in docs.items()}, "tuned": tuned,
               "not_simulated": {str(pp): why for pp, why in skipped.items()}}
    if args.json is not None:
        from megatron_zeppelin.sim.cli import _write
        _write(args.json, json.dumps(doc, indent=2))
    return by_pp


def same_batches(args: argparse.Namespace, runs: dict[int, argparse.Namespace], nodes: int) -> None:
    """A PP search compares the same global batches: the token budget of the
    smallest PP (its data-parallel ranks x ``--micro-batches``), and at a PP
    ``k`` times larger ``k`` times the micro-batches (each as large per rank),
    as a user keeps the global batch while tuning TP x PP."""
    from megatron_zeppelin.sampler import batch_budget
    from megatron_zeppelin.topology import load_cluster

    smallest = min(args.pp)
    if smallest < 1:
        raise ConfigError(f"--pp must be >= 1, got {smallest}")
    gpus = load_cluster(args.cluster, nodes=max(nodes // smallest, 1)).topology.gpus_per_node
    budget = args.tokens_per_batch or args.micro_batches * batch_budget(
        args.tokens_per_gpu, nodes // smallest * gpus, args.max_seq_len, args.batch_fill)
    for pp, stage_args in runs.items():
        if pp % smallest:
            raise ConfigError(f"--pp {','.join(map(str, args.pp))}: every size must be a multiple of the smallest "
                              f"({smallest}) so each keeps the global batch in whole micro-batches")
        stage_args.tokens_per_batch = budget
        stage_args.micro_batches = args.micro_batches * pp // smallest


def simulate_strategy(s: Strategy, batches: list[list[int]], split: Callable, pp: int,
                      args: argparse.Namespace) -> PipelineResult:
    # A TP view's GPU is the TP group (its memory tp times one GPU's).
    r = PipelineResult(s.name, error=s.infeasible, memory_gib=s.cost.cluster.gpu.memory_gib / s.cost.tp_size)
    refusal = getattr(s.planner, "refuses_pipeline", None)
    if r.error is None and pp > 1 and refusal:
        r.error = f"{s.name}: {refusal}"
    if r.error is not None:
        return r
    ctx = plan_context(s, args.tokens_per_gpu, args.flexsp_time_limit)
    recompute = args.recompute == "full"
    for step, lens in enumerate(batches):
        works = []
        try:
            for group in batch_groups(s.planner, lens, split(lens)):
                works += batch_works(timed_batch(s.planner, [lens[i] for i in group], ctx), s.cost, pp, recompute)
        except InfeasibleError as exc:
            r.error = f"step {step}: {exc}"
            return r
        r.steps.append(pipeline_step(works, s.cost, pp))
        memory = stage_memory(works, s.cost, pp, recompute)
        r.memory = [max(pair, key=lambda m: m.total) for pair in zip(r.memory, memory)] if r.memory else memory
    return r


def format_pipeline(config: dict[str, Any], results: dict[str, PipelineResult], pp: int, steps: int) -> str:
    stage_nodes = config["nodes"]
    micro = {statistics.fmean(s.micro_batches for s in r.steps) for r in results.values() if r.steps}
    lines = [f"{config['model']} on {stage_nodes * pp} nodes x {config['gpus_per_node']} GPUs ({config['cluster']}) "
             f"as PP {pp}: stages of {stage_nodes} node{'s' if stage_nodes > 1 else ''}, each plan over "
             f"{config['world_size']} GPUs; {steps} steps of {config['micro_batches']} micro-batches "
             f"(pipeline micro-batches per step: the planned passes, {', '.join(f'{m:.1f}' for m in sorted(micro))})",
             f"1F1B replay, micro-batches lightest at the ends (as the trainer runs them): bubble = mean stage idle "
             f"/ step; 'split' = in the split's order; 'equal' = the same work in equal micro-batches; "
             f"(P-1)/(M+P-1) = {ideal_bubble(pp, config['micro_batches']):.1%} at M = {config['micro_batches']}",
             f"{'strategy':<20}{'step ms':>10}{'vs ' + BASELINE:>10}{'bubble':>9}{'split':>8}{'equal':>8}{'excess':>9}"
             f"{'lost ms':>9}{'p2p ms':>8}{'p2p MB':>8}{'peak GiB':>10}"]
    base = results.get(BASELINE)
    base_s = base.mean(lambda s: s.step_s) if base is not None and base.steps and base.error is None else None
    for r in results.values():
        if r.error is not None or not r.steps:
            lines.append(f"{r.name:<20}{'infeasible':>10}  {r.error or 'no step'}")
            continue
        step_s = r.mean(lambda s: s.step_s)
        bubble, equal = r.mean(lambda s: s.replay.bubble), r.mean(lambda s: s.equal.bubble)
        split = r.mean(lambda s: s.as_split.bubble)
        lost = r.mean(lambda s: s.replay.makespan_s - s.equal.makespan_s)
        speed = f"{base_s / step_s:.2f}x" if base_s else "-"
        lines.append(f"{r.name:<20}{step_s * 1e3:>10.1f}{speed:>10}{bubble:>9.1%}{split:>8.1%}{equal:>8.1%}"
                     f"{(bubble - equal) * 100:>+8.1f}p{lost * 1e3:>9.1f}{r.mean(lambda s: s.transfer_s) * 1e3:>8.1f}"
                     f"{r.mean(lambda s: s.transfer_bytes) / 1e6:>8.0f}{max(m.total for m in r.memory) / GIB:>10.1f}")
    feasible = [r for r in results.values() if r.error is None and r.memory]
    if feasible:
        lines.append("memory per GPU at each stage's peak step, GiB: weights + fp32 grads + optimizer share, "
                     f"+ activations of the micro-batches 1F1B keeps in flight there (recompute "
                     f"{config['recompute']}), = total (! over the GPU's "
                     f"{feasible[0].memory_gib:.0f} GiB)")
        lines.append(f"{'strategy (TP)':<24}" + "".join(f"{f'stage {m.stage} ({m.in_flight} in flight)':>24}"
                                                      for m in feasible[0].memory))
        for r in feasible:
            name = f"{r.name} ({config['tp_sizes'].get(r.name, 1)})"
            lines.append(f"{name:<24}" + "".join(
                f"{_stage_memory_cell(m, r.memory_gib):>24}" for m in r.memory))
    return "\n".join(lines)


def fits(r: PipelineResult) -> bool:
    """Every stage's peak within one GPU's memory."""
    return bool(r.memory) and max(m.total for m in r.memory) <= r.memory_gib * GIB


def tuned_layouts(by_pp: dict[int, dict[str, PipelineResult]],
                  tp_sizes: dict[int, dict[str, int]]) -> dict[str, dict[str, Any]]:
    """Per strategy, its fastest PP (with the TP its layout search picked there)
    among those that fit in memory, else the fastest of all, marked."""
    out = {}
    for name in next(iter(by_pp.values())):
        runs = [(pp, results[name]) for pp, results in by_pp.items() if results[name].error is None and results[name].steps]
        if not runs:
            out[name] = {"pp": None, "tp": None, "step_time_s": None, "fits": False}
            continue
        fitting = [(pp, r) for pp, r in runs if fits(r)]
        pp, r = min(fitting or runs, key=lambda run: run[1].mean(lambda s: s.step_s))
        out[name] = {"pp": pp, "tp": tp_sizes[pp].get(name, 1), "micro_batches": r.steps[0].micro_batches,
                     "step_time_s": r.mean(lambda s: s.step_s),
                     "bubble": r.mean(lambda s: s.replay.bubble), "fits": fits(r),
                     "peak_gib": max(m.total for m in r.memory) / GIB}
    return out


def format_tuned(tuned: dict[str, dict[str, Any]], nodes: int) -> str:
    base = tuned.get(BASELINE, {}).get("step_time_s")
    lines = [f"tuned on {nodes} nodes, the same global batches at every PP: each strategy's fastest TP x PP that "
             "fits in memory (! none fits: the fastest shown; M: its pipeline micro-batches per step)",
             f"{'strategy':<20}{'PP':>4}{'TP':>4}{'M':>4}{'step ms':>10}{'vs ' + BASELINE:>10}"
             f"{'bubble':>9}{'peak GiB':>10}"]
    for name, t in tuned.items():
        if t["step_time_s"] is None:
            lines.append(f"{name:<20}{'infeasible at every PP':>28}")
            continue
        speed = f"{base / t['step_time_s']:.2f}x" if base else "-"
        lines.append(f"{name:<20}{t['pp']:>4}{t['tp']:>4}{t['micro_batches']:>4}{t['step_time_s'] * 1e3:>10.1f}"
                     f"{speed:>10}"
                     f"{t['bubble']:>9.1%}{t['peak_gib']:>9.1f}{'' if t['fits'] else '!'}")
    return "\n".join(lines)


def _stage_memory_cell(m: StageMemory, memory_gib: float) -> str:
    over = "!" if m.total > memory_gib * GIB else ""
    return f"{(m.weights + m.gradients + m.optimizer) / GIB:.1f} + {m.activations / GIB:.1f} = {m.total / GIB:.1f}{over}"


def pipeline_json(config: dict[str, Any], results: dict[str, PipelineResult], pp: int) -> dict[str, Any]:
    """The ``--json`` document of a ``--pp`` run."""
    out = {}
    for r in results.values():
        ok = r.error is None and r.steps
        out[r.name] = {
            "feasible": r.error is None, "error": r.error,
            "step_time_s": r.mean(lambda s: s.step_s) if ok else None,
            "step_times_s": [s.step_s for s in r.steps],
            "bubble": [s.replay.bubble for s in r.steps],
            "split_order_bubble": [s.as_split.bubble for s in r.steps],
            "split_order_makespan_s": [s.as_split.makespan_s for s in r.steps],
            "equal_micro_batch_bubble": [s.equal.bubble for s in r.steps],
            "p2p_s_per_boundary": [s.transfer_s for s in r.steps],
            "memory_per_stage": [{**asdict(m), "total": m.total, "fits": m.total <= r.memory_gib * GIB}
                                 for m in r.memory],
        }
    return {"config": {**config, "pipeline_parallel": pp, "stage_nodes": config["nodes"]},
            "ideal_bubble": ideal_bubble(pp, config["micro_batches"]), "strategies": out}
