"""What one CUDA GPU can prove about megatron-zeppelin, in one command (< 10 minutes).

    bash scripts/gpu_check.sh            # installs what it can, then runs this
    python benchmarks/gpu_check.py [--cluster h100-8x400g] [--skip training] [--out FILE]

Sections (each writes its commands and figures into ``docs/results/gpu-<gpu>.md``):

* ``tests``: the GPU tests (flash-attn / TransformerEngine kernels against the
  PyTorch ones, strided inputs, fp32 under ``auto``) and the backend contract.
* ``calibration``: ``benchmarks/kernel_throughput.py``; the fitted attention
  efficiency curve is written as a cluster preset
  (``configs/clusters/<gpu>-calibrated.yaml``, the ``--cluster`` preset with the
  measured ``attn_efficiency`` / ``attn_half_block``).
* ``overhead``: the engine against one plain varlen call on the same tokens, bf16:
  a local-only plan, and a plan with a ring over two ranks that share the GPU
  through a loopback communicator (``benchmarks/loopback.py``: a thread per rank,
  transfers as copies on their own CUDA stream).
* ``concurrency``: ``torch.profiler`` trace of that ring run; the time copies on
  the transfer stream overlap kernels on the compute streams.
* ``training``: the tiny and a ~125M GPT for 20 steps, zeppelin against the
  reference on one GPU (``python -m megatron_zeppelin.train`` under torchrun),
  compared step by step.

Without CUDA it prints one line and exits 0.  One GPU cannot run two NCCL
ranks: NCCL rings, routing over NICs, and remap all-to-alls between GPUs stay
unproven here (the loopback ring exercises the schedule, not NCCL).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # loopback.py beside this file

SECTIONS = ("tests", "calibration", "overhead", "concurrency", "training")
NO_GPU = "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check"

#: A ~125M LLaMA-style model (GPT-2 small's width and depth, SwiGLU, GQA off).
GPT_125M = ("name: gpt-125m\nnum_layers: 12\nhidden_size: 768\nnum_attention_heads: 12\n"
            "num_query_groups: 12\nffn_hidden_size: 2048\nvocab_size: 32000\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="h100-8x400g",
                    help="cluster preset whose GPU this is (the calibrated preset copies its links)")
    ap.add_argument("--out", help="results file (default docs/results/gpu-<gpu name>.md)")
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    return ap.parse_args(argv)


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shell(cmd: list[str], timeout: int) -> tuple[int, str]:
    """Run ``cmd`` in the repository; (exit status, stdout + stderr)."""
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def fenced(text: str) -> str:
    return f"```\n{text.rstrip()}\n```"


# ------------------------------------------------------------------ sections
def section_tests(args: argparse.Namespace) -> str:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/attention/test_gpu_backends.py",
           "tests/attention/test_backend_contract.py", "tests/attention/test_kernels.py"]
    status, out = shell(cmd, timeout=300)
    tail = "\n".join(out.strip().splitlines()[-15:])
    return f"`{' '.join(cmd[1:])}` -> exit {status}\n\n{fenced(tail)}"


def fitted_efficiency(text: str) -> tuple[str, float, float]:
    """The kernel calibration's fit, flash-attn's when it ran, else SDPA's."""
    fits = {m[0]: (float(m[1]), float(m[2]))
            for m in re.findall(r"(\w+): attn_efficiency = ([\d.]+), attn_half_block = ([\d.]+)", text)}
    if not fits:
        raise RuntimeError(f"kernel_throughput.py printed no fit:\n{text[-2000:]}")
    kernel = "flash" if "flash" in fits else next(iter(fits))
    return (kernel, *fits[kernel])


def calibrated_preset(base_yaml: str, name: str, kernel: str, efficiency: float, half_block: float,
                      gpu: str) -> str:
    """``base_yaml`` with the measured attention curve (and its source) and a new name."""
    stamp = f"measured by scripts/gpu_check.sh on {gpu} ({kernel}, {datetime.now(timezone.utc):%Y-%m-%d})"
    text = re.sub(r"(?m)^name: .*$", f"name: {name}", base_yaml)
    for key, value in (("attn_efficiency", f"{efficiency:.3f}"), ("attn_half_block", f"{half_block:.0f}")):
        text, n = re.subn(rf"(?m)^(\s+){key}: .*$", rf"\g<1>{key}: {value}  # {stamp}", text)
        if n != 1:
            raise RuntimeError(f"the base preset has no single gpu.{key} line to replace")
    return text


