"""The sections of ``benchmarks/gpu_check.py`` that do not drive the engine's streams:
``tests``, ``calibration`` and ``training`` (``stream_checks.py`` has the others).

Each is ``section_<name>(args, dry_run) -> SectionResult``.  With ``dry_run`` the
same code runs on the CPU: the GPU tests are collected and skip, the fit runs on
the H200 tables, the trainer runs one fp32 step.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

from gpu_report import SectionResult, fenced

ROOT = Path(__file__).resolve().parents[1]
#: The H200 tables the fit must hold (``../shared/gpu/h200-2026-11-26.md``).
H200_TABLES = ROOT / "tests" / "benchmarks" / "fixtures" / "h200-2026-11-26.json"
#: Wheels the training section needs and the GPU machine lacks (docs/gpu-check.md says how to bring them).
WHEELS = {"megatron.core": "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl "
                           "(it needs packaging>=24.2 too) in .whl/",
          "highspy": "highspy-1.16.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl in .whl/"}
#: The GPU tests: these files, and every test file that marks tests ``gpu``.
GPU_TEST_FILES = ("tests/attention/test_gpu_backends.py", "tests/comm/test_lanes_gpu.py")
#: A ~125M LLaMA-style model (GPT-2 small's width and depth, SwiGLU, no GQA).
GPT_125M = ("name: gpt-125m\nnum_layers: 12\nhidden_size: 768\nnum_attention_heads: 12\n"
            "num_query_groups: 12\nffn_hidden_size: 2048\nvocab_size: 32000\n")
#: Relative loss difference allowed between zeppelin and the reference: bf16 on a
#: GPU (the two runs' kernels see differently packed batches), fp32 in a dry run.
LOSS_RTOL = {"bf16": 2e-2, "fp32": 1e-4}


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shell(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run ``cmd`` in the repository; (exit status, stdout + stderr); past ``timeout``
    it is stopped and the status is 124."""
    return finish(start(cmd, env), time.monotonic() + timeout)


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=None if env is None else {**os.environ, **env})


def finish(proc: subprocess.Popen, deadline: float) -> tuple[int, str]:
    """(exit status, output) of ``proc``; at ``deadline`` it gets SIGTERM, which
    torchrun passes on to its workers (a SIGKILL would orphan them, in their own
    sessions, still holding the GPU), and SIGKILL 10 s later; the status is then 124."""
    try:
        out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return 124, (out or "") + "\n(stopped at the section's budget)"


def tail(text: str, lines: int) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def import_error(module: str) -> str | None:
    """None when ``module`` imports here, else why not (one line)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  a broken install is as missing as an absent one
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def missing_wheel(module: str) -> str | None:
    """None when ``module`` is installed (found, not imported: megatron.core takes
    seconds to import, and the run that needs it says so if it is broken), else one
    line naming the wheel to bring."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:   # its parent package is absent
        found = False
    return None if found else f"needs {module}, which is not installed: bring {WHEELS[module]}"


def gpu_name(dry_run: bool) -> str:
    if dry_run:
        return "cpu (dry run)"
    import torch
    return torch.cuda.get_device_name()


def base_cluster(args: argparse.Namespace, gpu: str) -> str:
    """``--cluster``, else the bundled preset of this GPU (H200, else H100)."""
    return args.cluster or ("h200-8x400g" if "H200" in gpu.upper() or gpu.startswith("cpu") else "h100-8x400g")


# ------------------------------------------------------------------ tests
def gpu_test_files() -> list[str]:
    marked = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("test_*.py"))
              if "mark.gpu" in p.read_text()]
    return sorted(set(GPU_TEST_FILES) | set(marked))


#: Optional kernel packages, by import name, and how skip reasons may name them.
KERNEL_PACKAGES = {"flash_attn": ("flash_attn", "flash-attn"),
                   "transformer_engine": ("transformer_engine", "transformer-engine", "transformerengine")}


def skipped_for(reason: str) -> str | None:
    """The package a skip reason names: ``pytest.importorskip``'s module, or an
    optional kernel package named in a hand-written reason."""
    module = re.search(r"could not import '([\w.]+)'", reason)
    if module:
        return module[1]
    lowered = reason.lower()
    return next((m for m, names in KERNEL_PACKAGES.items() if any(n in lowered for n in names)), None)


def judge_skips(reasons: list[str], dry_run: bool) -> list[str]:
    """The skips a GPU run must not have: any not explained by a package that does not
    import, which is every skip of a kernel that imports.  A dry run may also skip
    for want of CUDA."""
    bad = []
    for reason in reasons:
        module = skipped_for(reason)
        if module and import_error(module) is not None:
            continue
        if dry_run and "CUDA" in reason:
            continue
        bad.append(reason)
    return bad


