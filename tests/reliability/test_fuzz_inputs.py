"""Fuzz: generated bad inputs for every CLI and every file the project reads.

Each family starts from a valid input (a lengths file, a preset, a dumped plan,
a trace, a trainer log, a checkpoint, an indexed dataset, the flags) and
mutates it at random (seeded): values swapped for NaN, negatives, huge numbers,
wrong types, keys dropped, bytes flipped, files truncated.  Every case runs in
a process forked from this one (torch is imported once) under a memory cap
(``resource.setrlimit(RLIMIT_AS)``: 1 GiB above what the process holds) and a
time cap, with its stdout and stderr captured, and must

* exit 2 with exactly one stderr line and no traceback -- or, when the
  mutation left a valid input, exit 0 (``compare``: 0 or 1, its verdict) with
  nothing on stderr;
* change no file but the outputs its command line names;
* finish within the time cap (a hang or an out-of-memory kill fails).

The trainer's ranks are not forked (``spawn_local`` is stubbed in the case's
process): what is fuzzed is everything the trainer checks before any rank
starts, which is where bad input must be caught.

The suite runs ``ZEPPELIN_FUZZ_CASES`` (default 2) cases per family and CLI;
``ZEPPELIN_FUZZ_CASES=200 ZEPPELIN_FUZZ_SEED=7 pytest tests/reliability/test_fuzz_inputs.py``
runs more, with another draw.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import multiprocessing as mp
import os
import random
import resource
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import yaml

from megatron_zeppelin.data import lengths as lengths_cli
from megatron_zeppelin.data import prepare as prepare_cli
from megatron_zeppelin.errors import exit_on_user_error
from megatron_zeppelin.presets import CONFIG_ROOT
from megatron_zeppelin.sim.cli import main as sim_main
from megatron_zeppelin.train import compare
from megatron_zeppelin.train import launch  # noqa: F401 -- imported once here, not in every forked case
from megatron_zeppelin.train.__main__ import main as train_main

CASES = int(os.environ.get("ZEPPELIN_FUZZ_CASES", "2"))
SEED = int(os.environ.get("ZEPPELIN_FUZZ_SEED", "0"))
TIME_CAP_S = float(os.environ.get("ZEPPELIN_FUZZ_TIME_S", "30"))
MEMORY_HEADROOM = 2**30
LENGTHS = [300, 40, 20, 200, 140, 5, 12, 5, 200, 30, 5, 40, 12, 30, 30, 200, 8, 380, 64, 30, 12, 90, 200, 250]

#: Values a mutation puts where a valid one was.
BAD_VALUES: list[Any] = [None, "", "x", "nan", -1, 0, 1, 2.5, -0.5, 1e308, math.nan, math.inf, -math.inf,
                         2**63, 2**70, True, [], {}, [1, "a"], {"a": None}]
#: Lines a mutation puts into a text lengths file.
BAD_LINES = ["0", "-1", "nan", "inf", "1e3", "1.5", "0x10", "99999999999999999999999", str(2**40 + 1),
             str(10**12), "\x00\x01", "１２", "abc", "+5", " 7 # comment", "-0", "1_000", "9" * 400]
#: Flag values for any numeric flag.
BAD_FLAG_VALUES = ["0", "-1", "nan", "inf", "-inf", "1e400", "2.5", "x", "", str(2**63), "1e-300", "007"]


def _exit_of(call: Callable[[], Any]) -> int:
    try:
        result = call()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return result if isinstance(result, int) else 0


CLIS: dict[str, Callable[[list[str]], int]] = {
    "train": lambda argv: _exit_of(lambda: train_main(argv)),
    "sim": lambda argv: _exit_of(lambda: sim_main(argv)),
    "compare": lambda argv: _exit_of(lambda: exit_on_user_error(lambda: compare.main(argv))),
    "lengths": lambda argv: _exit_of(lambda: lengths_cli.main(argv)),
    "prepare": lambda argv: _exit_of(lambda: prepare_cli.main(argv)),
}


@dataclass
class Case:
    family: str
    cli: str
    argv: list[str]
    outputs: list[str] = field(default_factory=list)
    """Paths the command line names as outputs (allowed to change)."""
    what: str = ""
    """The mutation, for the failure message."""


# ------------------------------------------------------------------ running
def _run_child(case: Case, err: str, out: str, cap: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    launch.spawn_local = lambda cfg: None       # accepted: the ranks would start here
    code = 99
    try:
        code = CLIS[case.cli](case.argv)
    except BaseException:  # noqa: BLE001 -- a traceback is the finding
        import traceback
        traceback.print_exc()
        code = 98
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def run_case(case: Case, work: Path) -> tuple[str | None, int | None]:
    """(None if the case behaved, else what went wrong; its exit status)."""
    err, out = work / f"err-{os.getpid()}.txt", work / f"out-{os.getpid()}.txt"
    inputs = work / "in"
    before = _snapshot(inputs)
    t0 = time.monotonic()
    proc = mp.get_context("fork").Process(target=_run_child,
                                          args=(case, str(err), str(out), _address_space() + MEMORY_HEADROOM))
    proc.start()
    proc.join(TIME_CAP_S)
    seconds = time.monotonic() - t0
    if proc.is_alive():
        proc.kill()
        proc.join()
        return f"still running after {TIME_CAP_S:g} s", None
    text = err.read_text(errors="replace")
    lines = text.strip().splitlines()
    code = proc.exitcode
    allowed = {0, 1} if case.cli == "compare" else {0}
    if code < 0:
        return f"killed by signal {-code} after {seconds:.1f} s (memory cap?)", code
    if "Traceback" in text:
        return f"traceback (exit {code}): {text[-600:]}", code
    if code == 2 and len(lines) != 1:
        return f"exit 2 with {len(lines)} stderr lines: {lines[:4]}", code
    if code != 2 and (code not in allowed or lines):
        return f"exit {code}, stderr {lines[:3]}", code
    changed = {p for p, h in _snapshot(inputs).items() if before.get(p) != h} | (set(before) - set(_snapshot(inputs)))
    named = {str(Path(o)) for o in case.outputs}
    stray = sorted(p for p in changed if not any(p == o or p.startswith(o + os.sep) for o in named))
    if stray:
        return f"changed files it does not name as outputs: {stray}", code
    return None, code


# ------------------------------------------------------------------ mutations
def mutate_value(rng: random.Random, doc: Any) -> tuple[Any, str]:
    """``doc`` (JSON/YAML data) with one value replaced or one key dropped."""
    doc = copy.deepcopy(doc)
    paths: list[tuple] = []

    def walk(node: Any, path: tuple) -> None:
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node[:50]):
                walk(v, path + (i,))

    walk(doc, ())
    path = rng.choice(paths[1:] or paths)
    if not path:
        return rng.choice(BAD_VALUES), "the whole document replaced"
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.25:
        del parent[path[-1]]
        return doc, f"{'.'.join(map(str, path))} dropped"
    value = rng.choice(BAD_VALUES)
    parent[path[-1]] = value
    return doc, f"{'.'.join(map(str, path))} = {value!r}"


def mutate_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """Truncated, bytes overwritten, bytes inserted, or emptied."""
    kind = rng.choice(["truncate", "overwrite", "insert", "empty", "zero-run"])
    at = rng.randrange(max(len(data), 1))
    if kind == "truncate":
        return data[:at], f"truncated at byte {at}"
    if kind == "overwrite":
        n = rng.randint(1, 64)
        return data[:at] + rng.randbytes(n) + data[at + n:], f"{n} bytes overwritten at {at}"
    if kind == "insert":
        n = rng.randint(1, 64)
        return data[:at] + rng.randbytes(n) + data[at:], f"{n} bytes inserted at {at}"
    if kind == "zero-run":
        n = rng.randint(1, 1024)
        return data[:at] + bytes(n) + data[at + n:], f"{n} bytes zeroed at {at}"
    return b"", "emptied"


def mutate_text_lengths(rng: random.Random, lengths: list[int]) -> tuple[bytes, str]:
    lines = [str(x) for x in lengths]
    kind = rng.random()
    if kind < 0.6:
        i, bad = rng.randrange(len(lines)), rng.choice(BAD_LINES)
        lines[i] = bad
        return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"), f"line {i + 1} = {bad!r}"
    return mutate_bytes(rng, ("\n".join(lines) + "\n").encode())


def mutate_npy(rng: random.Random, lengths: list[int]) -> tuple[bytes, str]:
    buf = io.BytesIO()
    kind = rng.choice(["dtype", "shape", "value", "bytes"])
    array = np.array(lengths, dtype=np.int64)
    what = kind
    if kind == "dtype":
        dtype = rng.choice(["float64", "bool", "complex64", "uint64", "int8", "U3", "float16"])
        array, what = array.astype(dtype), f"dtype {dtype}"
    elif kind == "shape":
        shape = rng.choice([(0,), (2, 12), (1, 24), ()])
        array = np.zeros(shape, dtype=np.int64) if shape in ((0,), ()) else array.reshape(shape)
        what = f"shape {shape}"
    elif kind == "value":
        i, value = rng.randrange(array.size), rng.choice([0, -1, 2**40 + 1, 10**12, 2**62, -(2**63)])
        array[i], what = value, f"entry {i} = {value}"
    np.save(buf, array)
    data = buf.getvalue()
    if kind == "bytes":
        data, what = mutate_bytes(rng, data)
    return data, what


# ------------------------------------------------------------------ families
class Inputs:
    """Valid seed inputs under ``work/in`` and the argv of each CLI around them."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.dir = work / "in"
        self.dir.mkdir()
        self.out = work / "out"
        self.out.mkdir()
        self.lengths = self.dir / "lengths.txt"
        self.lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
        self._n = 0

    def file(self, suffix: str, data: bytes) -> str:
        self._n += 1
        path = self.dir / f"case{self._n}{suffix}"
        path.write_bytes(data)
        return str(path)

    def output(self, name: str) -> str:
        self._n += 1
        return str(self.out / f"{self._n}-{name}")

    def train(self, *extra: str, lengths: str | None = None) -> list[str]:
        return ["--nodes", "1", "--gpus-per-node", "2", "--strategy", "zeppelin", "--max-seq-len", "256",
                "--tokens-per-gpu", "192", "--steps", "2", "--seed", "3", "--quiet", "--timeout", "20",
                "--lengths", lengths or str(self.lengths), *extra]

    def sim(self, *extra: str, lengths: str | None = None) -> list[str]:
        return ["--cluster", "cpu-sim", "--nodes", "1", "--model", "tiny", "--max-seq-len", "256",
                "--tokens-per-gpu", "192", "--steps", "1", "--strategies", "te_cp,zeppelin", "--no-progress",
                "--lengths", lengths or str(self.lengths), *extra]