def section_calibration(args: argparse.Namespace) -> str:
    from megatron_zeppelin.presets import resolve_preset
    from megatron_zeppelin.topology import load_cluster

    gpu = torch.cuda.get_device_name()
    cmd = [sys.executable, "benchmarks/kernel_throughput.py", "--cluster", args.cluster, "--model", "llama-7b",
           "--lengths", "512,1024,2048,4096,8192,16384", "--repeats", "3"]
    status, out = shell(cmd, timeout=300)
    if status:
        return f"`{' '.join(cmd[1:])}` failed (exit {status})\n\n{fenced(out[-3000:])}"
    kernel, efficiency, half_block = fitted_efficiency(out)
    name = f"{slug(gpu)}-calibrated"
    path = ROOT / "configs" / "clusters" / f"{name}.yaml"
    base = resolve_preset("clusters", args.cluster).read_text()
    path.write_text(calibrated_preset(base, name, kernel, efficiency, half_block, gpu))
    load_cluster(str(path))  # the written preset must load
    return (f"`{' '.join(cmd[1:])}`\n\n{fenced(out)}\n\nWrote `{path.relative_to(ROOT)}` "
            f"({args.cluster} with the {kernel} fit: attn_efficiency {efficiency:.3f}, "
            f"attn_half_block {half_block:.0f}).")


def cuda_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Milliseconds per call of ``fn`` (after one warm-up), by CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def overhead_case(lens: list[int], ring: list[int]):
    """(plan, world size): sequences ``ring`` on a 2-rank zigzag ring, ``lens`` local,
    alternating between the ranks."""
    from megatron_zeppelin.plan import Mode, Plan, placement
    from megatron_zeppelin.planner.base import same_layout_linear

    world = 2 if ring else 1
    seq_lens = ring + lens
    attention = [placement(i, n, Mode.RING, [0, 1]) for i, n in enumerate(ring)]
    attention += [placement(len(ring) + i, n, Mode.LOCAL, [i % world]) for i, n in enumerate(lens)]
    attention = tuple(attention)
    return Plan("gpu_check", world, world, tuple(seq_lens), attention, same_layout_linear(world, attention)).validate()


