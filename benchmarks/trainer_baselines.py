"""Every baseline in the trainer against the reference, on 2x2 and 2x4 simulated GPUs.

Runs ``python -m megatron_zeppelin.train`` (gloo ranks on this CPU) for each
strategy and the reference on the same global batches, 3072-token pieces at
1024 tokens per GPU, and prints a markdown table: the largest relative loss and
gradient-norm difference over the steps, the pieces the sampler deferred (the
trainer's ``deferred a piece`` warnings), the most passes a step ran as (a
baseline's rounds run as micro-batches) with the most tokens a GPU held in one
pass, and the layouts the dumped Plans used.

    python benchmarks/trainer_baselines.py --lengths ../shared/data/lengths/python-code.npy
    python benchmarks/trainer_baselines.py --topologies 2x2 --steps 2     # quicker

Numbers are losses of real runs, not timings (a CPU says nothing about GPU speed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_zeppelin.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ("te_cp", "megatron_hybrid_cp", "ulysses_sp", "flexsp", "packing_dp")
MODEL, MAX_SEQ_LEN, TOKENS_PER_GPU = "tiny-ulysses", 3072, 1024


def train(strategy: str, nodes: int, gpus: int, args: argparse.Namespace, out: Path) -> tuple[int, str]:
    """One trainer run; (exit status, its stderr).  Logs and plans land in ``out``."""
    cmd = [sys.executable, "-m", "megatron_zeppelin.train", "--nodes", str(nodes), "--gpus-per-node", str(gpus),
           "--strategy", strategy, "--model", MODEL, "--lengths", args.lengths, "--max-seq-len", str(MAX_SEQ_LEN),
           "--tokens-per-gpu", str(TOKENS_PER_GPU), "--steps", str(args.steps), "--seed", str(args.seed),
           "--cluster", args.cluster, "--quiet", "--timeout", "300", "--json-log", str(out / "log.jsonl"), "--dump-plans", str(out / "plans")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return done.returncode, done.stderr


def read_run(out: Path) -> tuple[list[dict], list[list[Plan]]]:
    """JSON lines and, per step, the Plans of its passes."""
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    steps: dict[str, list[Plan]] = collections.defaultdict(list)
    for p in sorted((out / "plans").glob("plan_*.json")):
        steps[p.stem.split("_")[1]].append(Plan.from_json(p.read_text()))
    return log, [steps[k] for k in sorted(steps)]


def layouts(steps: list[list[Plan]]) -> str:
    """The group shapes the Plans used, e.g. ``ring x4 (26), local (3)``."""
    count = collections.Counter((p.mode.value, p.size) for plans in steps for plan in plans for p in plan.attention)
    shapes = sorted(count, key=lambda k: (-k[1], k[0]))
    return ", ".join(f"{mode}" + (f" x{size}" if size > 1 else "") + f" ({count[mode, size]})"
                     for mode, size in shapes)


def deferred_pieces(stderr: str) -> int:
    """The trainer's warnings for pieces the sampler carried to the next step."""
    return sum("deferred a piece" in x for x in stderr.splitlines())


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def row(strategy: str, topo: str, ref: list[dict], rc: int, err: str, out: Path) -> tuple[str, float | None]:
    """The table row and the largest relative loss difference (None: refused, or other batches)."""
    if rc != 0:
        lines = err.strip().splitlines() or ["?"]
        line = next((x for x in lines if "error: " in x), lines[-1])
        return f"| {strategy} | {topo} | 0 | refused: {line.split('error: ', 1)[-1]} | | | | | |", None
    log, steps = read_run(out)
    same = [r["num_tokens"] for r in log] == [r["num_tokens"] for r in ref]
    loss = max(rel(r["loss"], x["loss"]) for r, x in zip(log, ref)) if same else float("nan")
    grad = max(rel(r["grad_norm"], x["grad_norm"]) for r, x in zip(log, ref)) if same else float("nan")
    deferred = deferred_pieces(err)
    passes = max(len(r["micro_batch_tokens"]) for r in log)
    per_pass = max(max(plan.attention_tokens_per_rank()) for plans in steps for plan in plans)
    batches = "same" if same else "DIFFERENT"
    return (f"| {strategy} | {topo} | {len(log)} | {loss:.1e} | {grad:.1e} | {batches} | {deferred} | "
            f"{passes} / {per_pass} | {layouts(steps)} |", loss if same else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="configs/lengths/tiny-longtail.npy", help="document lengths file")
    ap.add_argument("--topologies", default="2x2,2x4", help="NODESxGPUS, comma-separated")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cluster", default="h100-8x400g",
                    help="cluster preset whose numbers the planners price plans with (FlexSP's MILP mixes group "
                         "sizes on a GPU cluster's costs; the CPU preset's make one group of 4 cheapest)")
    ap.add_argument("--strategies", default=",".join(BASELINES))
    args = ap.parse_args()
    print(f"`{MODEL}`, `{args.lengths}`, --cluster {args.cluster}, --max-seq-len {MAX_SEQ_LEN} --tokens-per-gpu {TOKENS_PER_GPU}, "
          f"--seed {args.seed}, {args.steps} steps\n")
    print("| strategy | topology | steps | max rel. loss diff | max rel. grad-norm diff | batches as the "
          "reference | deferred pieces | passes per step / max tokens on a GPU in a pass | layouts used "
          "(sequences) |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst, compared, other_batches = 0.0, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for topo in args.topologies.split(","):
            nodes, gpus = map(int, topo.split("x"))
            ref_dir = Path(tmp) / f"{topo}-reference"
            rc, err = train("reference", nodes, gpus, args, ref_dir)
            if rc != 0:
                sys.exit(f"reference run failed on {topo}: {err.strip().splitlines()[-1:]}")
            ref, ref_steps = read_run(ref_dir)
            print(f"| reference | {topo} | {len(ref)} | | | | {deferred_pieces(err)} | 1 / "
                  f"{max(max(p.attention_tokens_per_rank()) for s in ref_steps for p in s)} | {layouts(ref_steps)} |",
                  flush=True)
            for strategy in args.strategies.split(","):
                out = Path(tmp) / f"{topo}-{strategy}"
                rc, err = train(strategy, nodes, gpus, args, out)
                line, loss = row(strategy, topo, ref, rc, err, out)
                if loss is not None:
                    worst, compared = max(worst, loss), compared + 1
                other_batches += rc == 0 and loss is None
                print(line, flush=True)
    print(f"\ntrainer-baselines: runs={compared} on the reference's batches, {other_batches} on other batches, "
          f"largest relative loss difference {worst:.1e}")


if __name__ == "__main__":
    main()
