"""How far the decision's clock (``planner/surrogate.py``) is from the replay.

Random batches over clusters, models, worlds and length distributions; each
batch is planned as the per-batch decision plans it (every candidate of
``planner/zeppelin_decide.py: decision_candidates``: routed and direct
crossings, remap on and off, static CP's uniform layouts), and every candidate
is timed by the replay (``sim/timeline.py: step_timeline``, the reported step)
and by the surrogate.  Reports the relative error (p50 / p95 / max), by tier
mix, and the share of candidate pairs of one batch more than 2 % apart by the
replay that the surrogate orders as the replay does.

    python benchmarks/surrogate_error.py                 # the default mix (see --mix)
    python benchmarks/surrogate_error.py --mix 8:20,16:20 --out /tmp/s.md

Writes docs/results/surrogate.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.tp import tp_problem, tp_view
from megatron_zeppelin.errors import ConfigError, InfeasibleError, exit_on_user_error
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.surrogate import StepSurrogate
from megatron_zeppelin.planner.zeppelin_decide import decision_candidates
from megatron_zeppelin.sampler import batch_budget
from megatron_zeppelin.sampler.lengths import load_lengths, resolve_lengths
from megatron_zeppelin.sim.simulate import sample_batches
from megatron_zeppelin.sim.timeline import step_timeline
from megatron_zeppelin.topology import load_cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_page import write_head  # noqa: E402  (benchmarks/ beside this script)

REPO = Path(__file__).resolve().parent.parent
CLUSTERS = ("h100-8x400g", "h200-8x400g", "a800-4x200g", "a100-40g-4x100g")
#: Model -> per-GPU token cap (the speedup matrix's).
MODELS = {"llama-3b": 32768, "llama-7b": 16384, "llama-13b": 16384}
LENGTHS = ("synthetic-books", "synthetic-longtail", "synthetic-web")
MAX_LENS = (32768, 65536, 131072, 262144, 524288)
#: Close pairs are not counted: the replay itself calls them a tie.
PAIR_GAP = 0.02


def parse_mix(text: str) -> list[tuple[int, int]]:
    """``world:batches,...`` -> [(world, batches)]."""
    try:
        mix = [(int(w), int(n)) for w, n in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ConfigError(f"--mix {text!r}: write world:batches pairs, e.g. 8:100,64:20") from None
    if not mix or any(w < 8 or w % 8 or n < 1 for w, n in mix):
        raise ConfigError(f"--mix {text!r}: worlds must be multiples of 8 GPUs and batch counts positive")
    return mix


def parse_tp(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]: TP sizes every cluster and model here allows (1, 2, 4: the
    clusters have 4 or 8 GPUs a node, the models 32 or 40 heads), so a batch always has one."""
    try:
        tps = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write TP sizes, e.g. 1,2,4") from None
    if not tps or any(t not in (1, 2, 4) for t in tps):
        raise argparse.ArgumentTypeError(f"{text!r}: TP sizes are 1, 2 or 4 here")
    return tps


