"""Re-run a catalogue of bad inputs through every CLI and count the outcomes.

    python benchmarks/bad_inputs.py [--only SUBSTRING] [--verbose]

Each case runs the CLI's ``main`` in a process forked from this one (torch and
Megatron are imported once), with its stderr captured, and is classed as

* ``clear``: non-zero exit, exactly one stderr line, no traceback;
* ``traceback``: a traceback, or several stderr lines;
* ``silent``: exit status 0 -- the bad input was accepted;
* ``hang``: still running after the case's time limit (then killed).

Prints one line per case that is not clear (all with --verbose) and the counts.
Cases marked ``(issue 13)``, ``(issue 12)``, ``(issue 20)`` or ``(issue 24)`` are the inputs listed in that issue.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing as mp
import os
import struct
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_zeppelin.data import lengths as lengths_cli  # noqa: E402
from megatron_zeppelin.data import prepare as prepare_cli  # noqa: E402
from megatron_zeppelin.errors import exit_on_user_error  # noqa: E402
from megatron_zeppelin.launch.__main__ import main as launch_main  # noqa: E402
from megatron_zeppelin.presets import CONFIG_ROOT  # noqa: E402
from megatron_zeppelin.sim.cli import main as sim_main  # noqa: E402
from megatron_zeppelin.train.__main__ import main as train_main  # noqa: E402
from megatron_zeppelin.train.cli import parse_args  # noqa: E402

CLIS: dict[str, Callable[[list[str]], object]] = {
    "train": train_main,
    "sim": sim_main,
    "lengths": lengths_cli.main,
    "prepare": prepare_cli.main,
    "launch": lambda argv: exit_on_user_error(lambda: launch_main(argv)),
}


#: Issues whose listed bad inputs are tagged ``(issue N)`` in the case names and counted apart.
ISSUES = (13, 12, 24)


@dataclass(frozen=True)
class Case:
    name: str
    cli: str
    argv: list[str]
    limit_s: float = 120.0


def _run_case(case: Case, stderr_path: str) -> None:
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)   # solvers print banners straight to fd 1
    sys.stdout = open(os.devnull, "w")
    code = 0
    try:
        CLIS[case.cli](case.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 -- an escaped exception is what we count
        import traceback
        traceback.print_exc()
        code = 99
    finally:
        sys.stderr.flush()
        os._exit(code)


def classify(case: Case, work: Path) -> tuple[str, int | None, str]:
    err = work / "stderr.txt"
    proc = mp.get_context("fork").Process(target=_run_case, args=(case, str(err)))
    proc.start()
    proc.join(case.limit_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return "hang", None, ""
    text = err.read_text(errors="replace") if err.exists() else ""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("warning: ")]
    if proc.exitcode == 0:
        return "silent", 0, text.strip()
    if "Traceback" in text or len(lines) != 1:
        return "traceback", proc.exitcode, text.strip()
    return "clear", proc.exitcode, lines[0]


# ------------------------------------------------------------------ inputs
def build_cases(d: Path) -> list[Case]:
    """Every bad input, with the files it needs written under ``d``."""
    good = d / "lengths.txt"
    good.write_text("\n".join(map(str, [300, 40, 20, 200, 140, 5, 12, 5, 200, 30, 5, 40, 12, 30, 30, 200,
                                        8, 380, 64, 30, 12, 90, 200, 250])) + "\n")

    def train(*extra: str, lengths: str | None = str(good), steps: str = "2") -> list[str]:
        base = ["--nodes", "2", "--gpus-per-node", "2", "--strategy", "zeppelin", "--max-seq-len", "512",
                "--tokens-per-gpu", "192", "--steps", steps, "--quiet", "--timeout", "30"]
        out = base + (["--lengths", lengths] if lengths else []) + list(extra)
        # A later occurrence of a flag overrides the base (argparse keeps the last).
        return out

    cases: list[Case] = []

    def add(name: str, cli: str, argv: list[str], limit_s: float = 120.0) -> None:
        cases.append(Case(name, cli, argv, limit_s))

    # --- trainer flags
    for flag, values in {"--nodes": ["0", "-1", "x"], "--gpus-per-node": ["0"], "--nics-per-node": ["0", "3"],
                         "--tokens-per-gpu": ["0"], "--max-seq-len": ["0", "1", "100000"],
                         "--steps": ["-1"], "--seed": ["-1", str(2**40)],
                         "--lr": ["nan", "-1", "inf", "0"], "--timeout": ["nan", "0", "-5", "inf"],
                         "--batch-fill": ["0", "1.5", "nan"], "--min-routed-bytes": ["-1", "nan"],
                         "--strategy": ["bogus"], "--model": ["no-such-model"], "--cluster": ["no-such"],
                         "--routing": ["maybe"], "--backend": ["cuda-magic"], "--dtype": ["fp8"]}.items():
        for v in values:
            tag = " (issue 13)" if (flag, v) in {("--seed", "-1"), ("--lr", "nan"), ("--lr", "-1"),
                                                  ("--timeout", "nan"), ("--max-seq-len", "1"),
                                                  ("--nics-per-node", "0")} else ""
            add(f"train {flag} {v}{tag}", "train", train(flag, v))
    # tensor/sequence parallelism, micro-batches and MoE (issue 12)
    heads6 = _write_variant(d, "models", "tiny", {"hidden_size": 96, "num_attention_heads": 6}, "heads6")
    for name, extra in [("--sequence-parallel without --tp", ["--sequence-parallel"]),
                        ("--tp 3 over 2 GPUs per node", ["--tp", "3"]),
                        ("--tp 4 over tiny's 2 KV heads", ["--gpus-per-node", "4", "--tp", "4"]),
                        ("--tp 4 over 6 heads", ["--gpus-per-node", "4", "--tp", "4", "--model", heads6]),
                        ("--micro-batches 0", ["--micro-batches", "0"]),
                        ("--micro-batches 200 (micro-batches left empty)", ["--micro-batches", "200"]),
                        ("--ep 0", ["--model", "tiny-moe", "--ep", "0"]),
                        ("--ep 2 on the dense tiny", ["--ep", "2"]),
                        ("--ep 3 over tiny-moe's 4 experts", ["--model", "tiny-moe", "--ep", "3"]),
                        ("--ep 4 over 2 data-parallel ranks", ["--model", "tiny-moe", "--tp", "2",
                                                               "--sequence-parallel", "--ep", "4"]),
                        ("tiny-moe --tp 2 without --sequence-parallel", ["--model", "tiny-moe", "--tp", "2"])]:
        add(f"train {name} (issue 12)", "train", train(*extra))
    for name, change in [("4 experts over expert_parallel_size 3", {"expert_parallel_size": 3}),
                         ("expert_parallel_size 8 over 4 data-parallel ranks", {"expert_parallel_size": 8,
                                                                                 "num_experts": 8}),
                         ("moe_expert_capacity_factor", {"moe_expert_capacity_factor": 1.0}),
                         ("moe_router_topk 5 of 4 experts", {"moe_router_topk": 5})]:
        path = _write_variant(d, "models", "tiny-moe", change, name.split(" (")[0])
        add(f"train --model tiny-moe with {name} (issue 12)", "train", train("--model", path))
    # lengths files
    def lengths_file(name: str, write: Callable[[Path], None]) -> str:
        path = d / name
        write(path)
        return str(path)
    for name, write, tag in [
        ("missing.txt", lambda p: None, ""),
        ("folder", lambda p: p.mkdir(), " (issue 13)"),
        ("empty.txt", lambda p: p.write_text(""), ""),
        ("negative.txt", lambda p: p.write_text("5\n-3\n"), ""),
        ("zero.txt", lambda p: p.write_text("5\n0\n"), ""),
        ("huge.txt", lambda p: p.write_text("5\n" + "1" + "0" * 23 + "\n"), " (issue 13)"),
        ("words.txt", lambda p: p.write_text("five\n"), ""),
        ("binary.txt", lambda p: p.write_bytes(bytes(range(128, 256)) * 8), ""),
        ("float.npy", lambda p: np.save(p, np.array([1.5, 2.0])), ""),
        ("twod.npy", lambda p: np.save(p, np.ones((2, 2), dtype=np.int64)), ""),
        ("huge.npy", lambda p: np.save(p, np.array([5, 2**62])), " (issue 13)"),
        ("wrap.npy", lambda p: np.save(p, np.array([5, 2**64 - 5], dtype=np.uint64)), " (issue 13)"),
        ("garbage.npy", lambda p: p.write_bytes(b"\x93NUMPY garbage"), ""),
        ("pickle.npy", lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True), ""),
    ]:
        add(f"train --lengths {name}{tag}", "train", train(lengths=lengths_file(name, write)))
    add("train --lengths and --data", "train", train("--data", str(d / "nope")))
    add("train no --lengths nor --data", "train", train(lengths=None))
    add("train --data missing prefix", "train", train("--data", str(d / "nope"), lengths=None))
    # output paths
    (d / "a_file").write_text("x")
    for flag, path, tag in [("--save", "/proc/nope/ckpt", " (issue 13)"), ("--save", str(d / "a_file"), ""),
                            ("--json-log", "/proc/nope/log.jsonl", " (issue 13)"), ("--json-log", str(d), ""),
                            ("--dump-plans", "/proc/nope/plans", " (issue 13)"),
                            ("--dump-plans", str(d / "a_file" / "x"), "")]:
        add(f"train {flag} {path.replace(str(d), 'TMP')}{tag}", "train", train(flag, path))
    # checkpoints
    ckpt_cases = _checkpoints(d, parse_args(train()))
    for name, path, tag, steps in ckpt_cases:
        add(f"train --load {name}{tag}", "train", train("--load", path, steps=steps))
    # YAML presets given to the trainer
    for name, kind, base, change, tag in _yaml_variants():
        path = _write_variant(d, kind, base, change, name)
        flag = "--cluster" if kind == "clusters" else "--model"
        add(f"train {flag} {name}{tag}", "train", train(flag, path))
    for name, text in [("malformed", "a: [1, 2\n"), ("list", "- 1\n- 2\n"), ("empty", ""),
                       ("binary", "\x00\x01\x02")]:
        path = d / f"{name}.yaml"
        path.write_text(text)
        add(f"train --cluster {name}.yaml", "train", train("--cluster", str(path)))
        add(f"train --model {name}.yaml", "train", train("--model", str(path)))

    # --- launch presets
    for name, change, tag in [("routing 'off' quoted", {"routing": "off"}, " (issue 13)"),
                              ("nodes 2.5", {"nodes": 2.5}, " (issue 13)"),
                              ("seq_length -512", {"seq_length": -512}, " (issue 13)"),
                              ("unknown cluster", {"cluster": "no-such-cluster"}, " (issue 13)"),
                              ("unknown model", {"model": "no-such-model"}, ""),
                              ("planner bogus", {"planner": "bogus"}, ""),
                              ("precision fp8", {"precision": "fp8"}, ""),
                              ("lr nan", {"lr": math.nan}, ""), ("tensor_parallel 3", {"tensor_parallel": 3}, ""),
                              ("data_path empty", {"data_path": []}, ""), ("unknown key", {"bogus_key": 1}, ""),
                              ("rdzv_port 70000", {"rdzv_port": 70000}, ""),
                              ("train_iters 0", {"train_iters": 0}, ""),
                              ("num tokens_per_gpu 'lots'", {"tokens_per_gpu": "lots"}, "")]:
        path = _write_variant(d, "presets", "tiny-cpu", change, name.replace(" ", "_").replace("'", ""))
        add(f"launch {name}{tag}", "launch", ["--preset", path, "--print-args"])
    add("launch missing preset", "launch", ["--preset", "no-such-preset", "--print-args"])
    kv1 = _write_variant(d, "models", "tiny", {"num_query_groups": 1}, "kv1")
    ep4 = _write_variant(d, "models", "tiny-moe", {"expert_parallel_size": 4}, "ep4")
    for name, change in [("tensor_parallel 2 over 1 KV head", {"model": kv1, "tensor_parallel": 2}),
                         ("expert_parallel_size 4 over 2 data-parallel ranks", {"model": ep4, "tensor_parallel": 2})]:
        path = _write_variant(d, "presets", "tiny-cpu", change, name.split()[0] + name.split()[1])
        add(f"launch {name} (issue 12)", "launch", ["--preset", path, "--print-args"])
    for name, change in [("pipeline_parallel 2 with 1 micro-batch", {"pipeline_parallel": 2}),
                         ("pipeline_parallel 4 over 2 layers", {"pipeline_parallel": 4, "micro_batches": 4}),
                         ("virtual_pipeline_stages 2", {"pipeline_parallel": 2, "micro_batches": 2,
                                                        "virtual_pipeline_stages": 2})]:
        path = _write_variant(d, "presets", "tiny-cpu", change, name.split()[0] + name.split()[-1])
        add(f"launch {name} (issue 20)", "launch", ["--preset", path, "--print-args"])

    # --- simulator flags
    sim_base = ["--cluster", "cpu-sim", "--nodes", "2", "--model", "tiny", "--lengths", str(good),
                "--max-seq-len", "512", "--tokens-per-gpu", "192", "--steps", "1", "--no-progress"]
    for flag, v, tag in [("--flexsp-time-limit", "nan", " (issue 13)"), ("--flexsp-time-limit", "0", ""),
                         ("--nodes", "0", ""), ("--seed", "-1", ""), ("--steps", "0", ""),
                         ("--batch-fill", "nan", ""), ("--strategies", "bogus", ""), ("--cluster", "bogus", ""),
                         ("--plot-step", "99", ""), ("--tokens-per-gpu", "0", ""), ("--max-seq-len", "0", ""),
                         ("--json", "/proc/nope/x.json", ""), ("--lengths", str(d / "missing.txt"), ""),
                         ("--cp-size", "0", "")]:
        add(f"sim {flag} {v.replace(str(d), 'TMP')}{tag}", "sim", sim_base + [flag, v])
    for v, extra in [("0", []), ("200 (micro-batches left empty)", ["--tokens-per-batch", "16384"])]:
        add(f"sim --micro-batches {v} (issue 12)", "sim", sim_base + ["--micro-batches", v.split()[0], *extra])
    nan_cluster = _write_variant(d, "clusters", "cpu-sim", {"nic": {"bandwidth_GBps": math.nan}}, "sim_nan_nic")
    add("sim NaN NIC bandwidth in a cluster YAML (issue 13)", "sim", sim_base + ["--cluster", nan_cluster])

    # --- the issue-24 cases: lost data, false equality, unbounded sizes
    log = d / "one-run.jsonl"
    log.write_text('{"step": 0}\n')
    for name, argv in [("--lr 1e10 (diverges)", train("--lr", "1e10", steps="4")),
                       ("--save into another run's checkpoint folder", train("--save", ckpt_cases[3][1])),
                       ("--json-log at the --lengths file", train("--json-log", str(good))),
                       ("--json-log into a non-empty log", train("--json-log", str(log))),
                       ("--nodes 64 --gpus-per-node 8", train("--nodes", "64", "--gpus-per-node", "8"))]:
        add(f"train {name} (issue 24)", "train", argv)
    for name, extra in [("--max-seq-len 1", ["--max-seq-len", "1"]), ("--json at the --lengths file",
                                                                      ["--json", str(good)]),
                        ("--plot OUT.jsonl", ["--plot", str(d / "out.jsonl")]),
                        ("--steps 2**63", ["--steps", str(2**63)])]:
        add(f"sim {name} (issue 24)", "sim", sim_base + extra)

    # --- indexed datasets (data.lengths) and prepare
    for name, prefix, tag in _datasets(d):
        add(f"lengths {name}{tag}", "lengths", [prefix])
        if name in ("truncated .bin", "negative length in .idx"):
            add(f"train --data {name}{tag if name == 'truncated .bin' else ''}", "train",
                train("--data", prefix, lengths=None))
    jsonl = d / "in.jsonl"
    jsonl.write_text('{"text": "hello"}\n{"text": "world"}\n')
    for name, argv, tag in [
        ("output prefix is a folder", ["--input", str(jsonl), "--output-prefix", str(d) + "/"], " (issue 13)"),
        ("unwritable prefix", ["--input", str(jsonl), "--output-prefix", "/proc/nope/ds"], " (issue 13)"),
        ("binary input", ["--input", "/bin/ls", "--output-prefix", str(d / "p1")], " (issue 13)"),
        ("missing input", ["--input", str(d / "none.jsonl"), "--output-prefix", str(d / "p2")], ""),
        ("empty input", ["--input", lengths_file("empty.jsonl", lambda p: p.write_text("")),
                         "--output-prefix", str(d / "p3")], ""),
        ("bad JSON", ["--input", lengths_file("bad.jsonl", lambda p: p.write_text('{"text": \n')),
                      "--output-prefix", str(d / "p4")], ""),
        ("missing key", ["--input", lengths_file("key.jsonl", lambda p: p.write_text('{"body": "x"}\n')),
                         "--output-prefix", str(d / "p5")], ""),
        ("non-string text", ["--input", lengths_file("num.jsonl", lambda p: p.write_text('{"text": 5}\n')),
                             "--output-prefix", str(d / "p6")], ""),
        ("input is a folder", ["--input", str(d), "--output-prefix", str(d / "p7")], ""),
        ("--output-prefix over its --input", ["--input", lengths_file("corpus.idx", lambda p: p.write_text(
            '{"text": "x"}\n')), "--output-prefix", str(d / "corpus")], " (issue 24)"),
    ]:
        add(f"prepare {name}{tag}", "prepare", argv)
    return cases


def _yaml_variants():
    """(name, kind, base preset, change, tag) for cluster and model YAML files."""
    return [
        ("nic bandwidth nan", "clusters", "cpu-sim", {"nic": {"bandwidth_GBps": math.nan}}, " (issue 13)"),
        ("nodes 2.5", "clusters", "cpu-sim", {"nodes": 2.5}, " (issue 13)"),
        ("gpu efficiency 2", "clusters", "cpu-sim", {"gpu": {"attn_efficiency": 2}}, ""),
        ("latency -1", "clusters", "cpu-sim", {"nvlink": {"latency_us": -1}}, ""),
        ("peak 'fast'", "clusters", "cpu-sim", {"gpu": {"peak_tflops": "fast"}}, ""),
        ("unknown key", "clusters", "cpu-sim", {"bogus": 1}, ""),
        ("no nic section", "clusters", "cpu-sim", {"nic": None}, ""),
        ("nics_per_node 0", "clusters", "cpu-sim", {"nics_per_node": 0}, ""),
        ("num_layers 2.5", "models", "tiny", {"num_layers": 2.5}, " (issue 13)"),
        ("num_layers two", "models", "tiny", {"num_layers": "two"}, " (issue 13)"),
        ("hidden_size -64", "models", "tiny", {"hidden_size": -64}, ""),
        ("heads 3", "models", "tiny", {"num_attention_heads": 3}, ""),
        ("vocab_size true", "models", "tiny", {"vocab_size": True}, ""),
        ("missing num_layers", "models", "tiny", {"num_layers": None}, ""),
    ]


def _write_variant(d: Path, kind: str, base: str, change: dict, name: str) -> str:
    data = yaml.safe_load((CONFIG_ROOT / kind / f"{base}.yaml").read_text())
    for key, value in change.items():
        if value is None:
            data.pop(key, None)
        elif isinstance(value, dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path = d / f"{kind}-{name.replace(' ', '_').replace(chr(39), '')}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _checkpoints(d: Path, cfg) -> list[tuple[str, str, str, str]]:
    """Damaged checkpoint folders of a run of ``cfg``: (name, path, tag, --steps)."""
    from megatron_zeppelin.sampler import load_lengths
    from megatron_zeppelin.train.checkpoint import checkpoint_name, save_state
    from megatron_zeppelin.train.micro import make_sampler
    from megatron_zeppelin.train.trainer import run_shape

    # Damage is found before the weights are used, except "wrong shapes" (the point of that case).
    state = {"step": 1, "shards": {"tp0-ep0": {"model": {"embedding.word_embeddings.weight": torch.zeros(3)},
                                               "optimizer": {}}},
             "layout": {"tp": 1, "ep": 1}, "sampler": make_sampler(cfg, load_lengths(cfg.lengths)).state_dict(),
             "strategy": "zeppelin", "model_preset": "tiny", "shape": run_shape(cfg)}
    out = []

    def folder(name: str, damage: Callable[[Path], None], tag: str = "", steps: str = "2", st=None) -> None:
        st = st or state
        path = d / f"ckpt-{name.replace(' ', '_').replace(',', '')}"
        save_state(path, st)
        damage(path / checkpoint_name(st["step"]))
        out.append((name, str(path), tag, steps))

    folder("truncated", lambda p: p.write_bytes(p.read_bytes()[:p.stat().st_size // 2]), " (issue 13)")
    folder("random bytes", lambda p: p.write_bytes(os.urandom(20000)), " (issue 13)")
    folder("0 bytes", lambda p: p.write_bytes(b""), " (issue 13)")
    folder("wrong shapes", lambda p: None, " (issue 13)")
    folder("other model", lambda p: None, "", st=dict(state, model_preset="llama-7b"))
    folder("saved at --tp 2 --ep 2", lambda p: None, " (issue 12)", st=dict(state, layout={"tp": 2, "ep": 2}))
    folder("at step 6, --steps 3", lambda p: None, " (issue 13)", steps="3", st=dict(state, step=6))
    folder("latest names a missing file", lambda p: p.unlink())
    folder("latest garbage", lambda p: (p.parent / "latest").write_text("../../etc/passwd"))
    folder("no latest", lambda p: (p.parent / "latest").unlink())
    folder("not a trainer checkpoint", lambda p: torch.save({"weights": torch.zeros(2)}, p))
    folder("1 KiB of the weights overwritten, zip intact (issue 24)", _overwrite_weights)
    folder("saved at --tokens-per-gpu 256 (issue 24)", lambda p: None,
           st=dict(state, shape={**state["shape"], "--tokens-per-gpu": 256}))
    out.append(("missing folder", str(d / "no-such-ckpt"), "", "2"))
    return out


def _overwrite_weights(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(b"/data/0") + 64
    data[at:at + 1024] = os.urandom(1024)
    path.write_bytes(bytes(data))


def _datasets(d: Path) -> list[tuple[str, str, str]]:
    """Corrupt Megatron indexed datasets: (name, prefix, tag)."""
    jsonl = d / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": "w" * n}) + "\n" for n in (5, 80, 300, 12, 40, 150)))
    prepare_cli.prepare(jsonl, d / "good")
    idx, bin_ = (d / "good.idx").read_bytes(), (d / "good.bin").read_bytes()
    out = []

    def variant(name: str, new_idx: bytes, new_bin: bytes, tag: str = "") -> None:
        prefix = d / f"ds-{len(out)}"
        Path(str(prefix) + ".idx").write_bytes(new_idx)
        Path(str(prefix) + ".bin").write_bytes(new_bin)
        out.append((name, str(prefix), tag))

    def poked(fmt: str, offset: int, value) -> bytes:
        b = bytearray(idx)
        struct.pack_into(fmt, b, offset, value)
        return bytes(b)

    variant("truncated .idx", idx[:60], bin_, " (issue 13)")
    variant("garbage .idx", os.urandom(len(idx)), bin_, " (issue 13)")
    variant("empty .idx", b"", bin_, " (issue 13)")
    variant("truncated .bin", idx, bin_[:100], " (issue 13)")
    variant("negative length in .idx", poked("<i", 34 + 4, -50), bin_, " (issue 13)")
    variant("length past the .bin", poked("<i", 34 + 8, 10**6), bin_, " (issue 13)")
    variant("bad document index", poked("<q", 34 + 12 * 6 + 8, 77), bin_)
    variant("bin longer than the index", idx, bin_ + b"\0" * 64)
    out.append(("missing prefix", str(d / "no-such-ds"), ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--verbose", action="store_true", help="print every case, clear ones included")
    args = ap.parse_args()
    counts = {"clear": 0, "traceback": 0, "silent": 0, "hang": 0}
    issues = {n: dict(counts) for n in ISSUES}
    exit2 = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cases = [c for c in build_cases(d) if args.only in c.name]
        for case in cases:
            work = d / "work"
            work.mkdir(exist_ok=True)
            kind, code, line = classify(case, work)
            counts[kind] += 1
            exit2 += kind == "clear" and code == 2
            for n, issue in issues.items():
                issue[kind] += f"(issue {n})" in case.name
            if args.verbose or kind != "clear":
                shown = line.replace(str(d), "TMP").splitlines()
                print(f"{kind:9s} rc={code!s:4s} {case.name}: {shown[-1][:200] if shown else ''}", flush=True)
    print(f"\n{len(cases)} bad inputs in {time.monotonic() - start:.0f} s: " +
          ", ".join(f"{k} {v}" for k, v in counts.items()) + f" (clear with exit status 2: {exit2})")
    for n, issue in issues.items():
        print(f"of them listed in issue {n}: {sum(issue.values())}: " + ", ".join(f"{k} {v}" for k, v in issue.items()))


if __name__ == "__main__":
    main()