def lengths_cases(rng: random.Random, inp: Inputs) -> list[Case]:
    out = []
    for _ in range(CASES):
        text, what = mutate_text_lengths(rng, LENGTHS)
        data, what_npy = mutate_npy(rng, LENGTHS)
        t, n = inp.file(".txt", text), inp.file(".npy", data)
        out += [Case("lengths", "train", inp.train(lengths=t), what=what),
                Case("lengths", "sim", inp.sim(lengths=n), what=what_npy),
                Case("lengths", "lengths", [t], what=what)]
    return out


def preset_cases(rng: random.Random, inp: Inputs) -> list[Case]:
    out = []
    for _ in range(CASES):
        kind, base = rng.choice([("clusters", "cpu-sim"), ("models", "tiny")])
        doc, what = mutate_value(rng, yaml.safe_load((CONFIG_ROOT / kind / f"{base}.yaml").read_text()))
        path = inp.file(".yaml", yaml.safe_dump(doc).encode())
        flag = "--cluster" if kind == "clusters" else "--model"
        out += [Case("presets", "train", inp.train(flag, path), what=f"{kind}/{base}: {what}"),
                Case("presets", "sim", inp.sim(flag, path), what=f"{kind}/{base}: {what}")]
    return out


def plan_cases(rng: random.Random, inp: Inputs, plan: dict) -> list[Case]:
    out = []
    for k in range(CASES):
        doc, what = mutate_value(rng, plan)
        data = json.dumps(doc).encode()
        if rng.random() < 0.2:
            data, what = mutate_bytes(rng, data)
        if k == 0:      # the first case of a family is always refused: an empty file
            data, what = b"", "emptied"
        path = inp.file(".json", data)
        json_out = inp.output("plan-time.json")
        out.append(Case("plans", "sim", ["--plan", path, "--cluster", "cpu-sim", "--model", "tiny", "--json",
                                         json_out], outputs=[json_out], what=what))
    return out