def section_tests(args: argparse.Namespace, dry_run: bool) -> SectionResult:
    files = gpu_test_files()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
               f"--junitxml={junit}", *files]
        status, out = shell(cmd, timeout=args.section_budget - 5, env={"TORCH_CUDA_SANITIZER": "1"})
        cases = ET.parse(junit).getroot().iter("testcase") if junit.is_file() else []
        outcome = {"passed": 0, "failed": 0, "skipped": 0}
        reasons = []
        for case in cases:
            if case.find("skipped") is not None:
                outcome["skipped"] += 1
                reasons.append(case.find("skipped").get("message", ""))
            elif case.find("failure") is not None or case.find("error") is not None:
                outcome["failed"] += 1
            else:
                outcome["passed"] += 1
    races = out.count("CSAN detected")
    bad = judge_skips(reasons, dry_run)
    absent = sorted({m for m in map(skipped_for, reasons) if m and import_error(m) is not None})
    figure = (f"{outcome['passed']} passed, {outcome['failed']} failed, {outcome['skipped']} skipped"
              + (f" ({', '.join(absent)} absent)" if absent else "") + f", {races} sanitizer reports")
    passed = status == 0 and not bad and races == 0 and (dry_run or outcome["passed"] > 0)
    criterion = ("PASS: pytest exits 0 under `TORCH_CUDA_SANITIZER=1`, at least one test passed, and every skip "
                 "is a package that does not import (a fused-kernel test of a kernel that imports never skips)"
                 + ("; a dry run may skip for want of CUDA" if dry_run else ""))
    body = [f"`TORCH_CUDA_SANITIZER=1 {' '.join(cmd[1:])}` -> exit {status}", "", criterion, "",
            fenced(tail(out, 25))]
    if bad:
        body += ["", "Skips that must not happen here:", "", *[f"- {r}" for r in sorted(set(bad))]]
    return SectionResult(passed, figure, "\n".join(body))


# ------------------------------------------------------------------ calibration
def section_calibration(args: argparse.Namespace, dry_run: bool) -> SectionResult:
    """The fit on the H200 tables, then each kernel the engine can run here, timed,
    fitted and written as a preset (a dry run: the CPU kernels, sign only, into a
    temporary folder)."""
    import attn_calibration as cal

    from megatron_zeppelin.presets import resolve_preset
    from megatron_zeppelin.topology import load_cluster

    fixture = cal.load_tables(args.table)
    parts, held_tables, worst_tables = [], [], []
    for name, table in fixture["tables"].items():
        curve, errors, held = cal.check_table(table, fixture["peak_tflops"])
        lo, hi = table["check"]
        worst = max(abs(e) for L, e in zip(table["lengths"], errors) if lo <= L <= hi)
        held_tables.append(held)
        worst_tables.append(f"{100 * worst:.1f}")
        parts += [f"**{name}** ({table['what']}): e = {curve.efficiency:.3f}, h = {curve.half_block:.0f}; "
                  f"worst {100 * worst:.1f} % at {lo}..{hi} (must be <= {100 * table['tolerance']:.0f} %): "
                  f"{'holds' if held else 'DOES NOT HOLD'}", "",
                  cal.table_markdown(table["lengths"], table["tflops"], curve, fixture["peak_tflops"]), ""]
    gpu = gpu_name(dry_run)
    base = base_cluster(args, gpu)
    peak = load_cluster(base).gpu.peak_tflops
    setup = cal.DRY_TIMING if dry_run else cal.GPU_TIMING
    timed, notes = measure_kernels(cal, setup, dry_run)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    figures, held_kernels = [], []
    for kernel, tflops in timed.items():
        curve = cal.fit_curve(setup.lengths, tflops, peak)
        worst = max(abs(e) for e in curve.errors(setup.lengths, tflops, peak))
        # On a CPU the kernels are not what the curve models: the fit is checked for its sign only.
        held_kernels.append(curve.efficiency > 0 and (dry_run or worst <= cal.FIT_TOLERANCE))
        name = f"{slug(gpu)}-{kernel.replace('_', '-')}-calibrated"
        stamp = f"{kernel} varlen, fitted by scripts/gpu_check.sh on {gpu}, {date}"
        folder = Path(tempfile.mkdtemp()) if dry_run else ROOT / "configs" / "clusters"
        path = folder / f"{name}.yaml"
        path.write_text(cal.calibrated_preset(resolve_preset("clusters", base).read_text(), name, curve, stamp))
        load_cluster(str(path))  # the written preset must load
        figures.append(f"{kernel} timed on the CPU at {len(tflops)} lengths, fit e > 0" if dry_run else
                       f"{kernel} e={curve.efficiency:.3f} h={curve.half_block:.0f} worst {100 * worst:.1f} %")
        parts += [f"**{kernel}** on {gpu} ({setup.describe()}): e = {curve.efficiency:.3f}, "
                  f"h = {curve.half_block:.0f}, worst {100 * worst:.1f} % (must be "
                  f"{'> 0 on a CPU' if dry_run else f'<= {100 * cal.FIT_TOLERANCE:.0f} %'}); wrote "
                  f"`{path if dry_run else path.relative_to(ROOT)}` (base {base})", "",
                  cal.table_markdown(setup.lengths, tflops, curve, peak), ""]
    parts += [f"- {n}" for n in notes]
    figures.append(f"H200 tables {'hold' if all(held_tables) else 'DO NOT HOLD'} "
                   f"(worst {' / '.join(worst_tables)} %)")
    passed = all(held_tables) and bool(timed) and all(held_kernels) and not any("failed" in n for n in notes)
    return SectionResult(passed, "; ".join(figures), "\n".join(parts))


