"""``python -m megatron_zeppelin.sim``: modeled step time of each strategy, side by side.

    python -m megatron_zeppelin.sim                       # bundled sample, default cluster
    python -m megatron_zeppelin.sim --cluster a800-4x200g --nodes 8 --model llama-13b \\
        --lengths my_lengths.npy --max-seq-len 262144 --tokens-per-gpu 16384 \\
        --strategies te_cp,zeppelin_base,zeppelin_noremap,zeppelin --json out.json --plot out.png

Every strategy plans the same global batches (``ZeppelinBatchSampler``); the
step time of each plan is the event replay of the schedule the engine runs,
with cost-model durations (docs/simulator.md).  Two more forms:

    python -m megatron_zeppelin.sim --plan PLAN.json --cluster C --model M    # time one dumped Plan
    python -m megatron_zeppelin.sim replay TRACE.json --cluster C --model M   # re-time an executed trace

Both end with the line ``step_time_s=<float>``; ``--trace OUT.json`` writes the
modeled Chrome trace (Perfetto opens it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE, RING_GRAD_DTYPES
from megatron_zeppelin.errors import ConfigError, InfeasibleError, ZeppelinError, brief, exit_on_user_error
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.micro_batches import Split, micro_batch_split
from megatron_zeppelin.sampler import DEFAULT_BATCH_FILL, batch_budget
from megatron_zeppelin.sampler.batch_sampler import check_piece_memory
from megatron_zeppelin.sampler.lengths import load_lengths, resolve_lengths
from megatron_zeppelin.sim.pipeline import fits_memory
from megatron_zeppelin.sim.pipeline_report import parse_pp, run_pipeline
from megatron_zeppelin.sim.progress import Progress
from megatron_zeppelin.schedule.trace import read_trace
from megatron_zeppelin.sim.modeled_trace import (check_fits, from_settings, replay_trace, with_recorded_topology,
                                                 write_modeled_trace)
from megatron_zeppelin.sim.simulate import (BASELINE, STATIC, STRATEGY_NAMES, VARIANTS, SimResult, Strategy,
                                            build_strategies, collect_garbage_rarely, format_table, infeasible_notes,
                                            sample_batches, simulate, strategy_cost)
from megatron_zeppelin.sim.static_layout import TRIAL_BATCHES
from megatron_zeppelin.sim.timeline import step_timeline, transport_of
from megatron_zeppelin.topology import load_cluster
from megatron_zeppelin.validation import OneLineParser as _Parser
from megatron_zeppelin.validation import (check_batch_tokens, check_float, check_int, check_not_an_input,
                                          check_output_dir, check_output_file, check_sequence_limits)

DEFAULT_LENGTHS = "synthetic-longtail"
DEFAULT_NODES = 4
#: Most global batches one simulation samples (they are all held in memory, and
#: each takes every strategy's planner; a million is days of planning).
MAX_STEPS = 10**6
#: Baseline first, then the other baselines, then Zeppelin's ablation variants and Zeppelin.
DEFAULT_STRATEGIES = ",".join(STRATEGY_NAMES)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m megatron_zeppelin.sim",
                description="Modeled step time of Zeppelin and the baselines on a length distribution.")
    p.add_argument("--cluster", default="h100-8x400g", help="cluster preset name or YAML file")
    p.add_argument("--nodes", type=int, default=None,
                   help=f"number of nodes (default {DEFAULT_NODES}; with --plan, the nodes it ran on)")
    p.add_argument("--model", default="llama-7b", help="model preset name or YAML file")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS,
                   help="document lengths: .npy / text file, or a bundled name under configs/lengths/")
    p.add_argument("--max-seq-len", type=int, default=131072,
                   help="longer documents are cut into pieces of this many tokens")
    p.add_argument("--tokens-per-gpu", type=int, default=16384, help="per-GPU token cap (memory budget)")
    p.add_argument("--tokens-per-batch", type=int, default=None,
                   help="global batch token budget (default: --micro-batches x --batch-fill x tokens per GPU "
                        "x GPUs)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="gradient accumulation: each global batch runs as this many micro-batches of equal "
                        "modeled work, each planned under the per-GPU cap, one gradient sync per step "
                        "(the trainer's --micro-batches; default 1, with --pp the smallest P)")
    p.add_argument("--pp", type=parse_pp, default=(1,), metavar="P[,P...]",
                   help="pipeline parallelism: P stages of nodes / P whole nodes each, every plan over one "
                        "stage; replays Megatron-Core's 1F1B with each micro-batch's own stage times and "
                        "prints the bubble, the p2p transfers and the memory per stage; a list (2,4,8) "
                        "searches PP, each strategy keeping its fastest TP x PP that fits (default 1)")
    p.add_argument("--recompute", choices=("none", "full"), default="none",
                   help="with --pp: activation recomputation (Megatron's --recompute-granularity full): "
                        "micro-batches in flight keep layer inputs only, the backward runs the forward again")
    p.add_argument("--batch-fill", type=float, default=DEFAULT_BATCH_FILL,
                   help="fraction of the cluster's token capacity a batch fills (default %(default)s: "
                        "slack for whole-sequence packers)")
    p.add_argument("--steps", type=int, default=8, help="global batches to simulate")
    p.add_argument("--seed", type=int, default=0, help="sampler seed")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated, from: {DEFAULT_STRATEGIES}")
    p.add_argument("--cp-size", type=int, default=None,
                   help=f"fix {BASELINE}'s static CP size (TP=1) and ulysses_sp's SP size (default: each "
                        "searches its feasible static layouts, TP x CP for te_cp, and keeps the fastest "
                        "on the first batches, as a user tuning a static run would)")
    p.add_argument("--flexsp-time-limit", type=float, default=2.0, help="flexsp MILP time limit, seconds")
    p.add_argument("--ring-grad-dtype", choices=RING_GRAD_DTYPES, default=DEFAULT_RING_GRAD_DTYPE,
                   help="what Zeppelin's backward ring sends dK/dV in: model (the K/V dtype, as "
                        "TransformerEngine's ring does; default) or fp32 (exact accumulation); the "
                        "baselines keep TransformerEngine's (docs/engine.md)")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--dump-plans", type=Path, default=None,
                   help="write step{k}_{strategy}.json (the Plan JSON) into this folder")
    p.add_argument("--plot", type=Path, default=None, help="per-rank timeline plot of one step (.png)")
    p.add_argument("--plot-step", type=int, default=0, help="which step --plot draws")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--trace", type=Path, default=None,
                   help="write the modeled Chrome trace of one step (--plot-step) of one strategy here")
    p.add_argument("--trace-strategy", default=None,
                   help="which strategy --trace draws (default: zeppelin if simulated, else the first)")
    p.add_argument("--plan", type=Path, default=None,
                   help="time this dumped Plan JSON instead of sampling batches (prints step_time_s=...)")
    return p


def build_replay_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m megatron_zeppelin.sim replay",
                description="Re-time an executed (train --dump-trace) or modeled trace with the cost model.")
    p.add_argument("trace", type=Path, help="a step{k}.json Chrome trace")
    p.add_argument("--cluster", default="cpu-sim", help="cluster preset name or YAML file it ran on")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the trace's world / "
                                                            "GPUs per node)")
    p.add_argument("--model", default="tiny", help="model preset name or YAML file it ran")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    return p


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def run(argv: Sequence[str]) -> SimResult | float:
    """Parse ``argv``, simulate, print the table, write the requested files."""
    if argv and argv[0] == "replay":
        return run_replay(build_replay_parser().parse_args(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.micro_batches is None:   # one micro-batch per stage at least: 1F1B needs M >= P
        args.micro_batches = min(args.pp) if args.pp != (1,) else 1
    if args.pp != (1,):
        return run_pipeline(args, _setup, DEFAULT_NODES)
    if args.recompute != "none":
        raise ConfigError("--recompute shapes the pipeline model's memory and backward; use it with --pp")
    if args.plan is not None:
        check_outputs(args, {"--plan": args.plan, **preset_files(args)})
        return run_plan(args)
    check_outputs(args, {"--lengths": resolve_lengths(args.lengths), **preset_files(args)})
    # From here on a non-terminal stderr gets a line every 10 s (sampling included).
    progress = Progress(0, enabled=False if args.no_progress else None)
    try:
        return _simulate(args, progress)
    finally:
        progress.close()


def _simulate(args: argparse.Namespace, progress: Progress) -> SimResult:
    config, strategies, batches, split = _setup(args)
    names = [s.name for s in strategies]
    traced = args.trace_strategy or ("zeppelin" if "zeppelin" in names else names[0])
    if args.trace is not None and traced not in names:
        raise ConfigError(f"--trace-strategy {traced} is not simulated; pick one of {', '.join(names)}")
    plot_timelines = None
    if args.plot is not None:   # import (and fail on a missing matplotlib) before the long part
        from megatron_zeppelin.sim.plot import plot_timelines

    traced_plan: list[Plan] = []

    def on_plan(step: int, name: str, plan: Plan) -> None:
        if args.dump_plans is not None:
            _write(args.dump_plans / f"step{step}_{name}.json", json.dumps(plan.to_dict()))
        if step == args.plot_step and name == traced:
            traced_plan.append(plan)

    progress.set_total(len(batches) * len(strategies))
    result = simulate(batches, strategies, tokens_per_gpu=args.tokens_per_gpu,
                      time_limit_s=args.flexsp_time_limit, plot_step=args.plot_step,
                      on_plan=on_plan, progress=progress, split=split)
    print(_summary(config, result))
    print(format_table(result))
    for line in infeasible_notes(result):
        print(line)
    if args.json is not None:
        _write(args.json, json.dumps(result.to_dict(config), indent=2))
    if plot_timelines is not None:
        plot_timelines(result, args.plot, title=f"{config['model']} on {config['world_size']}x "
                                                f"{config['gpu']}, step {args.plot_step}")
    if args.trace is not None and traced_plan:
        cost = next(s.cost for s in strategies if s.name == traced)
        write_modeled_trace(args.trace, traced_plan[0], cost, *from_settings(None, cost))
        print(f"modeled trace of {traced}, step {args.plot_step}: {args.trace}")
    return result


def run_plan(args: argparse.Namespace) -> float:
    """``--plan``: the modeled step time of one dumped Plan."""
    _check_positive(args, "nodes")
    cluster = load_cluster(args.cluster, nodes=args.nodes)
    doc = _read_json(args.plan, "plan", "a Plan JSON written by --dump-plans")
    with malformed(f"plan file {str(args.plan)!r}", "a Plan JSON written by --dump-plans"):
        plan = Plan.from_dict(doc).validate()
        cost = with_recorded_topology(CostModel(cluster, load_model(args.model), routing=True,
                                                ring_grad_dtype=args.ring_grad_dtype), doc.get("engine"), args.nodes)
    check_fits(plan.world_size, cost, f"plan {str(args.plan)!r}")
    attn, transport = from_settings(doc.get("engine"), cost)
    if doc.get("engine") is None and plan.strategy not in VARIANTS:
        cost = strategy_cost(cost, plan.strategy)
        transport = transport_of(cost)
    tl = step_timeline(plan, cost, attn=attn, transport=transport, exact=True)
    print(f"{plan.strategy}: {len(plan.seq_lens)} sequences, {sum(plan.seq_lens)} tokens on "
          f"{plan.world_size} GPUs ({cluster.name}), {cost.model.name}; slowest rank {tl.slowest_rank}")
    if args.json is not None:
        _write(args.json, json.dumps({"plan": str(args.plan), "step_time_s": tl.step_s,
                                      "ranks": [dataclasses.asdict(r) for r in tl.ranks]}, indent=2))
    if args.trace is not None:
        write_modeled_trace(args.trace, plan, cost, attn, transport)
    print(f"step_time_s={tl.step_s!r}")
    return tl.step_s


def run_replay(args: argparse.Namespace) -> float:
    """``replay``: re-time a trace's ops and dependencies with the cost model."""
    check_outputs(args, {"the trace": args.trace, **preset_files(args)}, flags=("--json",))
    gpn = load_cluster(args.cluster).topology.gpus_per_node
    with malformed(f"trace {str(args.trace)!r}", "a Chrome trace written by train --dump-trace or sim --trace"):
        schedule, meta, _ = read_trace(args.trace)
        nodes = args.nodes or max(schedule.world_size // gpn, 1)
        cost = with_recorded_topology(CostModel(load_cluster(args.cluster, nodes=nodes), load_model(args.model)),
                                      meta.get("engine"), args.nodes)
        step_s = replay_trace(schedule, meta, cost, str(args.trace))
    print(f"{args.trace}: {len(schedule.ops)} ops on {schedule.world_size} ranks, "
          f"{meta.get('source', 'executed')} trace of {meta.get('strategy', '?')}")
    if args.json is not None:
        _write(args.json, json.dumps({"trace": str(args.trace), "step_time_s": step_s}, indent=2))
    print(f"step_time_s={step_s!r}")
    return step_s


def preset_files(args: argparse.Namespace) -> dict[str, Path]:
    """The --cluster and --model inputs that are files (not bundled preset names)."""
    return {flag: Path(value) for flag, value in (("--cluster", args.cluster), ("--model", args.model))
            if Path(value).is_file()}


def check_outputs(args: argparse.Namespace, inputs: dict[str, Path],
                  flags: Sequence[str] = ("--json", "--plot", "--trace", "--dump-plans")) -> None:
    """Before any work: every output ``flags`` of ``args`` can be written, is none
    of ``inputs`` and none of the other outputs."""
    written: dict[str, Path] = {}
    for flag in flags:
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if path is None:
            continue
        check_not_an_input(path, flag, inputs)
        clash = next((other for other, p in written.items() if Path(p).resolve() == Path(path).resolve()), None)
        if clash is not None:
            raise ConfigError(f"{flag} and {clash} both write {str(path)!r}; one would overwrite the other: pass "
                              "two paths")
        written[flag] = path
        if flag == "--dump-plans":
            check_output_dir(path, flag)
            continue
        if flag == "--plot":
            from megatron_zeppelin.sim.plot import check_plot_path   # matplotlib only when plotting
            check_plot_path(path)
        check_output_file(path, flag)


@contextlib.contextmanager
def malformed(what: str, expected: str) -> Iterator[None]:
    """Reading a user's file: a value of the wrong type or range deep inside
    (a string where a rank goes, 1e308 tokens) becomes one line naming the file."""
    try:
        yield
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError) as exc:
        if isinstance(exc, ZeppelinError):
            raise
        raise ConfigError(f"{what} holds a malformed value ({type(exc).__name__}: {brief(exc, 160)}); pass "
                          f"{expected}") from None