def trace_cases(rng: random.Random, inp: Inputs, trace: dict) -> list[Case]:
    out = []
    for k in range(CASES):
        doc, what = mutate_value(rng, trace)
        data = b"" if k == 0 else json.dumps(doc).encode()
        what = "emptied" if k == 0 else what
        path = inp.file(".json", data)
        out.append(Case("traces", "sim", ["replay", path, "--cluster", "cpu-sim", "--model", "tiny"], what=what))
    return out


def log_cases(rng: random.Random, inp: Inputs, log: list[dict]) -> list[Case]:
    out = []
    good = inp.file(".jsonl", "".join(json.dumps(r) + "\n" for r in log).encode())
    for k in range(CASES):
        i = rng.randrange(len(log))
        records = copy.deepcopy(log)
        records[i], what = mutate_value(rng, records[i])
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        if rng.random() < 0.2:
            data, what = mutate_bytes(rng, data)
        if k == 0:
            data, what = b"", "emptied"
        bad = inp.file(".jsonl", data)
        out.append(Case("logs", "compare", [bad, good] if rng.random() < 0.5 else [good, bad], what=what))
    return out


def checkpoint_cases(rng: random.Random, inp: Inputs) -> list[Case]:
    from megatron_zeppelin.train.checkpoint import checkpoint_name, save_state
    from megatron_zeppelin.train.cli import parse_args
    from megatron_zeppelin.train.trainer import run_shape

    cfg = parse_args(inp.train("--steps", "3"))
    state = {"step": 1, "shards": {"tp0-ep0": {"model": {"w": torch.zeros(300)}, "optimizer": {}}},
             "layout": {"tp": 1, "ep": 1}, "sampler": {"epoch": 0, "offset": 0, "index": 1},
             "strategy": "zeppelin", "model_preset": "tiny", "shape": run_shape(cfg)}
    out = []
    for k in range(CASES):
        folder = inp.dir / f"ckpt{k}"
        kind = rng.choice(["bytes", "state", "latest", "sidecar"])
        if kind == "state":      # a well-formed, checksummed file holding bad values
            st, what = mutate_value(rng, {key: v for key, v in state.items() if key != "shards"})
            save_checksummed(folder, {**st, "shards": state["shards"]} if isinstance(st, dict) else st)
        else:
            save_state(folder, state)
            target = {"bytes": folder / checkpoint_name(1), "latest": folder / "latest",
                      "sidecar": folder / (checkpoint_name(1) + ".sha256")}[kind]
            data, what = mutate_bytes(rng, target.read_bytes())
            target.write_bytes(data)
        out.append(Case("checkpoints", "train", inp.train("--load", str(folder), "--steps", "3"),
                        what=f"{kind}: {what}"))
    return out


