"""``python -m megatron_zeppelin.sim``: modeled step time of each strategy, side by side.

    python -m megatron_zeppelin.sim                       # bundled sample, default cluster
    python -m megatron_zeppelin.sim --cluster a800-4x200g --nodes 8 --model llama-13b \\
        --lengths my_lengths.npy --max-seq-len 262144 --tokens-per-gpu 16384 \\
        --strategies te_cp,zeppelin_base,zeppelin_noremap,zeppelin --json out.json --plot out.png

Every strategy plans the same global batches (``ZeppelinBatchSampler``); the
step time of each plan comes from the analytic cost model (docs/simulator.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import ConfigError, exit_on_user_error
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.presets import CONFIG_ROOT
from megatron_zeppelin.sampler import DEFAULT_BATCH_FILL, batch_budget
from megatron_zeppelin.sampler.lengths import load_lengths
from megatron_zeppelin.sim.progress import Progress
from megatron_zeppelin.sim.simulate import (BASELINE, STRATEGY_NAMES, SimResult, Strategy, build_strategies,
                                            format_table, infeasible_notes, sample_batches, simulate,
                                            te_cp_size)
from megatron_zeppelin.topology import load_cluster
from megatron_zeppelin.validation import OneLineParser as _Parser, check_float, check_int

DEFAULT_LENGTHS = "synthetic-longtail"
#: Baseline first, then the other baselines, then Zeppelin's ablation variants and Zeppelin.
DEFAULT_STRATEGIES = ",".join(STRATEGY_NAMES)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m megatron_zeppelin.sim",
                description="Modeled step time of Zeppelin and the baselines on a length distribution.")
    p.add_argument("--cluster", default="h100-8x400g", help="cluster preset name or YAML file")
    p.add_argument("--nodes", type=int, default=4, help="number of nodes (overrides the preset)")
    p.add_argument("--model", default="llama-7b", help="model preset name or YAML file")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS,
                   help="document lengths: .npy / text file, or a bundled name under configs/lengths/")
    p.add_argument("--max-seq-len", type=int, default=131072,
                   help="longer documents are cut into pieces of this many tokens")
    p.add_argument("--tokens-per-gpu", type=int, default=16384, help="per-GPU token cap (memory budget)")
    p.add_argument("--tokens-per-batch", type=int, default=None,
                   help="global batch token budget (default: --batch-fill x tokens per GPU x GPUs)")
    p.add_argument("--batch-fill", type=float, default=DEFAULT_BATCH_FILL,
                   help="fraction of the cluster's token capacity a batch fills (default %(default)s: "
                        "slack for whole-sequence packers)")
    p.add_argument("--steps", type=int, default=8, help="global batches to simulate")
    p.add_argument("--seed", type=int, default=0, help="sampler seed")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated, from: {DEFAULT_STRATEGIES}")
    p.add_argument("--cp-size", type=int, default=None,
                   help=f"{BASELINE}'s static CP size (default: smallest power of two that fits "
                        "--max-seq-len in --tokens-per-gpu)")
    p.add_argument("--flexsp-time-limit", type=float, default=2.0, help="flexsp MILP time limit, seconds")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--dump-plans", type=Path, default=None,
                   help="write step{k}_{strategy}.json (the Plan JSON) into this folder")
    p.add_argument("--plot", type=Path, default=None, help="per-rank timeline plot of one step (.png)")
    p.add_argument("--plot-step", type=int, default=0, help="which step --plot draws")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def resolve_lengths(name_or_path: str) -> Path:
    """A lengths file by path, or a bundled sample by name (``configs/lengths/<name>.npy``)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    bundled = CONFIG_ROOT / "lengths" / f"{name_or_path}.npy"
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in (CONFIG_ROOT / "lengths").glob("*.npy"))
    raise ConfigError(f"lengths file {name_or_path!r} does not exist; pass a .npy or text file, or a "
                      f"bundled sample: {', '.join(names)}")


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def run(argv: Sequence[str]) -> SimResult:
    """Parse ``argv``, simulate, print the table, write the requested files."""
    args = build_parser().parse_args(argv)
    config, strategies, batches = _setup(args)
    plot_timelines = None
    if args.plot is not None:   # import (and fail on a missing matplotlib) before the long part
        from megatron_zeppelin.sim.plot import plot_timelines
    if args.dump_plans is not None:
        _mkdir(args.dump_plans)

    def dump(step: int, name: str, plan: Plan) -> None:
        _write(args.dump_plans / f"step{step}_{name}.json", json.dumps(plan.to_dict()))

    progress = Progress(len(batches) * len(strategies), enabled=False if args.no_progress else None)
    result = simulate(batches, strategies, tokens_per_gpu=args.tokens_per_gpu,
                      time_limit_s=args.flexsp_time_limit, plot_step=args.plot_step,
                      on_plan=dump if args.dump_plans is not None else None, progress=progress)
    print(_summary(config, result))
    print(format_table(result))
    for line in infeasible_notes(result):
        print(line)
    if args.json is not None:
        _write(args.json, json.dumps(result.to_dict(config), indent=2))
    if plot_timelines is not None:
        plot_timelines(result, args.plot, title=f"{config['model']} on {config['world_size']}x "
                                                f"{config['gpu']}, step {args.plot_step}")
    return result


