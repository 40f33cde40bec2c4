"""How often, and by how much, Zeppelin's decision is modeled slower than the best baseline.

On random batches of small worlds (2-16 GPUs, one or two nodes, h100-8x400g
and a800-4x200g, routing and remap on and off: the distribution of
``tests/planner/test_containment.py``), the deciding Zeppelin's plan is replayed
against every baseline the simulator runs -- ``te_cp`` at the CP sizes its
layout search tries, ``ulysses_sp`` at every SP size, Megatron's hybrid CP,
FlexSP (its MILP), packed DP -- two ways: as the simulator times each
baseline (TE's bf16 dK/dV, packed rings and all-to-alls), and its plan run by
Zeppelin's engine.  It imports no part of the decision, so the same command
measures any checkout (``PYTHONPATH=<checkout>``): before and after.

    python benchmarks/containment.py --batches 200
    python benchmarks/containment.py --latency   # CPU ms of each candidate source at 64 and 1,024 GPUs
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections import Counter

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.planner.base import PlanContext, get_planner
from megatron_zeppelin.planner.te_cp import te_cp_layouts
from megatron_zeppelin.planner.ulysses_sp import ulysses_layouts
from megatron_zeppelin.sampler.batch_sampler import PieceTable
from megatron_zeppelin.sampler.lengths import load_lengths, resolve_lengths
from megatron_zeppelin.sim.rounds import plan_batch, rounds_timeline
from megatron_zeppelin.sim.timeline import decision_step_s
from megatron_zeppelin.topology import Topology, load_cluster

CLUSTERS = ("h100-8x400g", "a800-4x200g")


def random_case(rng: random.Random) -> tuple[list[int], str, int, int, int, bool, bool]:
    """(lengths, cluster, nodes, GPUs per node, cap, routing, remap), as the property test draws them."""
    nodes, gpn, cap = rng.randint(1, 2), rng.choice([2, 4, 8]), rng.choice([1024, 2048, 4096])
    world, fill, lens = nodes * gpn, rng.uniform(0.3, 0.95), []
    while True:
        length = rng.choice([rng.randint(16, cap // 4), rng.randint(cap // 2, cap), rng.randint(cap, cap * world)])
        if sum(lens) + length > fill * cap * world:
            break
        lens.append(length)
    return lens or [cap], rng.choice(CLUSTERS), nodes, gpn, cap, rng.random() < 0.5, rng.random() < 0.5


def cost_of(cluster: str, nodes: int, gpn: int) -> CostModel:
    base = load_cluster(cluster)
    topo = Topology(nodes=nodes, gpus_per_node=gpn, nics_per_node=min(gpn, base.topology.nics_per_node))
    return CostModel(dataclasses.replace(base, topology=topo), load_model("llama-7b"))


def baselines(lens: list[int], cost: CostModel, cap: int, time_limit_s: float) -> dict[str, tuple[float, float, bool]]:
    """name -> (step as the simulator times it, its plan run by Zeppelin's
    engine, whether Zeppelin may run the plan: one pass under the cap, or
    hybrid CP's rounds each under it)."""
    direct = cost.routed(False)
    runs = [("packing_dp", None), ("megatron_hybrid_cp", None), ("flexsp", None)]
    runs += [("te_cp", lay.size) for lay in te_cp_layouts(direct, max(lens), cap) if lay.tp == 1 and not lay.problem]
    runs += [("ulysses_sp", lay.size) for lay in ulysses_layouts(direct, max(lens), cap) if not lay.problem]
    out = {}
    for name, size in runs:
        ctx = PlanContext(cost=direct, tokens_per_gpu=cap, cp_size=size, time_limit_s=time_limit_s)
        try:
            _, rounds = plan_batch(get_planner(name), lens, ctx)
        except InfeasibleError:
            continue
        as_engine = [dataclasses.replace(p, strategy="zeppelin") for p in rounds]
        out[f"{name}{size or ''}"] = (rounds_timeline(rounds, direct).step_s, rounds_timeline(as_engine, direct).step_s,
                                      (len(rounds) == 1 or name == "megatron_hybrid_cp")
                                      and all(max(r.attention_tokens_per_rank()) <= cap for r in rounds))
    return out


def gaps(args: argparse.Namespace) -> str:
    rng = random.Random(args.seed)
    native, engine, engine_in_cap = [], [], []     # (gap, winner, batch) per batch where zeppelin is slower
    cpu = []
    n = 0
    for _ in range(args.batches):
        lens, cluster, nodes, gpn, cap, routing, remap = random_case(rng)
        cost = cost_of(cluster, nodes, gpn).routed(routing)
        # A checkout whose decision runs passes takes the simulator's clock of them.
        passes = ({"rounds_model": lambda rounds, cost=cost: rounds_timeline(rounds, cost).step_s}
                  if "rounds_model" in PlanContext.__dataclass_fields__ else {})
        ctx = PlanContext(cost=cost, tokens_per_gpu=cap, remap_enabled=remap,
                          step_model=lambda plan, cost=cost: decision_step_s(plan, cost), **passes)
        c0 = time.process_time()
        try:
            _, rounds = plan_batch(get_planner("zeppelin"), lens, ctx)
        except InfeasibleError:
            continue
        cpu.append(time.process_time() - c0)
        mine = rounds_timeline(rounds, cost).step_s
        base = baselines(lens, cost, cap, args.flexsp_time_limit)
        n += 1
        for out, pick in ((native, lambda v: v[0]), (engine, lambda v: v[1]),
                          (engine_in_cap, lambda v: v[1] if v[2] else None)):
            steps = {k: pick(v) for k, v in base.items() if pick(v) is not None}
            best = min(steps, key=steps.get)
            if mine > steps[best] * (1 + 1e-9):
                out.append((mine / steps[best] - 1, best.rstrip("0123456789"), (lens, cluster, nodes, gpn, cap,
                                                                                routing, remap)))
    lines = [f"{n} batches (seed {args.seed}); the decision's CPU per batch: median "
             f"{statistics.median(cpu) * 1e3:.0f} ms, max {max(cpu) * 1e3:.0f} ms", "",
             "| zeppelin against | slower on | median gap | max gap | the best baseline then |",
             "| --- | --- | --- | --- | --- |"]
    for what, rows in (("baselines as the simulator times them", native),
                       ("their plans run by Zeppelin's engine", engine),
                       ("the same, plans Zeppelin may run (within the cap)", engine_in_cap)):
        if rows:
            g = [r[0] * 100 for r in rows]
            who = ", ".join(f"{k} {v}" for k, v in Counter(r[1] for r in rows).most_common())
            lines.append(f"| {what} | {len(rows)} of {n} | {statistics.median(g):.2f} % | {max(g):.2f} % | {who} |")
        else:
            lines.append(f"| {what} | 0 of {n} | - | - | - |")
    if native:      # each batch as tests/planner/test_containment.py takes it in an @example
        lines += ["", "Batches where a baseline as the simulator times it is faster (lengths, cluster, nodes, "
                  "GPUs per node, cap, routing, remap):"]
        lines += [f"* {best} {gap * 100:.2f} %: {case!r}" for gap, best, case in native]
    return "\n".join(lines)


def latency(args: argparse.Namespace) -> str:
    """CPU ms of every candidate source on planner_latency's batches (16
    sequences per GPU of synthetic-longtail cut at 512K, cap 1.05 x the mean)."""
    from megatron_zeppelin.planner.baseline_candidates import SOURCES, baseline_candidates
    pieces = PieceTable.from_lengths(load_lengths(resolve_lengths(args.lengths)), 524288).lengths
    rng = np.random.default_rng(args.seed)
    cluster = load_cluster("h100-8x400g")
    lines = ["| GPUs | sequences | " + " | ".join(f"{s} plans, CPU ms" for s in SOURCES)
             + " | baseline_candidates CPU ms | zeppelin planner alone CPU ms |",
             "| --- " * (len(SOURCES) + 4) + "|"]
    for world in args.gpus:
        cost = CostModel(cluster.with_nodes(world // 8), load_model("llama-7b")).routed(True)
        lens = rng.choice(pieces, args.seqs_per_gpu * world).tolist()
        cap = max(int(1.05 * sum(lens) / world), -(-524288 // world))
        ctx = PlanContext(cost=cost, tokens_per_gpu=cap)
        row = [str(world), str(len(lens))]
        for source in SOURCES.values():
            c0 = time.process_time()
            plans = [draft.plan() for draft in source(lens, ctx)]
            row.append(f"{len(plans)}, {(time.process_time() - c0) * 1e3:.0f}")
        for run in (lambda: baseline_candidates(lens, ctx), lambda: get_planner("zeppelin").inner.plan(lens, ctx)):
            c0 = time.process_time()
            run()
            row.append(f"{(time.process_time() - c0) * 1e3:.0f}")
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], file=sys.stderr)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flexsp-time-limit", type=float, default=2.0)
    p.add_argument("--latency", action="store_true", help="time each candidate source instead")
    p.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[64, 1024])
    p.add_argument("--seqs-per-gpu", type=int, default=16)
    p.add_argument("--lengths", default="synthetic-longtail")
    args = p.parse_args()
    if args.batches < 1 or args.seqs_per_gpu < 1 or any(g < 8 or g % 8 for g in args.gpus):
        p.error("--batches and --seqs-per-gpu must be positive and --gpus multiples of 8 (8 GPUs per node)")
    print(latency(args) if args.latency else gaps(args))


if __name__ == "__main__":
    main()