def _read_json(path: Path, what: str, expected: str) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} file {str(path)!r} does not exist; pass {expected}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{what} file {str(path)!r} is not JSON ({exc}); pass {expected}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{what} file {str(path)!r} does not hold a JSON object; pass {expected}")
    return doc


def _setup(args: argparse.Namespace) -> tuple[dict[str, Any], list[Strategy], list[list[int]], Split]:
    """Check the flags; build the strategies, sample the batches and fix their
    micro-batch split.  Returns the JSON ``config`` record too."""
    _check_positive(args, "nodes", "tokens_per_batch", "steps", "cp_size", "micro_batches")
    check_int(args.steps, "--steps", maximum=MAX_STEPS)
    check_float(args.flexsp_time_limit, "--flexsp-time-limit", positive=True)
    check_int(args.seed, "--seed", minimum=0)
    if not 0 <= args.plot_step < args.steps:
        raise ConfigError(f"--plot-step {args.plot_step} is not one of the {args.steps} steps; "
                          f"pick 0..{args.steps - 1}")
    args.nodes = args.nodes or DEFAULT_NODES
    cluster = load_cluster(args.cluster, nodes=args.nodes)
    cost = CostModel(cluster, load_model(args.model), ring_grad_dtype=args.ring_grad_dtype)
    world = cluster.topology.world_size
    check_sequence_limits(args.max_seq_len, args.tokens_per_gpu, world, f"{world} GPUs")
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if args.cp_size is not None and world % args.cp_size:
        raise ConfigError(f"--cp-size {args.cp_size} does not divide {world} GPUs; pick a divisor or leave "
                          "it out to let the static baselines search their layouts")
    lengths_path = resolve_lengths(args.lengths)
    check_batch_tokens(args.micro_batches * args.tokens_per_gpu * world,
                       "--micro-batches x --tokens-per-gpu x GPUs")
    tokens_per_batch = args.tokens_per_batch or args.micro_batches * batch_budget(
        args.tokens_per_gpu, world, args.max_seq_len, args.batch_fill)
    check_batch_tokens(tokens_per_batch, "--tokens-per-batch")
    lengths = load_lengths(lengths_path)
    check_piece_memory(lengths, args.max_seq_len, str(lengths_path))
    batches = sample_batches(lengths, max_seq_len=args.max_seq_len,
                             tokens_per_batch=tokens_per_batch, steps=args.steps, seed=args.seed)
    split = micro_batch_split(args.micro_batches, tokens_per_gpu=args.tokens_per_gpu, data_parallel_size=world,
                              max_seq_len=args.max_seq_len, batch_fill=args.batch_fill, cost=cost)
    # A static layout is tried on what one pass of it runs: the first micro-batches.
    try:
        trial = [[lens[i] for i in g] for lens in batches[:TRIAL_BATCHES] for g in split(lens)]
    except InfeasibleError as exc:
        raise ConfigError(str(exc)) from None
    stages = getattr(args, "pipeline_stages", None)     # set by --pp (sim/pipeline_report.py)
    strategies = build_strategies(names, cost, cp_size=args.cp_size, layout_batches=trial,
                                  max_seq_len=args.max_seq_len, tokens_per_gpu=args.tokens_per_gpu,
                                  time_limit_s=args.flexsp_time_limit,
                                  fits=fits_memory(stages, len(trial), args.recompute == "full") if stages else None)
    static = {s.name: s for s in strategies if s.name in STATIC}
    layouts = {n: st.layout for n, st in static.items()}
    layouts.update({"zeppelin": s.layout for s in strategies if s.name in VARIANTS and s.layout})
    te = static.get(BASELINE)
    cp_size = args.cp_size if te is None or te.cp_size is None else te.cp_size
    topo = cluster.topology
    config = {"cluster": cluster.name, "nodes": topo.nodes, "gpus_per_node": topo.gpus_per_node,
              "nics_per_node": topo.nics_per_node, "world_size": world, "gpu": cluster.gpu.name,
              "model": cost.model.name, "lengths": str(lengths_path), "max_seq_len": args.max_seq_len,
              "tokens_per_gpu": args.tokens_per_gpu, "tokens_per_batch": tokens_per_batch,
              "batch_fill": args.batch_fill, "seed": args.seed, "strategies": names,
              "te_cp_cp_size": cp_size, "te_cp_tp_size": te.tp_size if te is not None else None,
              "static_layouts": layouts, "tp_sizes": {s.name: s.tp_size for s in strategies},
              "flexsp_time_limit_s": args.flexsp_time_limit,
              "micro_batches": args.micro_batches, "moe": cost.model.moe_summary,
              "ring_grad_dtype": cost.ring_grad_dtype}  # what the simulator models
    return config, strategies, batches, split


