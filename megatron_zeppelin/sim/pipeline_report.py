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
from megatron_zeppelin.sim.pipeline import (GIB, PipelineStep, StageMemory, ideal_bubble, micro_batch_work,
                                            pipeline_step, stage_memory)
from megatron_zeppelin.sim.rounds import timed_batch
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


def check_pipeline_args(args: argparse.Namespace, default_nodes: int) -> None:
    """``--pp`` combinations the simulator cannot model, one line each."""
    pp, nodes = args.pp, args.nodes or default_nodes
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


def run_pipeline(args: argparse.Namespace, setup: Callable, default_nodes: int) -> dict[str, PipelineResult]:
    """Check ``--pp``, set up the simulator on one stage's nodes, replay, print."""
    check_pipeline_args(args, default_nodes)
    pp = args.pp
    args.nodes = (args.nodes or default_nodes) // pp
    config, strategies, batches, split = setup(args)
    results = {s.name: simulate_strategy(s, batches, split, pp, args) for s in strategies}
    print(format_pipeline(config, results, pp, len(batches)))
    if args.json is not None:
        from megatron_zeppelin.sim.cli import _write
        _write(args.json, json.dumps(pipeline_json(config, results, pp), indent=2))
    return results


def simulate_strategy(s: Strategy, batches: list[list[int]], split: Callable, pp: int,
                      args: argparse.Namespace) -> PipelineResult:
    # A TP view's GPU is the TP group (its memory tp times one GPU's).
    r = PipelineResult(s.name, error=s.infeasible, memory_gib=s.cost.cluster.gpu.memory_gib / s.cost.tp_size)
    if r.error is not None:
        return r
    ctx = plan_context(s, args.tokens_per_gpu, args.flexsp_time_limit)
    for step, lens in enumerate(batches):
        works = []
        try:
            for group in split(lens):
                timed = timed_batch(s.planner, [lens[i] for i in group], ctx)
                works += [micro_batch_work(plan, part, s.cost, pp) for plan, part in zip(timed.rounds, timed.parts)]
        except InfeasibleError as exc:
            r.error = f"step {step}: {exc}"
            return r
        r.steps.append(pipeline_step(works, s.cost, pp))
        memory = stage_memory(works, s.cost, pp)
        r.memory = [max(pair, key=lambda m: m.total) for pair in zip(r.memory, memory)] if r.memory else memory
    return r


def format_pipeline(config: dict[str, Any], results: dict[str, PipelineResult], pp: int, steps: int) -> str:
    stage_nodes = config["nodes"]
    micro = {statistics.fmean(s.micro_batches for s in r.steps) for r in results.values() if r.steps}
    lines = [f"{config['model']} on {stage_nodes * pp} nodes x {config['gpus_per_node']} GPUs ({config['cluster']}) "
             f"as PP {pp}: stages of {stage_nodes} node{'s' if stage_nodes > 1 else ''}, each plan over "
             f"{config['world_size']} GPUs; {steps} steps of {config['micro_batches']} micro-batches "
             f"(pipeline micro-batches per step: the planned passes, {', '.join(f'{m:.1f}' for m in sorted(micro))})",
             f"1F1B replay: bubble = mean stage idle / step; 'equal' = the same work in equal micro-batches; "
             f"(P-1)/(M+P-1) = {ideal_bubble(pp, config['micro_batches']):.1%} at M = {config['micro_batches']}",
             f"{'strategy':<20}{'step ms':>10}{'vs ' + BASELINE:>10}{'bubble':>9}{'equal':>8}{'excess':>9}"
             f"{'lost ms':>9}{'p2p ms':>8}{'p2p MB':>8}{'peak GiB':>10}"]
    base = results.get(BASELINE)
    base_s = base.mean(lambda s: s.step_s) if base is not None and base.steps and base.error is None else None
    for r in results.values():
        if r.error is not None or not r.steps:
            lines.append(f"{r.name:<20}{'infeasible':>10}  {r.error or 'no step'}")
            continue
        step_s = r.mean(lambda s: s.step_s)
        bubble, equal = r.mean(lambda s: s.replay.bubble), r.mean(lambda s: s.equal.bubble)
        lost = r.mean(lambda s: s.replay.makespan_s - s.equal.makespan_s)
        speed = f"{base_s / step_s:.2f}x" if base_s else "-"
        lines.append(f"{r.name:<20}{step_s * 1e3:>10.1f}{speed:>10}{bubble:>9.1%}{equal:>8.1%}"
                     f"{(bubble - equal) * 100:>+8.1f}p{lost * 1e3:>9.1f}{r.mean(lambda s: s.transfer_s) * 1e3:>8.1f}"
                     f"{r.mean(lambda s: s.transfer_bytes) / 1e6:>8.0f}{max(m.total for m in r.memory) / GIB:>10.1f}")
    feasible = [r for r in results.values() if r.error is None and r.memory]
    if feasible:
        lines.append("memory per GPU at each stage's peak step, GiB: weights + fp32 grads + optimizer share, "
                     "+ activations of the micro-batches 1F1B keeps in flight there, = total (! over the GPU's "
                     f"{feasible[0].memory_gib:.0f} GiB)")
        lines.append(f"{'strategy (TP)':<24}" + "".join(f"{f'stage {m.stage} ({m.in_flight} in flight)':>24}"
                                                      for m in feasible[0].memory))
        for r in feasible:
            name = f"{r.name} ({config['tp_sizes'].get(r.name, 1)})"
            lines.append(f"{name:<24}" + "".join(
                f"{_stage_memory_cell(m, r.memory_gib):>24}" for m in r.memory))
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
            "equal_micro_batch_bubble": [s.equal.bubble for s in r.steps],
            "p2p_s_per_boundary": [s.transfer_s for s in r.steps],
            "memory_per_stage": [{**asdict(m), "total": m.total, "fits": m.total <= r.memory_gib * GIB}
                                 for m in r.memory],
        }
    return {"config": {**config, "pipeline_parallel": pp, "stage_nodes": config["nodes"]},
            "ideal_bubble": ideal_bubble(pp, config["micro_batches"]), "strategies": out}