def measure_kernels(cal, setup, dry_run: bool) -> tuple[dict[str, list[float]], list[str]]:
    """{kernel: TFLOP/s at ``setup.lengths``} of every kernel the engine can run here
    (a dry run: the torch kernels on the CPU), and a line per kernel not timed."""
    import torch

    from megatron_zeppelin.attention.backends import get_backend
    from megatron_zeppelin.errors import ZeppelinError

    timed, notes = {}, []
    for kernel in ("torch",) if dry_run else cal.FUSED_KERNELS:
        try:
            backend = get_backend(kernel)
        except (ZeppelinError, ImportError) as exc:
            notes.append(f"{kernel}: not here ({str(exc).splitlines()[0]})")
            continue
        try:
            timed[kernel] = cal.time_kernel(backend, setup, torch.device("cpu" if dry_run else "cuda"))
        except Exception as exc:  # noqa: BLE001  one kernel failing leaves the others' curves
            notes.append(f"{kernel}: timing failed ({type(exc).__name__}: {str(exc).splitlines()[0]})")
    if not timed:
        notes.append("no kernel the engine can run was timed here")
    return timed, notes


# ------------------------------------------------------------------ training
#: (name, model, lengths) of the training runs: the tiny model on a long-tailed sample,
#: the ~125M one on web-like documents.
TRAINING_RUNS = (("tiny", "tiny", "tiny-longtail"), ("gpt-125m", "gpt-125m.yaml", "synthetic-web"))
#: Launcher of one rank: torchrun with its agent, as on a cluster (NCCL on a GPU, gloo on a CPU).
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "megatron_zeppelin.train")


def trainer_args(model: str, lengths: str, strategy: str, log: Path, args: argparse.Namespace, dry_run: bool,
                 cluster: str) -> list[str]:
    """``python -m megatron_zeppelin.train``'s arguments for one run on one rank."""
    sizes = ["--max-seq-len", "256", "--tokens-per-gpu", "512"] if dry_run else \
        ["--max-seq-len", "4096", "--tokens-per-gpu", "8192"]
    return ["--nodes", "1", "--gpus-per-node", "1", "--cluster", cluster, "--strategy", strategy, "--model", model,
            "--lengths", lengths, *sizes, "--steps", "1" if dry_run else str(args.steps),
            "--dtype", "fp32" if dry_run else "bf16", "--json-log", str(log), "--quiet"]


