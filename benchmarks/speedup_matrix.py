"""Modeled speedup over static CP (te_cp) across models, clusters, max lengths and data.

Every cell runs the simulator (``megatron_zeppelin.sim``) on the same global
batches for every strategy.  The per-GPU token cap shrinks with model size
(activation memory per token grows with it), so long max lengths force te_cp's
CP group past one node -- the case where its ring crosses the slow NICs.

    python benchmarks/speedup_matrix.py           # the full matrix
    python benchmarks/speedup_matrix.py --quick   # a 2x2x2x2 corner of it

Length distributions: ``../shared/data/lengths/*.npy`` when that folder exists,
plus the bundled synthetic ones (``configs/lengths/synthetic-*.npy``).  Prints a markdown
report and writes it to docs/results/speedup_matrix.md.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import exit_on_user_error
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.presets import CONFIG_ROOT
from megatron_zeppelin.sampler import DEFAULT_BATCH_FILL, batch_budget
from megatron_zeppelin.sampler.lengths import load_lengths, resolve_lengths
from megatron_zeppelin.sim.simulate import (BASELINE, build_strategies, collect_garbage_rarely, sample_batches,
                                            simulate)
from megatron_zeppelin.topology import load_cluster

REPO = Path(__file__).resolve().parent.parent
SHARED_LENGTHS = REPO.parent / "shared" / "data" / "lengths"
#: Per-GPU token cap by model: bigger models keep more activation bytes per token.
TOKENS_PER_GPU = {"llama-3b": 32768, "llama-7b": 16384, "llama-13b": 16384, "llama-30b": 8192}
K = 1024


def default_lengths() -> list[Path]:
    shared = sorted(SHARED_LENGTHS.glob("*.npy")) if SHARED_LENGTHS.is_dir() else []
    # tiny-longtail is the CPU demo's sample (~60-token documents), not a corpus.
    return shared + sorted((CONFIG_ROOT / "lengths").glob("synthetic-*.npy"))


def cell(model: str, cluster_name: str, max_len: int, lengths_name: str, doc_lengths, args) -> dict:
    cluster = load_cluster(cluster_name, nodes=args.nodes)
    cost = CostModel(cluster, load_model(model))
    world, gpn = cluster.topology.world_size, cluster.topology.gpus_per_node
    cap = args.tokens_per_gpu or TOKENS_PER_GPU.get(model, 16384)
    row = {"model": model, "cluster": cluster_name, "max_len": max_len, "lengths": lengths_name, "cap": cap}
    if max_len > cap * world:
        return {**row, "skip": f"{max_len} tokens do not fit {world} GPUs x {cap}"}
    batches = sample_batches(doc_lengths, max_seq_len=max_len, tokens_per_batch=batch_budget(cap, world, max_len),
                             steps=args.steps, seed=args.seed)
    # te_cp and Zeppelin with the static layouts a tuning user would launch (sim/static_layout.py).
    strategies = build_strategies(args.strategies, cost, layout_batches=batches, max_seq_len=max_len,
                                  tokens_per_gpu=cap, time_limit_s=args.flexsp_time_limit)
    te = next((s for s in strategies if s.name == BASELINE), None)
    spans = te is not None and te.cp_size and te.cp_size * te.tp_size > gpn
    row["cp"] = ("-" if te is None or te.cp_size is None else f"TP={te.tp_size} x CP={te.cp_size}"
                 + (f" ({-(-te.cp_size * te.tp_size // gpn)} nodes)" if spans else ""))
    result = simulate(batches, strategies, tokens_per_gpu=cap, time_limit_s=args.flexsp_time_limit)
    row["seqs"] = sum(map(len, result.seq_lens)) / len(result.seq_lens)
    row["step_ms"] = {n: (r.step_time_s * 1e3 if r.step_time_s else None) for n, r in result.strategies.items()}
    row["speedup"] = {n: result.speedup(n) for n in result.strategies}
    return row


def never_slower(rows: list[dict]) -> list[str]:
    """Whether ``zeppelin`` is modeled no slower than every other strategy of each
    cell (its own variants included), and the cells where it is not."""
    cells = [r for r in rows if r.get("step_ms", {}).get("zeppelin")]
    if not cells or len(cells[0]["step_ms"]) < 2:
        return []
    slower = []
    for r in cells:
        others = {n: ms for n, ms in r["step_ms"].items() if n != "zeppelin" and ms}
        best = min(others, key=others.get, default=None)
        if best is not None and r["step_ms"]["zeppelin"] > others[best] * (1 + 1e-9):
            slower.append(f"{r['model']} {r['cluster']} {r['max_len'] // K}K {r['lengths']}: {best} "
                          f"{others[best]:.0f} ms vs zeppelin {r['step_ms']['zeppelin']:.0f} ms")
    return ["", f"Zeppelin modeled no slower than every other strategy in {len(cells) - len(slower)} of "
                f"{len(cells)} cells" + (": slower in " + "; ".join(slower) if slower else ".")]


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def report(rows: list[dict], args: argparse.Namespace, elapsed: float) -> str:
    others = [n for n in args.strategies if n != BASELINE]
    head = ["model", "cluster", "max len", "lengths", "tokens/GPU", f"{BASELINE} layout", "seqs/batch",
            f"{BASELINE} ms", *[f"{n} speedup" for n in others]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        key = [r["model"], r["cluster"], f"{r['max_len'] // K}K", r["lengths"], str(r["cap"])]
        if "skip" in r:
            lines.append("| " + " | ".join(key + [r["skip"]] + [""] * (len(head) - 6)) + " |")
            continue
        base = r["step_ms"].get(BASELINE)
        cells = [r["cp"], f"{r['seqs']:.0f}", f"{base:.0f}" if base else "infeasible"]
        for n in others:
            s, ms = r["speedup"].get(n), r["step_ms"].get(n)
            cells.append(f"{s:.2f}x" if s else ("infeasible" if ms is None else f"{ms:.0f} ms"))
        lines.append("| " + " | ".join(key + cells) + " |")
    summary = ["", f"Speedup over {BASELINE} (cells where both ran):", ""]
    for n in others:
        s = [r["speedup"][n] for r in rows if r.get("speedup", {}).get(n)]
        cross = [r["speedup"][n] for r in rows if r.get("speedup", {}).get(n) and "nodes" in r["cp"]]
        if s:
            summary.append(f"* {n}: geometric mean {geomean(s):.2f}x, min {min(s):.2f}x, max {max(s):.2f}x "
                           f"over {len(s)} cells" + (f"; {geomean(cross):.2f}x where {BASELINE}'s CP group "
                                                      f"spans nodes ({len(cross)} cells)" if cross else ""))
    summary += never_slower(rows)
    command = "python benchmarks/speedup_matrix.py " + shlex.join(sys.argv[1:])
    return (f"# Modeled speedup matrix\n\nCommand: `{command.strip()}` ({elapsed:.0f} s on a shared 2-core "
            f"CPU box)\n\n{args.nodes} nodes per cluster; {args.steps} global batches per cell of {DEFAULT_BATCH_FILL} x "
            f"tokens/GPU x GPUs tokens (documents cut at the max length); step times from the replay of each "
            f"plan's schedule with cost-model durations (docs/simulator.md), so they rank strategies rather than "
            f"predict a cluster to the percent.\n\n"
            + "\n".join(lines + summary) + "\n")


def main() -> None:
    def csv(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=csv, default=list(TOKENS_PER_GPU))
    p.add_argument("--clusters", type=csv, default=["h100-8x400g", "a800-4x200g", "h200-8x400g"])
    p.add_argument("--max-lens", type=lambda s: [int(x) * K for x in csv(s)], default=[64 * K, 128 * K, 256 * K,
                                                                                     512 * K],
                   help="in K tokens, e.g. 64,128,256,512")
    p.add_argument("--lengths", type=csv, default=None,
                   help="length files or bundled sample names, e.g. synthetic-books "
                        "(default: ../shared/data/lengths/*.npy + configs/lengths/*.npy)")
    p.add_argument("--strategies", type=csv, default=[BASELINE, "megatron_hybrid_cp", "zeppelin_norouting",
                                                      "zeppelin"])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--tokens-per-gpu", type=int, default=None, help="override the per-model cap")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flexsp-time-limit", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="2 models x 2 clusters x 2 max lengths x 2 data sets")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "speedup_matrix.md")
    args = p.parse_args()
    collect_garbage_rarely()
    lengths = (exit_on_user_error(lambda: [resolve_lengths(x) for x in args.lengths]) if args.lengths
               else default_lengths())
    if args.quick:
        args.models, args.clusters = args.models[1:3], args.clusters[:2]
        args.max_lens, lengths = args.max_lens[1:3], lengths[-2:]

    def run() -> str:
        docs = {path.stem: load_lengths(path) for path in lengths}
        cells = [(m, c, L, d) for m in args.models for c in args.clusters for L in args.max_lens for d in docs]
        rows, start = [], time.monotonic()
        for i, (m, c, L, d) in enumerate(cells):
            rows.append(cell(m, c, L, d, docs[d], args))
            print(f"[{i + 1}/{len(cells)}] {time.monotonic() - start:5.0f}s {m} {c} {L // K}K {d}",
                  file=sys.stderr)
        return report(rows, args, time.monotonic() - start)

    text = exit_on_user_error(run)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