def _setup(args: argparse.Namespace) -> tuple[dict[str, Any], list[Strategy], list[list[int]]]:
    """Check the flags; build the strategies and sample the batches.  Returns the
    JSON ``config`` record too."""
    _check_positive(args, "nodes", "max_seq_len", "tokens_per_gpu", "tokens_per_batch", "steps", "cp_size")
    check_float(args.flexsp_time_limit, "--flexsp-time-limit", positive=True)
    check_int(args.seed, "--seed", minimum=0)
    if not 0 <= args.plot_step < args.steps:
        raise ConfigError(f"--plot-step {args.plot_step} is not one of the {args.steps} steps; "
                          f"pick 0..{args.steps - 1}")
    cluster = load_cluster(args.cluster, nodes=args.nodes)
    cost = CostModel(cluster, load_model(args.model))
    world = cluster.topology.world_size
    if args.max_seq_len > args.tokens_per_gpu * world:
        raise ConfigError(f"--tokens-per-gpu {args.tokens_per_gpu} x {world} GPUs cannot hold one "
                          f"{args.max_seq_len}-token sequence; raise --tokens-per-gpu or --nodes, or "
                          "lower --max-seq-len")
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    cp_size = args.cp_size or te_cp_size(args.max_seq_len, args.tokens_per_gpu)
    if BASELINE in names and args.cp_size is None and world % cp_size:
        raise ConfigError(f"{BASELINE} needs a CP size of {cp_size} to fit --max-seq-len {args.max_seq_len} "
                          f"at --tokens-per-gpu {args.tokens_per_gpu}, which does not divide {world} GPUs; "
                          f"pass --cp-size, change --nodes, or leave {BASELINE} out of --strategies")
    strategies = build_strategies(names, cost, cp_size=cp_size)
    lengths_path = resolve_lengths(args.lengths)
    tokens_per_batch = args.tokens_per_batch or batch_budget(args.tokens_per_gpu, world, args.max_seq_len,
                                                             args.batch_fill)
    batches = sample_batches(load_lengths(lengths_path), max_seq_len=args.max_seq_len,
                             tokens_per_batch=tokens_per_batch, steps=args.steps, seed=args.seed)
    topo = cluster.topology
    config = {"cluster": cluster.name, "nodes": topo.nodes, "gpus_per_node": topo.gpus_per_node,
              "nics_per_node": topo.nics_per_node, "world_size": world, "gpu": cluster.gpu.name,
              "model": cost.model.name, "lengths": str(lengths_path), "max_seq_len": args.max_seq_len,
              "tokens_per_gpu": args.tokens_per_gpu, "tokens_per_batch": tokens_per_batch,
              "batch_fill": args.batch_fill, "seed": args.seed, "strategies": names,
              "te_cp_cp_size": cp_size, "flexsp_time_limit_s": args.flexsp_time_limit}
    return config, strategies, batches


def _summary(config: dict[str, Any], result: SimResult) -> str:
    tokens = sum(sum(lens) for lens in result.seq_lens) / len(result.seq_lens)
    seqs = sum(len(lens) for lens in result.seq_lens) / len(result.seq_lens)
    return (f"{config['model']} on {config['world_size']} GPUs ({config['cluster']}, {config['nodes']} nodes); "
            f"{len(result.seq_lens)} steps of ~{tokens:,.0f} tokens / {seqs:.0f} sequences from "
            f"{Path(config['lengths']).name}; max_seq_len {config['max_seq_len']}, "
            f"{config['tokens_per_gpu']} tokens/GPU, {BASELINE} CP={config['te_cp_cp_size']}; "
            f"lower bound {result.lower_bound_step_s * 1e3:.1f} ms")


def _mkdir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create folder {str(path)!r}: {exc.strerror}; pick a writable path") from None


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {str(path)!r}: {exc.strerror}; pick a writable path") from None


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: user mistakes print one line and exit 2."""
    if sys.argv and sys.argv[0].endswith("__main__.py"):
        sys.argv[0] = "megatron_zeppelin.sim"   # `python -m` run: name the module in error lines
    exit_on_user_error(lambda: run(sys.argv[1:] if argv is None else argv))
