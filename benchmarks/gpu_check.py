"""What one CUDA GPU can prove about megatron-zeppelin, in one command (< 8 minutes).

    bash scripts/gpu_check.sh            # installs carried wheels, then runs this
    python benchmarks/gpu_check.py [--cluster h200-8x400g] [--skip training] [--out FILE]
    python benchmarks/gpu_check.py --dry-run [--out FILE]   # every section's own code on the CPU

Sections, in this order (docs/gpu-check.md says what each proves):

* ``tests``: the GPU tests under ``TORCH_CUDA_SANITIZER=1``; no fused-kernel test
  may skip when its kernel imports (gpu_sections.py);
* ``calibration``: the cost model's attention curve per kernel the engine can run,
  fitted on packed varlen batches, written as cluster presets; the fit must also
  hold the H200 tables (gpu_sections.py, attn_calibration.py);
* ``overhead``, ``concurrency``, ``delays``, ``syncs``: the engine on CUDA streams
  through the loopback harness (stream_checks.py);
* ``training``: tiny and ~125M GPT, zeppelin against the reference in bf16, step by
  step (gpu_sections.py).

Each section runs in a process of its own with a wall-time budget: a hang, a crash
or a sticky CUDA error fails that section only, and the others still run.  Every
section prints PASS or FAIL and one figure; ``docs/results/gpu-<gpu>.md`` opens
with the summary table; the exit status is 1 when any section failed.  Without
CUDA (and without ``--dry-run``) it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the section modules beside this file

from gpu_report import SectionResult, fenced  # noqa: E402
from gpu_sections import slug  # noqa: E402
from megatron_zeppelin.errors import exit_on_user_error  # noqa: E402
from megatron_zeppelin.presets import resolve_preset  # noqa: E402
from megatron_zeppelin.validation import OneLineParser, check_input_file, check_int, check_output_file  # noqa: E402

NO_GPU = "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check"
#: Seconds all sections together may take (the whole check, wheel install included, is <= 8 minutes).
TOTAL_BUDGET_S = 450


@dataclass(frozen=True)
class Section:
    name: str
    budget_s: int
    """Wall seconds before the section's process is killed (a FAIL)."""
    module: str
    """Module beside this file that defines ``section_<name>(args, dry_run)``, imported
    only in the section's own process (a broken module fails that section only)."""

    def run(self, args: argparse.Namespace, dry_run: bool) -> SectionResult:
        return getattr(importlib.import_module(self.module), f"section_{self.name}")(args, dry_run)


SECTIONS = (Section("tests", 75, "gpu_sections"), Section("calibration", 45, "gpu_sections"),
            Section("overhead", 40, "stream_checks"), Section("concurrency", 40, "stream_checks"),
            Section("delays", 75, "stream_checks"), Section("syncs", 30, "stream_checks"),
            Section("training", 150, "gpu_sections"))
NAMES = tuple(s.name for s in SECTIONS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = OneLineParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=None,
                    help="cluster preset of this GPU, the base of the calibrated presets (default: h200-8x400g "
                         "on an H200, else h100-8x400g)")
    ap.add_argument("--out", help="report file (default docs/results/gpu-<gpu name>.md; a dry run: a temp file)")
    ap.add_argument("--skip", nargs="*", default=[], choices=NAMES, help="sections to leave out")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    ap.add_argument("--dry-run", action="store_true",
                    help="run every section's own code on the CPU, with the CUDA calls left out")
    ap.add_argument("--table", default=str(ROOT / "tests" / "benchmarks" / "fixtures" / "h200-2026-11-26.json"),
                    help="measured attention tables the calibration fit must hold")
    ap.add_argument("--section", choices=NAMES, help=argparse.SUPPRESS)   # a section's own process
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--section-budget", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.section is None:   # the check itself: bad input is one line now, not a FAIL minutes later
        check_int(args.steps, "--steps", minimum=1)
        check_input_file(args.table, "--table", "a JSON file of measured attention tables")
        if args.cluster is not None:
            resolve_preset("clusters", args.cluster)
        if args.out is not None:
            check_output_file(args.out, "--out")
    return args


# ------------------------------------------------------------------ one section, one process
def section_child(args: argparse.Namespace) -> int:
    """In the section's process: run it, write its result; an exception is a FAIL
    with the exception's line."""
    section = next(s for s in SECTIONS if s.name == args.section)
    args.section_budget = args.section_budget or section.budget_s
    try:
        result = section.run(args, args.dry_run)
        if not isinstance(result, SectionResult):
            raise TypeError(f"section_{section.name} returned {type(result).__name__}, not a SectionResult")
    except Exception as exc:  # noqa: BLE001  the runner reports it; the other sections go on
        line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        result = SectionResult.failed(line, f"{line}\n\n{fenced(traceback.format_exc()[-3000:])}")
    result.write(Path(args.result))
    return 0