def save_checksummed(folder: Path, obj: Any) -> None:
    """``obj`` as a checkpoint folder's step-1 file, with a matching SHA-256 and ``latest``."""
    from megatron_zeppelin.train.checkpoint import CHECKSUM_SUFFIX, LATEST, checkpoint_name, file_sha256
    folder.mkdir()
    path = folder / checkpoint_name(1)
    torch.save(obj, path)
    (folder / (path.name + CHECKSUM_SUFFIX)).write_text(f"{file_sha256(path)}  {path.name}\n")
    (folder / LATEST).write_text(path.name + "\n")


def dataset_cases(rng: random.Random, inp: Inputs) -> list[Case]:
    from megatron_zeppelin.data import prepare
    docs = inp.work / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "w" * n}) + "\n" for n in (5, 80, 300, 12, 40, 150)))
    prepare.prepare(docs, inp.work / "good")
    idx, bin_ = (inp.work / "good.idx").read_bytes(), (inp.work / "good.bin").read_bytes()
    out = []
    for k in range(CASES):
        prefix = inp.dir / f"ds{k}"
        which = rng.choice(["idx", "bin", "idx-field"])
        new_idx, new_bin, what = idx, bin_, which
        if which == "idx":
            new_idx, what = mutate_bytes(rng, idx)
        elif which == "bin":
            new_bin, what = mutate_bytes(rng, bin_)
        else:   # one header or index integer set to an extreme
            b = bytearray(idx)
            at = rng.randrange(9, max(len(idx) - 8, 10))
            value = rng.choice([-1, 0, 2**31 - 1, -(2**31)])
            struct.pack_into("<i", b, at, value)
            new_idx, what = bytes(b), f"int32 at {at} = {value}"
        Path(f"{prefix}.idx").write_bytes(new_idx)
        Path(f"{prefix}.bin").write_bytes(new_bin)
        args = inp.train("--steps", "2")
        i = args.index("--lengths")
        out += [Case("datasets", "train", [*args[:i], "--data", str(prefix), *args[i + 2:]], what=what),
                Case("datasets", "lengths", [str(prefix)], what=what)]
    return out