def _summary(config: dict[str, Any], result: SimResult) -> str:
    tokens = sum(sum(lens) for lens in result.seq_lens) / len(result.seq_lens)
    seqs = sum(len(lens) for lens in result.seq_lens) / len(result.seq_lens)
    return (f"{config['model']} on {config['world_size']} GPUs ({config['cluster']}, {config['nodes']} nodes); "
            f"{len(result.seq_lens)} steps of ~{tokens:,.0f} tokens / {seqs:.0f} sequences from "
            f"{Path(config['lengths']).name}; max_seq_len {config['max_seq_len']}, "
            f"{config['tokens_per_gpu']} tokens/GPU, {BASELINE} "
            + (f"TP={config['te_cp_tp_size'] or 1} x CP={config['te_cp_cp_size']}" if config["te_cp_cp_size"]
               else "has no layout") + f"; lower bound {result.lower_bound_step_s * 1e3:.1f} ms"
            + "".join(f"\nstatic layout {line}" for line in config["static_layouts"].values() if line)
            + f"\nmodeled: TP per strategy {_tp_sizes(config)}, {config['micro_batches']} micro-batch"
              f"{'es' if config['micro_batches'] > 1 else ''} per step, "
              f"{config['moe']}")


def _tp_sizes(config: dict[str, Any]) -> str:
    sizes = set(config["tp_sizes"].values())
    return str(sizes.pop()) if len(sizes) == 1 else ", ".join(f"{n} {t}" for n, t in config["tp_sizes"].items())


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {str(path)!r}: {exc.strerror}; pick a writable path") from None


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: user mistakes print one line and exit 2."""
    if sys.argv and sys.argv[0].endswith("__main__.py"):
        sys.argv[0] = "megatron_zeppelin.sim"   # `python -m` run: name the module in error lines
    if argv is None:                            # the process's entry point, not a caller's function
        collect_garbage_rarely()
    exit_on_user_error(lambda: run(sys.argv[1:] if argv is None else argv))
