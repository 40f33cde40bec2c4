"""Compare two trainer JSON logs step by step (e.g. a strategy against the reference).

    python -m megatron_zeppelin.train.compare zeppelin.jsonl reference.jsonl

Prints each step's losses and their relative difference, the tiers the plan
used, the balance of attention pairs and linear tokens, and the bytes each link
class carried; exits 1 when a loss differs by more than ``--rtol``, and when a
loss on either side is NaN or infinite (a diverged run is never "equal").
A log written with ``--append-log`` holds several runs, each opened by a
``run_start`` line: the last run is compared.  A line that is not a step
record is one error naming the file and its line number.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from megatron_zeppelin.errors import ConfigError, exit_on_user_error
from megatron_zeppelin.train.log import RUN_START
from megatron_zeppelin.validation import OneLineParser, check_float

_EXPECTED = "pass a file written by python -m megatron_zeppelin.train --json-log"


@dataclass(frozen=True)
class Step:
    """One step record of a log and the line it came from."""

    line: int
    """1-based line number in the file (cited by every message about it)."""
    record: dict[str, Any]
    """The JSON object, its fields checked to have the types compare reads."""


def read_log(path: str) -> tuple[list[Step], int]:
    """The step records of ``path``'s last run, and how many runs the file holds."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such trainer log; {_EXPECTED}")
    runs: list[list[Step]] = [[]]
    try:
        with open(p, encoding="utf-8") as f:
            for number, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno}); "
                                      f"{_EXPECTED}") from None
                if isinstance(record, dict) and RUN_START in record:
                    runs.append([])
                    continue
                step = Step(number, _checked(record, f"{path}:{number}"))
                if runs[-1] and step.record["step"] <= runs[-1][-1].record["step"]:
                    raise ConfigError(f"{path}:{number}: step {step.record['step']} follows step "
                                      f"{runs[-1][-1].record['step']} (line {runs[-1][-1].line}): the file holds "
                                      "several runs with no run_start line between them; split it, or write each "
                                      "run to its own --json-log")
                runs[-1].append(step)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read as text ({exc}); {_EXPECTED}") from None
    held = [r for r in runs if r] or [[]]
    return held[-1], len(held)


def _checked(record: Any, where: str) -> dict[str, Any]:
    """``record`` if it holds every field compare reads, with its type; else one line."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: not a trainer step record ({what}); {_EXPECTED}")

    number = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # noqa: E731
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    need(isinstance(record, dict), f"a JSON {type(record).__name__}, not an object")
    for key, ok, kind in (("step", whole, "a whole number >= 0"), ("loss", number, "a number"),
                          ("num_tokens", whole, "a whole number >= 0")):
        need(key in record, f"no {key!r}")
        need(ok(record[key]), f"{key!r} is {str(record[key])[:40]!r}, not {kind}")
    plan = record.get("plan")
    need(isinstance(plan, dict) and all(whole(plan.get(k)) for k in ("local", "intra", "inter", "ulysses")),
         "'plan' lacks whole-number local/intra/inter/ulysses counts")
    for key in ("attn_pairs_per_rank", "linear_tokens_per_rank"):
        values = record.get(key)
        need(isinstance(values, list) and values and all(number(v) and v >= 0 for v in values),
             f"{key!r} is not a non-empty list of counts")
    sent = record.get("bytes")
    need(isinstance(sent, dict) and number(sent.get("intra_node")), "'bytes' lacks a number 'intra_node'")
    nics = sent.get("inter_node_per_nic")
    need(isinstance(nics, list) and all(isinstance(n, list) and all(map(number, n)) for n in nics),
         "'bytes.inter_node_per_nic' is not a list of per-NIC byte lists")
    return record


def relative_difference(loss: float, reference: float) -> float:
    """|loss - reference| / |reference|; NaN when either is not finite (never a match)."""
    if not (math.isfinite(loss) and math.isfinite(reference)):
        return math.nan
    if loss == reference:
        return 0.0
    return abs(loss - reference) / abs(reference) if reference else math.inf


def _norms(record: dict[str, Any]) -> list[float]:
    """The record's gradient norm, if it has one as a number (older logs may lack it)."""
    norm = record.get("grad_norm")
    return [norm] if isinstance(norm, numbers.Real) and not isinstance(norm, bool) else []