TRAIN_FLAGS = ["--nodes", "--gpus-per-node", "--nics-per-node", "--max-seq-len", "--tokens-per-gpu", "--steps",
               "--seed", "--lr", "--batch-fill", "--tp", "--ep", "--micro-batches", "--min-routed-bytes",
               "--timeout", "--save-interval"]
SIM_FLAGS = ["--nodes", "--max-seq-len", "--tokens-per-gpu", "--tokens-per-batch", "--micro-batches",
             "--batch-fill", "--steps", "--seed", "--cp-size", "--flexsp-time-limit", "--plot-step"]


def flag_cases(rng: random.Random, inp: Inputs) -> list[Case]:
    out = []
    for _ in range(CASES):
        flag, value = rng.choice(TRAIN_FLAGS), rng.choice(BAD_FLAG_VALUES)
        out.append(Case("flags", "train", inp.train(flag, value), what=f"{flag} {value!r}"))
        flag, value = rng.choice(SIM_FLAGS), rng.choice(BAD_FLAG_VALUES)
        out.append(Case("flags", "sim", inp.sim(flag, value), what=f"{flag} {value!r}"))
    return out


def output_cases(rng: random.Random, inp: Inputs) -> list[Case]:
    """Outputs pointed at an input, a folder, a file's child, a non-empty log."""
    log = inp.file(".jsonl", b'{"step": 0}\n')
    # (path, whether the command may write it): the lengths file is the commands' input.
    targets = [(str(inp.lengths), False), (str(inp.dir), True), (str(inp.lengths / "x"), False),
               ("/proc/zeppelin-out", False), (log, True)]
    out = []
    for _ in range(CASES):
        for cli, flags in (("train", ["--json-log", "--save", "--dump-plans", "--dump-trace"]),
                           ("sim", ["--json", "--plot", "--dump-plans", "--trace"])):
            (target, writable), flag = rng.choice(targets), rng.choice(flags)
            argv = inp.train(flag, target) if cli == "train" else inp.sim(flag, target)
            out.append(Case("outputs", cli, argv, outputs=[target] if writable else [], what=f"{flag} {target}"))
        # data.prepare writes PREFIX.bin/.idx: over its own input, into a folder, or somewhere new.
        source = inp.file(".idx", b'{"text": "hello"}\n')
        prefix, writes = rng.choice([(source[:-4], False), (str(inp.dir) + os.sep, False),
                                     ("/proc/zeppelin-out/p", False), (inp.output("corpus"), True)])
        out.append(Case("outputs", "prepare", ["--input", source, "--output-prefix", prefix],
                        outputs=[prefix + ".bin", prefix + ".idx"] if writes else [], what=f"--output-prefix {prefix}"))
    return out