def section_training(args: argparse.Namespace, dry_run: bool) -> SectionResult:
    """Zeppelin against the reference, step by step.  A dry run trains the tiny pair
    for one fp32 step and checks the ~125M runs' arguments with the trainer's own
    parser (a ~125M step on a shared CPU costs more than the rest of the dry run)."""
    # The trainer builds Megatron-Core's GPT, and imports highspy (train/strategy_limits.py
    # -> planner/flexsp.py) whichever strategy it runs.
    missing = [line for line in map(missing_wheel, ("megatron.core", "highspy")) if line]
    if missing:
        return SectionResult.failed("training " + "; ".join(missing))
    from megatron_zeppelin.train.cli import parse_args as trainer_parse_args

    deadline = time.monotonic() + args.section_budget - 5
    cluster = base_cluster(args, gpu_name(dry_run))
    dtype = "fp32" if dry_run else "bf16"
    rtol = LOSS_RTOL[dtype]
    rows = ["| model | strategy | steps | mean step s (after 2) | final loss |", "| --- | --- | --- | --- | --- |"]
    notes, compared, runs = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "gpt-125m.yaml").write_text(GPT_125M)
        logs = {(name, s): Path(tmp) / f"{name}-{s}.jsonl" for name, _, _ in TRAINING_RUNS
                for s in ("zeppelin", "reference")}
        for name, model, lengths in TRAINING_RUNS:
            model = model if model == "tiny" else str(Path(tmp) / model)
            for strategy in ("zeppelin", "reference"):
                argv = trainer_args(model, lengths, strategy, logs[name, strategy], args, dry_run, cluster)
                if (name, strategy) == ("tiny", "zeppelin"):     # the executed trace, timed by CUDA events
                    argv += ["--dump-trace", str(Path(tmp) / "trace")]
                if dry_run and name != "tiny":
                    trainer_parse_args(argv)   # raises on an argument the trainer would refuse
                    notes.append(f"{name} {strategy}: arguments accepted by the trainer (not run in a dry run)")
                else:
                    runs[name, strategy] = [sys.executable, *TORCHRUN, *argv]
        statuses = run_commands(runs, deadline, parallel=dry_run)
        for (name, strategy), (status, out) in statuses.items():
            if status:
                notes.append(f"{name} {strategy}: `python {' '.join(runs[name, strategy][1:])}` -> exit {status}"
                             f"\n\n{fenced(tail(out, 20))}")
                continue
            records = [json.loads(line) for line in logs[name, strategy].read_text().splitlines() if line.strip()]
            times = [r["step_time_s"] for r in records[2:]] or [r["step_time_s"] for r in records]
            rows.append(f"| {name} | {strategy} | {len(records)} | {sum(times) / len(times):.3f} | "
                        f"{records[-1]['loss']:.4f} |")
        for name, _, _ in TRAINING_RUNS:
            if any(statuses.get((name, s), (1, ""))[0] for s in ("zeppelin", "reference")):
                continue
            cmd = [sys.executable, "-m", "megatron_zeppelin.train.compare", str(logs[name, "zeppelin"]),
                   str(logs[name, "reference"]), "--rtol", f"{rtol:g}"]
            status, out = shell(cmd, timeout=max(deadline - time.monotonic(), 5))
            worst = re.search(r"largest relative loss difference (\S+)", out)
            compared.append((name, status, worst[1] if worst else "?"))
            notes.append(f"{name}: `python -m megatron_zeppelin.train.compare ... --rtol {rtol:g}` -> exit {status}"
                         f"\n\n{fenced(tail(out, 6))}")
        traced = trace_ops(Path(tmp) / "trace")
        notes.append(f"tiny zeppelin `--dump-trace`: {traced}")
    expected = 1 if dry_run else len(TRAINING_RUNS)
    passed = len(compared) == expected and all(status == 0 for _, status, _ in compared) and "ops" in traced
    figure = ", ".join(f"{name} loss diff {worst}" for name, _, worst in compared) or "no pair finished"
    figure += f"; trace {traced.split(':')[0]}"
    figure += f" ({dtype}, rtol {rtol:g}; {sum(1 for s, _ in statuses.values() if s == 0)}/{len(runs)} runs)"
    return SectionResult(passed, figure, "\n".join(rows) + "\n\n" + "\n\n".join(notes) + (
        "\n\nOne GPU is one rank: every plan is local, so this compares the kernels and the engine's local "
        "queue with the reference, not rings or remap over NCCL."))


def trace_ops(folder: Path) -> str:
    """What the trainer's ``--dump-trace`` wrote, read back by the simulator's reader
    (on CUDA its op times come from CUDA events)."""
    from megatron_zeppelin.errors import ZeppelinError
    from megatron_zeppelin.schedule.trace import read_trace

    steps = sorted(folder.glob("step*.json"))
    if not steps:
        return "no step trace written"
    try:
        schedule, _, times = read_trace(steps[-1])
    except ZeppelinError as exc:
        return f"{steps[-1].name} unreadable: {exc}"
    return f"{len(times)} ops timed: {len(steps)} step trace(s), {steps[-1].name} holds {len(schedule.ops)} ops"


def run_commands(commands: dict, deadline: float, parallel: bool) -> dict:
    """{key: (exit status, output)} of each command, all started at once when
    ``parallel`` (a dry run on a CPU: one step each), else one after another (on a
    GPU, so that step times are the run's own); stopped at ``deadline`` (status 124)."""
    if not parallel:
        return {key: finish(start(cmd), deadline) for key, cmd in commands.items()}
    procs = {key: start(cmd) for key, cmd in commands.items()}
    return {key: finish(proc, deadline) for key, proc in procs.items()}