def cases(world: int, count: int, rng: np.random.Generator, docs: dict[str, np.ndarray], tps: list[int],
          tp_rng: np.random.Generator):
    """``count`` random (description, cost, candidates) of ``world`` GPUs, each
    at a TP size drawn from ``tps`` (by ``tp_rng``, so the batches drawn do not
    depend on it) that the cluster and model allow."""
    made = 0
    while made < count:
        cluster = load_cluster(str(rng.choice(CLUSTERS)))
        cluster = cluster.with_nodes(world // cluster.topology.gpus_per_node)
        model, lengths = str(rng.choice(list(MODELS))), str(rng.choice(LENGTHS))
        cap, max_len = MODELS[model], int(rng.choice(MAX_LENS))
        if max_len > cap * world:
            continue
        cost = CostModel(cluster, load_model(model), routing=True)
        lens = sample_batches(docs[lengths], max_seq_len=max_len, tokens_per_batch=batch_budget(cap, world, max_len),
                              steps=1, seed=int(rng.integers(1 << 30)))[0]
        m = cost.model
        allowed = [t for t in tps if tp_problem(cluster, m.num_attention_heads, m.num_query_groups, t) is None]
        if not allowed:
            continue
        tp = int(tp_rng.choice(allowed))
        # A TP group is one rank of the plan, with the group's tokens (as the simulator's TP strategies plan).
        cost = tp_view(cost, tp) if tp > 1 else cost
        ctx = PlanContext(cost=cost, tokens_per_gpu=cap * tp, tp_size=tp, remap_enabled=True, remap_decided=True)
        try:
            plans = decision_candidates(lens, ctx)
        except InfeasibleError:
            continue
        made += 1
        yield f"{world} GPUs {cluster.name} {model} TP={tp} {lengths} max {max_len // 1024}K", tp, cost, plans


def tier_mix(plan) -> str:
    t = plan.tier_counts()
    kinds = [name for name, n in (("local", t.local), ("intra", t.intra), ("inter", t.inter),
                                  ("ulysses", t.ulysses)) if n]
    return "+".join(kinds)


def run(args: argparse.Namespace) -> str:
    rng = np.random.default_rng(args.seed)
    docs = {name: load_lengths(resolve_lengths(name)) for name in LENGTHS}
    rows, pairs_total, pairs_same, batches = [], 0, 0, 0
    sur_cpu = replay_cpu = 0.0
    t_start = time.perf_counter()
    tp_rng = np.random.default_rng(args.seed + 1)
    for world, count in parse_mix(args.mix):
        for what, tp, cost, plans in cases(world, count, rng, docs, args.tp, tp_rng):
            batches += 1
            clock = StepSurrogate(cost)
            c0 = time.process_time()
            replayed = [step_timeline(p, cost, reuse=False).step_s for p in plans]
            c1 = time.process_time()
            modeled = [clock.step_s(p) for p in plans]
            sur_cpu += time.process_time() - c1
            replay_cpu += c1 - c0
            for p, r, m in zip(plans, replayed, modeled):
                rows.append((m / r - 1, world, tier_mix(p), p.routed, bool(p.remap_schedule()), what, tp))
            for i in range(len(plans)):
                for j in range(i + 1, len(plans)):
                    if abs(replayed[i] / replayed[j] - 1) > PAIR_GAP:
                        pairs_total += 1
                        pairs_same += (replayed[i] < replayed[j]) == (modeled[i] < modeled[j])
            err = max(abs(m / r - 1) for r, m in zip(replayed, modeled))
            print(f"  {batches}: {what}, {len(plans)} candidates, worst {err:.2%} "
                  f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
            # The report so far, after every batch: a long run stopped early still leaves one.
            text = report(args, rows, pairs_total, pairs_same, batches, sur_cpu, replay_cpu,
                          time.perf_counter() - t_start)
            write_head(args.out, text)
    return text


def percentiles(errs: np.ndarray) -> str:
    e = np.abs(errs) * 100
    return f"{np.percentile(e, 50):.2f} % | {np.percentile(e, 95):.2f} % | {e.max():.2f} %"


def report(args, rows, pairs_total, pairs_same, batches, sur_cpu, replay_cpu, wall) -> str:
    errs = np.array([r[0] for r in rows])
    lines = ["| slice | plans | p50 | p95 | max |", "| --- | --- | --- | --- | --- |",
             f"| all | {len(rows)} | {percentiles(errs)} |"]

    def slice_rows(label, key):
        for value in sorted({key(r) for r in rows} - {None}, key=str):
            e = np.array([r[0] for r in rows if key(r) == value])
            lines.append(f"| {label} {value} | {len(e)} | {percentiles(e)} |")

    slice_rows("GPUs", lambda r: r[1])
    slice_rows("tiers", lambda r: r[2])
    slice_rows("routed", lambda r: r[3])
    slice_rows("remap", lambda r: r[4])
    slice_rows("TP", lambda r: r[6])
    slice_rows("TP>1 routed", lambda r: r[3] if r[6] > 1 else None)
    worst = sorted(rows, key=lambda r: -abs(r[0]))[:8]
    worst_lines = [f"| {r[0]:+.2%} | {r[5]} | {r[2]} | routed={r[3]} remap={r[4]} |" for r in worst]
    command = "python benchmarks/surrogate_error.py " + shlex.join(sys.argv[1:])
    share = pairs_same / max(pairs_total, 1)
    return (f"# The decision's clock against the replay\n\nCommand: `{command.strip()}` "
            f"({wall:.0f} s wall on the shared 2-core box; replays {replay_cpu:.0f} s CPU, "
            f"surrogate {sur_cpu:.1f} s CPU)\n\n"
            f"{batches} random batches (worlds:batches `{args.mix}`; clusters {', '.join(CLUSTERS)}; "
            f"models {', '.join(MODELS)} at their speedup-matrix token caps; TP sizes drawn from "
            f"{', '.join(map(str, args.tp))} (those the cluster and model allow; a TP group is one rank); "
            f"lengths {', '.join(LENGTHS)} "
            f"cut at 32K-512K; the sampler's default fill), each planned as the per-batch decision plans it "
            f"(`decision_candidates`: routed and direct crossings, remap on and off, static CP's uniform "
            f"layouts), every candidate timed by the replay (`step_timeline`, the reported step) and by the "
            f"surrogate (`planner/surrogate.py`).\n\n"
            f"Relative error |surrogate / replay - 1| over {len(rows)} candidate plans:\n\n"
            + "\n".join(lines)
            + f"\n\nCandidate pairs of one batch more than {PAIR_GAP:.0%} apart by the replay: {pairs_total}; "
            f"the surrogate orders {pairs_same} of them as the replay does (**{share:.2%}**).\n\n"
            "Largest errors:\n\n| error | batch | tiers | layers |\n| --- | --- | --- | --- |\n"
            + "\n".join(worst_lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mix", default="8:120,16:110,32:50,64:14,128:4,256:2,512:1,1024:1",
                   help="world:batches pairs (many small and medium worlds, fewer big ones: a "
                        "1,024-GPU candidate replays in minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=parse_tp, default=[1, 2, 4],
                   help="TP sizes to draw from, e.g. 1 or 1,2,4 (the speedup matrix runs 1-4)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "surrogate.md")
    args = p.parse_args()
    print(exit_on_user_error(lambda: run(args)))


if __name__ == "__main__":
    main()