# ------------------------------------------------------------------ the test
@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """A dumped plan, a modeled trace and a trainer-shaped log to mutate (made once)."""
    tmp = tmp_path_factory.mktemp("seeds")
    lengths = tmp / "l.txt"
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    args = ["--cluster", "cpu-sim", "--nodes", "2", "--model", "tiny", "--max-seq-len", "256", "--tokens-per-gpu",
            "192", "--steps", "1", "--strategies", "zeppelin", "--no-progress", "--lengths", str(lengths),
            "--dump-plans", str(tmp / "plans"), "--trace", str(tmp / "trace.json")]
    with open(os.devnull, "w") as null:
        stdout, sys.stdout = sys.stdout, null
        try:
            sim_main(args)
        finally:
            sys.stdout = stdout
    plan = json.loads(next((tmp / "plans").glob("*.json")).read_text())
    trace = json.loads((tmp / "trace.json").read_text())
    record = {"step": 0, "loss": 5.5, "grad_norm": 0.6, "num_tokens": 359,
              "plan": {"local": 4, "intra": 0, "inter": 0, "ulysses": 0}, "attn_pairs_per_rank": [100, 120],
              "linear_tokens_per_rank": [180, 179], "attention_tokens_per_rank": [180, 179],
              "bytes": {"intra_node": 0, "inter_node_per_nic": [[0, 0]], "remap_intra_node": 0,
                        "remap_inter_node": 0}, "step_time_s": 0.1, "micro_batch_tokens": [359]}
    log = [record, {**record, "step": 1, "loss": 5.1}]
    return plan, trace, log


FAMILIES: dict[str, Callable[..., list[Case]]] = {
    "lengths": lengths_cases, "presets": preset_cases, "plans": plan_cases, "traces": trace_cases,
    "logs": log_cases, "checkpoints": checkpoint_cases, "datasets": dataset_cases, "flags": flag_cases,
    "outputs": output_cases,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuzzed_inputs_get_one_line_and_change_nothing(family, seeds, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan, trace, log = seeds
    rng = random.Random(f"{SEED}-{family}")
    inp = Inputs(tmp_path)
    extra = {"plans": (plan,), "traces": (trace,), "logs": (log,)}.get(family, ())
    cases = FAMILIES[family](rng, inp, *extra)
    results = [(c, *run_case(c, tmp_path)) for c in cases]
    failures = [f"{c.cli} {c.what}: {problem}" for c, problem, _ in results if problem]
    assert not failures, "\n".join(failures)
    # A family whose mutations all stayed valid would test nothing.
    assert any(code == 2 for _, _, code in results), [c.what for c in cases]


def test_the_harness_sees_a_traceback_a_hang_a_memory_blowup_and_a_stray_write(tmp_path, monkeypatch):
    inp = Inputs(tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "TIME_CAP_S", 1.0)

    def stray_write(argv: list[str]) -> int:
        inp.lengths.write_text("1\n")
        return 0

    fakes = {"boom": lambda argv: 1 // 0, "hang": lambda argv: time.sleep(60),
             "hog": lambda argv: len(bytearray(4 * MEMORY_HEADROOM)), "stray": stray_write,
             "two-lines": lambda argv: print("a\nb", file=sys.stderr) or 2}
    monkeypatch.setattr(sys.modules[__name__], "CLIS", {**CLIS, **fakes})
    problems = {name: run_case(Case("self-test", name, []), tmp_path)[0] for name in fakes}
    assert problems["boom"].startswith("traceback (exit 98)") and "ZeroDivisionError" in problems["boom"]
    assert problems["hang"] == "still running after 1 s"
    assert "MemoryError" in problems["hog"]
    assert problems["stray"] == f"changed files it does not name as outputs: {[str(inp.lengths)]}"
    assert problems["two-lines"] == "exit 2 with 2 stderr lines: ['a', 'b']"
