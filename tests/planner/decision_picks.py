"""The per-batch decision's picks on a fixed set of batches, as digests.

Batches of 8 to 256 GPUs on H100, A800 and A100-40G clusters (pinned copies
in ``golden/clusters/``), routing and remap on and off (and the remap forced
on), drawn as ``benchmarks/planner_latency.py`` draws them (16 pieces per GPU
of ``synthetic-longtail``) and as ``benchmarks/speedup_matrix.py`` does (the
training sampler's batches of every bundled and shared lengths sample at 64K
to 512K).  For each: the plan the decision picks, every plan it compares
(``decision_candidates``) and every baseline source's plans, each as a digest
of its attention placements, linear layout, routing flag, cap and packed rings.

``python -m tests.planner.decision_picks --all`` records them into
``golden/decision_picks.json``, ``--check`` compares; ``--all`` adds the 128- and
256-GPU batches and the shared lengths samples (``--shared``), which
``tests/planner/test_decision_picks.py`` leaves to this command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.baseline_candidates import SOURCES
from megatron_zeppelin.planner.surrogate import surrogate_clock
from megatron_zeppelin.planner.zeppelin_decide import DecidingZeppelinPlanner, decision_candidates
from megatron_zeppelin.sampler import batch_budget
from megatron_zeppelin.sampler.batch_sampler import PieceTable
from megatron_zeppelin.sampler.lengths import load_lengths, resolve_lengths
from megatron_zeppelin.sim.simulate import sample_batches
from megatron_zeppelin.sim.timeline import replay_clock
from megatron_zeppelin.topology import load_cluster

HERE = Path(__file__).parent
GOLDEN = HERE / "golden" / "decision_picks.json"
#: Where ``benchmarks/speedup_matrix.py`` finds the shared lengths samples.
SHARED_LENGTHS = HERE.parents[1].parent / "shared" / "data" / "lengths"
K = 1024


@dataclass(frozen=True)
class Case:
    """One batch and the run it is decided for."""

    name: str
    cluster: str
    gpus: int
    model: str
    cap: int
    routing: bool
    remap: bool
    remap_decided: bool
    lens: tuple[int, ...]

    def context(self) -> PlanContext:
        cluster = load_cluster(HERE / "golden" / "clusters" / f"{self.cluster}.yaml")
        cluster = cluster.with_nodes(max(self.gpus // cluster.topology.gpus_per_node, 1))
        # Recorded when the engine sent dK/dV only in fp32: the goldens pin that setting.
        cost = CostModel(cluster, load_model(self.model), ring_grad_dtype="fp32").routed(self.routing)
        return PlanContext(cost=cost, tokens_per_gpu=self.cap, remap_enabled=self.remap,
                           remap_decided=self.remap_decided, step_model=surrogate_clock(cost),
                           settle_model=replay_clock(cost))


def latency_case(gpus: int, seed: int, routing: bool = True, remap: bool = True) -> Case:
    """A batch as ``benchmarks/planner_latency.py --decide`` draws it."""
    max_len = 524288
    pieces = PieceTable.from_lengths(load_lengths(resolve_lengths("synthetic-longtail")), max_len).lengths
    lens = np.random.default_rng(seed).choice(pieces, 16 * gpus).tolist()
    cap = max(int(1.05 * sum(lens) / gpus), -(-max_len // gpus))
    return Case(f"latency-{gpus}-s{seed}-r{int(routing)}m{int(remap)}", "h100-8x400g", gpus, "llama-7b", cap,
                routing, remap, True, tuple(int(x) for x in lens))


def matrix_case(lengths: Path, cluster: str, gpus: int, model: str, max_k: int, routing: bool, remap: bool,
                remap_decided: bool = True, seed: int = 0) -> Case:
    """A batch as ``benchmarks/speedup_matrix.py`` samples it (one step)."""
    cap = {"llama-3b": 32768, "llama-7b": 16384, "llama-13b": 16384, "llama-30b": 8192}[model]
    lens, = sample_batches(load_lengths(lengths), max_seq_len=max_k * K, tokens_per_batch=batch_budget(cap, gpus, max_k * K),
                           steps=1, seed=seed)
    name = (f"{lengths.stem}-{cluster}-{gpus}-{model}-{max_k}K-r{int(routing)}m{int(remap)}"
            + ("" if remap_decided else "forced") + (f"-s{seed}" if seed else ""))
    return Case(name, cluster, gpus, model, cap, routing, remap, remap_decided, tuple(int(x) for x in lens))


def cases(every: bool = False, shared: Path | None = None) -> list[Case]:
    """The fixed set (``every``: with the 128- and 256-GPU batches and the
    samples in ``shared``)."""
    out = [latency_case(g, s) for g in (8, 16, 32, 64) for s in (0, 1)]
    out += [latency_case(32, 2, routing=False), latency_case(32, 3, remap=False),
            latency_case(16, 4, routing=False, remap=False)]
    samples = [resolve_lengths(f"synthetic-{s}") for s in ("books", "web", "longtail")]
    samples += sorted(shared.glob("*.npy")) if every and shared else []
    grid = [("h100-8x400g", 16, "llama-7b", 128, True, True), ("a800-4x200g", 16, "llama-3b", 64, True, True),
            ("a100-40g-4x100g", 32, "llama-13b", 256, True, True), ("h100-8x400g", 32, "llama-30b", 256, False, True),
            ("a800-4x200g", 8, "llama-7b", 128, True, False), ("h100-8x400g", 64, "llama-7b", 512, True, True),
            ("a100-40g-4x100g", 16, "llama-7b", 64, False, False), ("a800-4x200g", 32, "llama-13b", 512, True, True)]
    for i, sample in enumerate(samples):
        for j, (cluster, gpus, model, max_k, routing, remap) in enumerate(grid):
            if (i + j) % 2 == 0:
                out.append(matrix_case(sample, cluster, gpus, model, max_k, routing, remap))
    out += [matrix_case(samples[0], "h100-8x400g", 16, "llama-7b", 128, True, True, remap_decided=False),
            matrix_case(samples[2], "a800-4x200g", 8, "llama-3b", 64, True, True, seed=1)]
    if every:
        out += [latency_case(g, s) for g in (128, 256) for s in (0, 1)]
        out += [matrix_case(s, "h100-8x400g", 256, "llama-7b", 512, True, True) for s in samples[1:3]]
        out += [matrix_case(s, "a800-4x200g", 128, "llama-13b", 256, True, True) for s in samples[::3]]
    return out


def digest(plan: Plan) -> str:
    """The layouts that run: every placement (mode, ranks, shards), the linear
    spans, whether crossings route, the cap, the packed rings and groups."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((plan.world_size, plan.gpus_per_node, plan.seq_lens, plan.token_cap, plan.routed)).encode())
    for p in plan.attention:
        h.update(repr((p.seq, p.mode.value, p.ranks, p.shards)).encode())
    for spans in plan.linear:
        h.update(repr([(s.seq, s.start, s.end) for s in spans]).encode())
    if plan.packed_rings:           # absent from the digests of plans without them
        h.update(repr(plan.packed_rings).encode())
    if plan.packed_ulysses:         # likewise
        h.update(repr(("packed_ulysses", plan.packed_ulysses)).encode())
    return h.hexdigest()