def engine_vs_varlen(plan, backend, heads=(32, 8, 128)) -> tuple[float, float]:
    """(engine ms, one varlen call ms) of forward + backward, bf16, every rank of
    ``plan`` on this GPU (ranks as threads over a loopback communicator)."""
    from loopback import LoopbackCommunicator, LoopbackHub, run_ranks

    from megatron_zeppelin.attention import plan_attention

    hq, hk, d = heads
    dev = torch.device("cuda")
    hub = LoopbackHub(plan.world_size, dev)
    comms = [LoopbackCommunicator(hub, r) for r in range(plan.world_size)]
    inputs = []
    for r in range(plan.world_size):
        t = sum(sp.length for sp in plan.attention_spans(r))
        inputs.append([torch.randn(t, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                       for h in (hq, hk, hk)])
    cache: list[dict] = [{} for _ in range(plan.world_size)]

    def rank_step(r: int) -> None:
        out = plan_attention(*inputs[r], plan=plan, rank=r, comm=comms[r], backend=backend, cache=cache[r])
        out.backward(torch.ones_like(out))

    engine = cuda_ms(lambda: run_ranks(hub, rank_step))
    # The same tokens as whole sequences in one packed varlen call (no engine, no transfers).
    total = sum(plan.seq_lens)
    q, k, v = (torch.randn(total, h, d, device=dev, dtype=torch.bfloat16) for h in (hq, hk, hk))
    cu = torch.tensor([0, *plan.seq_lens], device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    longest = max(plan.seq_lens)

    def plain() -> None:
        out, lse = backend.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=longest, scale=d ** -0.5)
        backend.varlen_backward(out, q, k, v, out, lse, cu_seqlens=cu, max_seqlen=longest, scale=d ** -0.5)

    return engine, cuda_ms(plain)


def section_overhead(args: argparse.Namespace) -> str:
    from megatron_zeppelin.attention.backends import get_backend

    backend = get_backend("auto")
    fused = getattr(backend, "fused", None)
    rows = [f"Kernels: {type(fused).__name__ if fused else 'PyTorch (no flash-attn / TransformerEngine)'}; "
            "bf16, 32 query / 8 KV heads of 128 (LLaMA-7B shapes), forward + backward.", "",
            "| plan | tokens | engine ms | one varlen call ms | overhead |", "| --- | --- | --- | --- | --- |"]
    cases = {"local only, 1 rank": overhead_case([8192, 4096, 2048, 1024, 512, 512, 256, 256], []),
             "ring of 2 (loopback) + locals": overhead_case([2048, 1024, 512, 512], [16384])}
    for name, plan in cases.items():
        engine, plain = engine_vs_varlen(plan, backend)
        overhead = 100 * (engine / plain - 1)
        rows.append(f"| {name} | {sum(plan.seq_lens)} | {engine:.2f} | {plain:.2f} | {overhead:+.1f} % |")
    rows += ["", "The ring case runs both ranks on this GPU, one thread each, so its engine time holds both "
             "ranks' work and the loopback copies: it bounds the schedule's overhead, not NCCL's."]
    return "\n".join(rows)


def stream_overlap(trace: dict) -> tuple[float, float]:
    """(µs of copies on non-compute streams, µs of them overlapping a kernel on another stream)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "stream" in e.get("args", {})]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["args"]["stream"]) for e in events if e.get("cat") == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"], e["args"]["stream"]) for e in events
              if e.get("cat") in ("gpu_memcpy", "gpu_memset") or "Memcpy" in e.get("name", "")]
    compute_streams = {s for _, _, s in kernels}
    total = overlap = 0.0
    for start, end, stream in copies:
        if stream in compute_streams:
            continue
        total += end - start
        # Union of the kernels on other streams inside [start, end).
        spans = sorted((max(s, start), min(e, end)) for s, e, ks in kernels if ks != stream and s < end and e > start)
        cursor = start
        for s, e in spans:
            s = max(s, cursor)
            if e > s:
                overlap += e - s
                cursor = e
    return total, overlap


def section_concurrency(args: argparse.Namespace) -> str:
    from torch.profiler import ProfilerActivity, profile

    from megatron_zeppelin.attention.backends import get_backend

    plan = overhead_case([2048, 1024, 512, 512], [16384])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine_vs_varlen(plan, get_backend("auto"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        total, overlap = stream_overlap(json.loads(path.read_text()))
    share = f"{100 * overlap / total:.1f} %" if total else "n/a (no copies on a stream of their own)"
    return (f"torch.profiler (CPU + CUDA) over the ring case of *overhead*: transfers on the loopback stream "
            f"took {total / 1e3:.2f} ms, {overlap / 1e3:.2f} ms of it beside kernels on compute streams ({share}).")


def section_training(args: argparse.Namespace) -> str:
    rows = ["| model | strategy | steps | mean step s (after 2) | final loss |", "| --- | --- | --- | --- | --- |"]
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": "tiny", "gpt-125m": str(Path(tmp) / "gpt-125m.yaml")}
        Path(models["gpt-125m"]).write_text(GPT_125M)
        for name, model in models.items():
            logs = {}
            for strategy in ("zeppelin", "reference"):
                log = Path(tmp) / f"{name}-{strategy}.jsonl"
                cmd = ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "megatron_zeppelin.train",
                       "--nodes", "1", "--gpus-per-node", "1", "--cluster", args.cluster, "--strategy", strategy,
                       "--model", model, "--lengths", "tiny-longtail" if name == "tiny" else "synthetic-web",
                       "--max-seq-len", "4096", "--tokens-per-gpu", "8192", "--steps", str(args.steps),
                       "--dtype", "bf16", "--json-log", str(log), "--quiet"]
                status, out = shell(cmd, timeout=240)
                if status:
                    notes.append(f"{name} {strategy}: `{' '.join(cmd)}` failed\n\n{fenced(out[-2000:])}")
                    continue
                records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
                logs[strategy] = log
                times = [r["step_time_s"] for r in records[2:]] or [r["step_time_s"] for r in records]
                rows.append(f"| {name} | {strategy} | {len(records)} | {sum(times) / len(times):.3f} | "
                            f"{records[-1]['loss']:.4f} |")
            if len(logs) == 2:
                cmd = [sys.executable, "-m", "megatron_zeppelin.train.compare", str(logs["zeppelin"]),
                       str(logs["reference"]), "--rtol", "2e-2"]
                status, out = shell(cmd, timeout=60)
                notes.append(f"{name}: `python -m megatron_zeppelin.train.compare ... --rtol 2e-2` -> exit {status} "
                             f"(bf16: the kernels differ, so losses agree to about 1e-2)\n\n"
                             f"{fenced(chr(10).join(out.strip().splitlines()[-6:]))}")
    return "\n".join(rows) + "\n\n" + "\n\n".join(notes) + (
        "\n\nOne GPU means one rank: the plans are local-only, so this compares the fused kernels and the "
        "engine's local queue with the reference, not rings or remap over NCCL.")


SECTION_RUNNERS: dict[str, Callable[[argparse.Namespace], str]] = {
    "tests": section_tests, "calibration": section_calibration, "overhead": section_overhead,
    "concurrency": section_concurrency, "training": section_training}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    gpu = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else ROOT / "docs" / "results" / f"gpu-{slug(gpu)}.md"
    parts = [f"# GPU check: {gpu}", "",
             f"`bash scripts/gpu_check.sh {' '.join(sys.argv[1:])}` on "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
             f"torch {torch.__version__}, CUDA {torch.version.cuda}.", ""]
    for name in SECTIONS:
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            body = SECTION_RUNNERS[name](args)
        except Exception as exc:  # noqa: BLE001  one failed section must not hide the others' results
            body = f"FAILED: {type(exc).__name__}: {exc}"
        parts += [f"## {name} ({time.perf_counter() - t0:.0f} s)", "", body, ""]
        out.write_text("\n".join(parts))  # what is done so far survives a later timeout
    print(f"gpu_check: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