def run_section(section: Section, argv: list[str], budget: float, dry_run: bool) -> tuple[SectionResult, float]:
    """Run ``section`` in a process of its own (its own session, killed as a group at
    ``budget``); (result, seconds)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        result_path, log_path = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--section", section.name,
               "--result", str(result_path), "--section-budget", f"{budget:.0f}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ""   # a dry run makes no CUDA call, on any machine
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                status = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                stop(proc)
                status = None
            except BaseException:   # Ctrl-C or SIGTERM of the check: the section's processes go too
                stop(proc)
                raise
        seconds = time.monotonic() - t0
        output = log_path.read_text(errors="replace")
        if result_path.is_file():
            return SectionResult.read(result_path), seconds
    why = f"over its budget of {budget:.0f} s, killed" if status is None else f"exited {status} without a result"
    lines = "\n".join(output.strip().splitlines()[-30:])
    return SectionResult.failed(f"{section.name} {why}", f"{section.name} {why}; its last output:\n\n{fenced(lines)}"), \
        seconds


def stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """End a section's process group: SIGTERM first, which torchrun passes on to its
    workers (they run in sessions of their own, out of the group's reach), then,
    after ``grace_s`` or once the group is empty, SIGKILL to whatever is left."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            while sig == signal.SIGTERM and time.monotonic() < deadline:
                proc.poll()   # reaps the section's process: a zombie still counts in its group
                os.killpg(proc.pid, 0)
                time.sleep(0.1)
        except ProcessLookupError:   # the group is empty
            break
    proc.wait()


# ------------------------------------------------------------------ report
def report(header: list[str], done: list[tuple[Section, SectionResult | None, float]]) -> str:
    """The summary table (one row per section), then each section's body."""
    rows = ["| section | result | figure | s (budget) |", "| --- | --- | --- | --- |"]
    bodies = []
    for section, result, seconds in done:
        if result is None:
            rows.append(f"| {section.name} | skipped | | |")
            continue
        verdict = "PASS" if result.passed else "**FAIL**"
        rows.append(f"| {section.name} | {verdict} | {result.figure.replace('|', '/')} | "
                    f"{seconds:.0f} ({section.budget_s}) |")
        bodies += [f"## {section.name}: {'PASS' if result.passed else 'FAIL'} ({seconds:.0f} s)", "", result.body, ""]
    failed = sum(1 for _, r, _ in done if r is not None and not r.passed)
    ran = sum(1 for _, r, _ in done if r is not None)
    return "\n".join(header + rows + ["", f"**{ran - failed} of {ran} sections passed.**", ""] + bodies)


def header_lines(gpu: str, argv: list[str], dry_run: bool) -> list[str]:
    from importlib.metadata import version

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    command = f"python benchmarks/gpu_check.py {' '.join(argv)}" if dry_run else \
        f"bash scripts/gpu_check.sh {' '.join(argv)}"
    cuda = "" if dry_run else f", CUDA {__import__('torch').version.cuda}"
    return [f"# GPU check: {gpu}", "",
            f"`{command.strip()}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC at commit "
            f"{commit.stdout.strip() or 'unknown'}; torch {version('torch')}{cuda}, "
            f"Python {platform.python_version()}.", ""]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.section:
        return section_child(args)
    if args.dry_run:
        gpu = "cpu (dry run)"   # and no torch import here: each section's process has its own
    else:
        import torch

        if not torch.cuda.is_available():
            print(NO_GPU)
            return 0
        gpu = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="gpu_check-")) / "gpu-dry-run.md" if args.dry_run
        else ROOT / "docs" / "results" / f"gpu-{slug(gpu)}.md")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # unwinds through run_section
    header = header_lines(gpu, argv, args.dry_run)
    done: list[tuple[Section, SectionResult | None, float]] = []
    deadline = time.monotonic() + TOTAL_BUDGET_S
    for section in SECTIONS:
        if section.name in args.skip:
            done.append((section, None, 0.0))
            continue
        budget = min(section.budget_s, deadline - time.monotonic())
        if budget < 5:
            result, seconds = SectionResult.failed(f"no time left of the {TOTAL_BUDGET_S} s budget"), 0.0
        else:
            print(f"gpu_check: {section.name} ...", flush=True)
            result, seconds = run_section(section, argv, budget, args.dry_run)
        print(f"gpu_check: {'PASS' if result.passed else 'FAIL'} {section.name} ({seconds:.0f} s): {result.figure}",
              flush=True)
        done.append((section, result, seconds))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report(header, done))   # what is done so far survives a later kill
    failed = [s.name for s, r, _ in done if r is not None and not r.passed]
    print(f"gpu_check: wrote {out}; " + (f"FAILED: {', '.join(failed)}" if failed else "every section passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
