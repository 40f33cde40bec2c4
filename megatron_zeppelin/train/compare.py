"""Compare two trainer JSON logs step by step (e.g. a strategy against the reference).

    python -m megatron_zeppelin.train.compare zeppelin.jsonl reference.jsonl

Prints each step's losses and their relative difference, the tiers the plan
used, the balance of attention pairs and linear tokens, and the bytes each link
class carried; exits 1 when a loss differs by more than ``--rtol``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_zeppelin.errors import ConfigError, exit_on_user_error


def read_log(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such trainer log; pass the file given to --json-log")
    try:
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not a trainer JSON log ({exc})") from None


def imbalance(values: list[int]) -> float:
    """max / mean (1.0 is perfect balance)."""
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else 1.0


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_zeppelin.train.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the strategy's --json-log")
    ap.add_argument("reference", help="the reference run's --json-log")
    ap.add_argument("--rtol", type=float, default=1e-4, help="allowed relative loss difference")
    args = ap.parse_args()
    runs, refs = read_log(args.log), read_log(args.reference)
    if not runs or len(runs) != len(refs):
        raise ConfigError(f"the logs hold {len(runs)} and {len(refs)} steps; run both for the same --steps")
    other = next((r for r, x in zip(runs, refs) if r["num_tokens"] != x["num_tokens"]), None)
    if other is not None:
        ref_tokens = refs[runs.index(other)]["num_tokens"]
        raise ConfigError(f"step {other['step']} trained {other['num_tokens']} tokens in {args.log} and {ref_tokens} "
                          f"in {args.reference}: the runs trained different batches (the strategy deferred a piece: run "
                          "the reference with --batches-of STRATEGY; or another --lengths/--seed/--batch-fill); "
                          "losses compare only on the same batches")
    print("| step | loss | reference | rel. diff | local/intra/inter/ulysses | attn pairs max/mean "
          "| linear tokens max/mean | intra-node MiB | inter-node MiB per NIC |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for run, ref in zip(runs, refs):
        diff = abs(run["loss"] - ref["loss"]) / abs(ref["loss"])
        worst = max(worst, diff)
        tiers = "/".join(str(run["plan"][k]) for k in ("local", "intra", "inter", "ulysses"))
        nics = " ".join("[" + ",".join(mib(b) for b in node) + "]" for node in run["bytes"]["inter_node_per_nic"])
        print(f"| {run['step']} | {run['loss']:.6f} | {ref['loss']:.6f} | {diff:.1e} | {tiers} | "
              f"{imbalance(run['attn_pairs_per_rank']):.2f} | {imbalance(run['linear_tokens_per_rank']):.2f} | "
              f"{mib(run['bytes']['intra_node'])} | {nics} |")
    ok = worst <= args.rtol
    print(f"\nlargest relative loss difference {worst:.1e} over {len(runs)} steps: "
          f"{'equal to the reference' if ok else 'DIFFERS from the reference'} (rtol {args.rtol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