def record_case(case: Case) -> dict:
    """The case's pick, the decision's candidates and each source's plans, as digests."""
    ctx = case.context()
    return {"pick": digest(DecidingZeppelinPlanner().plan(case.lens, ctx)),
            "candidates": [digest(p) for p in decision_candidates(case.lens, ctx)],
            "sources": {name: [digest(d.plan()) for d in source(case.lens, ctx)] for name, source in SOURCES.items()}}


def refuse(problem: str) -> None:
    """One line naming the problem and the fix, exit 2."""
    print(f"decision_picks: {problem}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="also the 128- and 256-GPU batches and the shared samples")
    p.add_argument("--shared", type=Path, default=SHARED_LENGTHS, help="the shared lengths samples")
    p.add_argument("--check", action="store_true", help="compare with the recorded digests instead of recording")
    args = p.parse_args()
    # A recording rewrites the whole golden file: without --all, or without the
    # shared samples (a worktree's ../shared is not the repository's), it would
    # silently drop the cases it did not run.
    if not (args.check or args.all):
        refuse("recording rewrites every case; add --all (or --check to compare)")
    if args.all and not any(args.shared.glob("*.npy")):
        refuse(f"no lengths samples in {args.shared}; pass --shared DIR (the repository's ../shared/data/lengths)")
    recorded = json.loads(GOLDEN.read_text())["cases"] if args.check else {}
    out, bad = {}, []
    for case in cases(args.all, args.shared):
        t0 = time.process_time()
        out[case.name] = record_case(case)
        status = ""
        if args.check:
            status = "same" if recorded.get(case.name) == out[case.name] else "DIFFERENT"
            bad += [case.name] if status != "same" else []
        print(f"{case.name}: {len(case.lens)} sequences, {time.process_time() - t0:.2f} s CPU {status}", flush=True)
    if args.check:
        print(f"{len(out) - len(bad)} of {len(out)} cases as recorded; different: {bad}")
        raise SystemExit(1 if bad else 0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    GOLDEN.write_text(json.dumps({"recorded_from": commit, "cases": out}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