def imbalance(values: list[int]) -> float:
    """max / mean (1.0 is perfect balance)."""
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else 1.0


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def check_same_batches(runs: list[Step], refs: list[Step], log: str, reference: str) -> None:
    """Both logs hold the same steps with the same token counts, or one line citing the lines."""
    if not runs or len(runs) != len(refs):
        raise ConfigError(f"the logs hold {len(runs)} ({log}) and {len(refs)} ({reference}) steps; run both "
                          "for the same --steps")
    for run, ref in zip(runs, refs):
        a, b = run.record, ref.record
        if a["step"] != b["step"]:
            raise ConfigError(f"{log}:{run.line} is step {a['step']} and {reference}:{ref.line} is step "
                              f"{b['step']}: the logs start at different steps; compare runs over the same steps")
        if a["num_tokens"] != b["num_tokens"]:
            raise ConfigError(f"step {a['step']} trained {a['num_tokens']} tokens in {log}:{run.line} and "
                              f"{b['num_tokens']} in {reference}:{ref.line}: the runs trained different batches "
                              "(the strategy deferred a piece: run the reference with --batches-of STRATEGY; or "
                              "another --lengths/--seed/--batch-fill); losses compare only on the same batches")


def main(argv: Sequence[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m megatron_zeppelin.train.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the strategy's --json-log")
    ap.add_argument("reference", help="the reference run's --json-log")
    ap.add_argument("--rtol", type=float, default=1e-4, help="allowed relative loss difference")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    check_float(args.rtol, "--rtol", minimum=0)
    (runs, run_count), (refs, ref_count) = read_log(args.log), read_log(args.reference)
    for path, count in ((args.log, run_count), (args.reference, ref_count)):
        if count > 1:
            print(f"{path} holds {count} appended runs; comparing the last one")
    check_same_batches(runs, refs, args.log, args.reference)
    print("| step | loss | reference | rel. diff | local/intra/inter/ulysses | attn pairs max/mean "
          "| linear tokens max/mean | intra-node MiB | inter-node MiB per NIC |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst, diverged = 0.0, []
    for run, ref in ((a.record, b.record) for a, b in zip(runs, refs)):
        diff = relative_difference(run["loss"], ref["loss"])
        if math.isnan(diff) or not all(map(math.isfinite, _norms(run) + _norms(ref))):
            diverged.append(run["step"])
        else:
            worst = max(worst, diff)
        tiers = "/".join(str(run["plan"][k]) for k in ("local", "intra", "inter", "ulysses"))
        nics = " ".join("[" + ",".join(mib(b) for b in node) + "]" for node in run["bytes"]["inter_node_per_nic"])
        print(f"| {run['step']} | {run['loss']:.6f} | {ref['loss']:.6f} | {diff:.1e} | {tiers} | "
              f"{imbalance(run['attn_pairs_per_rank']):.2f} | {imbalance(run['linear_tokens_per_rank']):.2f} | "
              f"{mib(run['bytes']['intra_node'])} | {nics} |")
    if diverged:
        print(f"\na loss or gradient norm is not finite (NaN or infinite) at step {', '.join(map(str, diverged))}: "
              "a diverged run DIFFERS from the reference")
        return 1
    ok = worst <= args.rtol
    print(f"\nlargest relative loss difference {worst:.1e} over {len(runs)} steps: "
          f"{'equal to the reference' if ok else 'DIFFERS from the reference'} (rtol {args.rtol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.argv[0] = "megatron_zeppelin.train.compare"   # error lines name the command, not compare.py
    sys.exit(exit_on_user_error(main))
