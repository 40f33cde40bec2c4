"""Planning time of Zeppelin and FlexSP as the cluster grows (~16 sequences per GPU).

A planner runs once per global batch on the critical path (or overlapped with
the previous step), so it must stay far below a step time.  Batches are drawn
from a length distribution (documents cut at ``--max-seq-len``), 16 sequences
per GPU, and the per-GPU cap is set just above the batch's average load.

    python benchmarks/planner_latency.py            # 64 .. 4096 GPUs
    python benchmarks/planner_latency.py --quick    # 64 and 256 GPUs

Prints a markdown table and writes it as the head of docs/results/planner_latency.md (the page's
``## `` sections below it, earlier runs, are kept).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError, exit_on_user_error
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.planner.base import PlanContext, get_planner
from megatron_zeppelin.sampler.batch_sampler import PieceTable
from megatron_zeppelin.sampler.lengths import load_lengths, resolve_lengths
from megatron_zeppelin.planner.surrogate import surrogate_clock
from megatron_zeppelin.sim.timeline import replay_clock
from megatron_zeppelin.topology import load_cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_page import write_head  # noqa: E402  (benchmarks/ beside this script)

REPO = Path(__file__).resolve().parent.parent
SEQS_PER_GPU = 16


def batch(pieces: np.ndarray, world: int, rng: np.random.Generator) -> list[int]:
    return rng.choice(pieces, SEQS_PER_GPU * world).tolist()


def time_planner(name: str, lens: list[int], ctx: PlanContext) -> tuple[float | None, float, str]:
    """Planning milliseconds, wall-clock (None when infeasible) and CPU, and the
    plan's tier counts.  CPU time says what the planner costs when the machine
    is shared (the development box runs several jobs on its 2 cores)."""
    planner = get_planner(name)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        plan = planner.plan(lens, ctx)
    except InfeasibleError as exc:
        return None, 0.0, f"infeasible: {exc}"
    ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
    t = plan.tier_counts()
    return ms, cpu_ms, f"{t.local}/{t.intra}/{t.inter}/{t.ulysses}"


def context(args: argparse.Namespace, c: CostModel, cap: int) -> PlanContext:
    if args.decide:     # as pretrain_gpt.py --zeppelin and the trainer plan by default
        routed = c.routed(True)
        return PlanContext(cost=routed, tokens_per_gpu=cap, remap_enabled=True, step_model=surrogate_clock(routed),
                           settle_model=replay_clock(routed))
    return PlanContext(cost=c, tokens_per_gpu=cap, time_limit_s=args.flexsp_time_limit)


def run(args: argparse.Namespace) -> str:
    cluster = load_cluster(args.cluster)
    cost = CostModel(cluster, load_model(args.model))
    pieces = PieceTable.from_lengths(load_lengths(resolve_lengths(args.lengths)), args.max_seq_len).lengths
    rng = np.random.default_rng(args.seed)
    gpus_per_node = cluster.topology.gpus_per_node
    rows = []
    too_slow: dict[str, str] = {}   # planner -> why it is no longer run at larger sizes
    # One untimed batch on 8 GPUs (its own cost model, so no per-cluster cache carries
    # over): what a process pays once -- numba loading the planners' compiled loops
    # (~0.3 s), first imports -- is not charged to the first timed batch.
    warm_lens = batch(pieces, 8, np.random.default_rng(args.seed + 1))
    warm_ctx = context(args, CostModel(cluster.with_nodes(max(8 // gpus_per_node, 1)), cost.model),
                       max(warm_lens) + sum(warm_lens) // 8)
    for name in args.planners:
        if name != "flexsp":    # its MILP runs for its time limit; nothing of it is compiled
            time_planner(name, warm_lens, warm_ctx)
    for world in args.gpus:
        c = CostModel(cluster.with_nodes(max(world // gpus_per_node, 1)), cost.model)
        times: dict[str, list[float]] = {p: [] for p in args.planners}
        cpu: dict[str, list[float]] = {p: [] for p in args.planners}
        notes: dict[str, str] = {}
        for rep in range(args.repeats):
            lens = batch(pieces, world, rng)
            # Cap just above the mean load (and never below one GPU's share of
            # the longest sequence): memory-bound, as in training.
            cap = max(int(1.05 * sum(lens) / world), -(-args.max_seq_len // world))
            ctx = context(args, c, cap)
            for name in args.planners:
                if name in too_slow:
                    continue
                ms, cpu_ms, note = time_planner(name, lens, ctx)
                notes[name] = note
                if ms is not None:
                    times[name].append(ms)
                    cpu[name].append(cpu_ms)
                    if ms > args.budget_s * 1e3:   # keep the benchmark to minutes
                        too_slow[name] = f"skipped: {ms / 1e3:.0f} s at {world} GPUs"
            print(f"  {world} GPUs, repeat {rep + 1}/{args.repeats}: "
                  + ", ".join(f"{n} {times[n][-1]:.1f} ms" if times[n] else f"{n} -" for n in args.planners),
                  file=sys.stderr)
        row = [str(world), str(SEQS_PER_GPU * world)]
        for name in args.planners:
            t = times[name]
            if t:
                row += [f"{statistics.median(t):.1f}", f"{np.percentile(t, 90):.1f}",
                        f"{statistics.median(cpu[name]):.1f}", notes[name]]
            else:
                row += [too_slow.get(name) or notes.get(name, "-"), "-", "-", "-"]
        rows.append(row)
    head = ["GPUs", "sequences"]
    for name in args.planners:
        head += [f"{name} median ms", f"{name} p90 ms", f"{name} median CPU ms",
                 f"{name} tiers (local/intra/inter/ulysses)"]
    table = [head, ["---"] * len(head), *rows]
    text = "\n".join("| " + " | ".join(r) + " |" for r in table)
    command = "python benchmarks/planner_latency.py " + shlex.join(sys.argv[1:])
    return (f"# Planner latency\n\nCommand: `{command.strip()}`\n\n"
            f"{args.model} on {cluster.name}; {SEQS_PER_GPU} sequences per GPU drawn from "
            f"`{args.lengths}` (documents cut at {args.max_seq_len} tokens); {args.repeats} batches per size; "
            + ("routing and remap on, each batch's plan decided among its candidates by the replay's "
               "surrogate, the replay settling its close calls on routed plans (`--zeppelin-decide on`, the "
               "default; `planner/settle.py`); " if args.decide else "")
            + f"flexsp MILP time limit {args.flexsp_time_limit} s; a planner that takes over {args.budget_s:.0f} s "
            f"on one batch is not run at larger sizes; one untimed 8-GPU batch first (what a process pays "
            f"once: numba loading the compiled loops).  Wall-clock on this machine "
            f"(a shared 2-core CPU box: absolute numbers are pessimistic, the trend is the point), "
            f"and the planner's CPU time (what it costs with a core to itself).\n\n"
            f"{text}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024, 4096])
    p.add_argument("--planners", type=lambda s: s.split(","), default=["zeppelin", "flexsp"])
    p.add_argument("--cluster", default="h100-8x400g")
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--lengths", default="synthetic-longtail")
    p.add_argument("--max-seq-len", type=int, default=524288,
                   help="documents are cut here; long enough that the longest pieces need several GPUs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--flexsp-time-limit", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=20.0,
                   help="a planner slower than this on one batch is not run at larger sizes")
    p.add_argument("--decide", action="store_true",
                   help="plan with routing and remap on and the per-batch decision (candidates compared by the "
                        "replay's surrogate), as pretrain_gpt.py --zeppelin (--zeppelin-decide on) and the trainer do")
    p.add_argument("--quick", action="store_true", help="64 and 256 GPUs, 2 repeats")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "planner_latency.md")
    args = p.parse_args()
    if args.quick:
        args.gpus, args.repeats = [g for g in args.gpus if g <= 256], min(args.repeats, 2)
    report = exit_on_user_error(lambda: run(args))
    print(report)
    write_head(args.out, report)


if __name__ == "__main__":
    main()
