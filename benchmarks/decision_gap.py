"""What deciding by the surrogate costs against deciding by the replay, per speedup-matrix cell.

For every cell (model x cluster x max length x data set, 8 nodes, the speedup
matrix's per-model token caps and batches) each batch is planned as the
matrix's ``zeppelin`` plans it: at the TP size the layout search gives it,
with the per-batch decision's candidates (``decision_candidates``: routed and
direct crossings, remap on and off, the baselines' layouts; every packing pass
the decision may run, not only the one the surrogate keeps per context).  The decision
runs the candidate the surrogate puts fastest, unless the replay settles a
close call (``planner/zeppelin_decide.py: settled``); an exhaustive decision
would replay every candidate and run the fastest.  The gap is how much slower
the decision's plan replays than the exhaustive pick; the surrogate's own pick
(before any settling) is shown beside it.

    python benchmarks/decision_gap.py            # the speedup matrix's --quick cells
    python benchmarks/decision_gap.py --full     # every cell (tens of minutes on the 2-core box)

Prints a markdown section (appended to docs/results/surrogate.md with --out).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError, exit_on_user_error
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.planner.surrogate import StepSurrogate
from megatron_zeppelin.planner.zeppelin_decide import decide, decision_candidates
from megatron_zeppelin.sampler import batch_budget
from megatron_zeppelin.sampler.lengths import load_lengths
from megatron_zeppelin.sim.simulate import build_strategies, sample_batches
from megatron_zeppelin.sim.strategy import plan_context
from megatron_zeppelin.sim.timeline import step_timeline
from megatron_zeppelin.topology import load_cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speedup_matrix import K, TOKENS_PER_GPU, default_lengths  # noqa: E402  (the matrix's cells)

#: The matrix's FlexSP MILP limit (its --flexsp-time-limit default); zeppelin's candidates include FlexSP's layouts.
FLEXSP_TIME_LIMIT_S = 2.0
CLUSTERS = ["h100-8x400g", "a800-4x200g", "h200-8x400g"]
MAX_LENS = [64 * K, 128 * K, 256 * K, 512 * K]


def cells(full: bool) -> list[tuple[str, str, int, Path]]:
    """The speedup matrix's cells (its ``--quick`` corner unless ``full``)."""
    models, clusters, lens, data = list(TOKENS_PER_GPU), CLUSTERS, MAX_LENS, default_lengths()
    if not full:
        models, clusters, lens, data = models[1:3], clusters[:2], lens[1:3], data[-2:]
    return [(m, c, L, d) for m in models for c in clusters for L in lens for d in data]


def run(args: argparse.Namespace) -> str:
    rows, start = [], time.perf_counter()
    for i, (model, cluster_name, max_len, path) in enumerate(cells(args.full)):
        cluster = load_cluster(cluster_name, nodes=args.nodes)
        world, cap = cluster.topology.world_size, TOKENS_PER_GPU[model]
        name = f"{model} {cluster_name} {max_len // K}K {path.stem}"
        if max_len > cap * world:
            continue
        batches = sample_batches(load_lengths(path), max_seq_len=max_len,
                                 tokens_per_batch=batch_budget(cap, world, max_len), steps=args.steps, seed=args.seed)
        zeppelin, = build_strategies(["zeppelin"], CostModel(cluster, load_model(model)), layout_batches=batches,
                                     max_seq_len=max_len, tokens_per_gpu=cap, time_limit_s=FLEXSP_TIME_LIMIT_S)
        if zeppelin.infeasible:
            continue
        ctx = plan_context(zeppelin, cap, FLEXSP_TIME_LIMIT_S)
        clock, gaps = StepSurrogate(ctx.cost), []
        for lens in batches:
            try:
                plans = decision_candidates(lens, ctx, every_pass=True)
            except InfeasibleError:
                continue
            replayed = [step_timeline(p, ctx.cost, reuse=False).step_s for p in plans]
            modeled = [clock.step_s(p) for p in plans]
            decided = step_timeline(decide(lens, ctx), ctx.cost, reuse=False).step_s
            gaps.append((replayed[modeled.index(min(modeled))] / min(replayed) - 1, decided / min(replayed) - 1))
        if not gaps:
            continue
        surrogate, settled = (max(g) for g in zip(*gaps))
        rows.append((name, zeppelin.tp_size, len(plans), surrogate, settled))
        print(f"[{i + 1}] {time.perf_counter() - start:5.0f} s {name} TP={zeppelin.tp_size}: surrogate's pick "
              f"{surrogate:.3%}, decided {settled:.3%}", file=sys.stderr)
    command = "python benchmarks/decision_gap.py " + shlex.join(sys.argv[1:])
    table = "\n".join(f"| {n} | {tp} | {c} | {s:.3%} | {d:.3%} |" for n, tp, c, s, d in rows)
    over = [r for r in rows if r[4] > 0.005]
    over_surrogate = [r for r in rows if r[3] > 0.005]
    return (f"\n## The decision's pick against the exhaustive decision\n\nCommand: `{command.strip()}` "
            f"({time.perf_counter() - start:.0f} s wall on the shared 2-core box)\n\n"
            f"Per speedup-matrix cell ({'every cell' if args.full else 'the matrix --quick corner'}, "
            f"{args.nodes} nodes, {args.steps} batch(es) per cell, at the TP size the matrix's layout search gives "
            f"zeppelin): how much slower the plan the decision runs replays than the fastest replayed candidate "
            f"(the exhaustive decision: every candidate and every packing pass the decision may run), and the "
            f"surrogate's own pick before the replay settles close calls.  "
            f"Decided: worst gap **{max(r[4] for r in rows):.3%}**, cells over 0.5 %: **{len(over)} of {len(rows)}**"
            f"{' (' + ', '.join(f'{r[0]} {r[4]:.3%}' for r in over) + ')' if over else ''}.  "
            f"Surrogate's pick: worst {max(r[3] for r in rows):.3%}, over 0.5 %: {len(over_surrogate)}.\n\n"
            "| cell | TP | candidates | surrogate's pick | decided |\n| --- | --- | --- | --- | --- |\n" + table + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="every cell of the speedup matrix")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="append the section to this file")
    args = p.parse_args()
    text = exit_on_user_error(lambda: run(args))
    print(text)
    if args.out is not None:
        with args.out.open("a", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
