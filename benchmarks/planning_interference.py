"""What planning one batch ahead on a thread costs the training loop's host work.

The loader plans batch ``k + 1`` on a worker thread while step ``k`` trains
(``prefetch.py``).  Planning is host Python, so it shares the interpreter lock
with the thread that launches the step's kernels.  Every torch op releases the
lock while it runs (on a GPU: while it launches), and taking it back waits for
the planning thread to give it up, at most the interpreter's switch interval
(5 ms by default).  This measures that: the main thread runs a launch-bound
loop (``--ops`` small torch ops, a stand-in for a step's kernel launches) while
the worker thread plans the benchmark's batches back to back (the worst case:
planning takes a fraction of each real step), with the interpreter's default
switch interval and with the interval the prefetcher uses while it plans, and
while a child process plans (``plan_process.py``, ``--zeppelin-prefetch
process``: a thread here waits on the child and receives each Plan, the
loop's only share of the planning; its CPU time per Plan is measured too, and
beside it what unpickling the Plan object itself would cost).

    python benchmarks/planning_interference.py --gpus 64,1024

Rounds interleave the cases, and each case's figure is the median over rounds,
so load from other jobs on the machine spreads over all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import multiprocessing
import pickle
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks import each other by name
from planner_latency import batch  # noqa: E402

from megatron_zeppelin.cost import CostModel  # noqa: E402
from megatron_zeppelin.errors import exit_on_user_error  # noqa: E402
from megatron_zeppelin.model_config import load_model  # noqa: E402
from megatron_zeppelin.plan.compact import CompactPlan  # noqa: E402
from megatron_zeppelin.plan_process import PlanFn, PlanningProcess  # noqa: E402
from megatron_zeppelin.prefetch import PLANNING_SWITCH_INTERVAL_S, planning_switch_interval  # noqa: E402
from megatron_zeppelin.remap.exchange import build_exchange  # noqa: E402
from megatron_zeppelin.sampler.batch_sampler import PieceTable  # noqa: E402
from megatron_zeppelin.sampler.lengths import load_lengths, resolve_lengths  # noqa: E402
from megatron_zeppelin.schedule.attention import attention_schedule  # noqa: E402
from megatron_zeppelin.sim.timeline import step_shape, transport_of  # noqa: E402
from megatron_zeppelin.topology import load_cluster  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: The section ``step_host_work.py`` writes into this benchmark's results file.
HOST_WORK_HEADING = "## The training thread's per-step host work"


def host_loop(ops: int, x: torch.Tensor) -> float:
    """Seconds the main thread takes for ``ops`` small torch ops."""
    t0 = time.perf_counter()
    for _ in range(ops):
        x = x + 1
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Receiving:
    """What receiving one Plan costs this process, sent one way."""

    cpu_ms: float
    """Mean CPU ms per Plan over 20 (the mean: the collector's full passes, set off
    every few Plans, are part of the cost), the collector on, each Plan held while
    the next two arrive (the loader holds the step's Plan and the prefetched one)."""
    paused_cpu_ms: float
    """The same with the collector paused."""
    tracked: int
    """Objects of one Plan (and of what was derived from it) the collector tracks
    (walks in every full pass) while it lives."""
    kib: float
    """Bytes sent, KiB."""


def receiving(blob: bytes, receive) -> Receiving:
    """``receive(blob)`` (which returns the Plan), measured."""
    def cpu_ms(collector_on: bool) -> float:
        held, times = [], []
        gc.collect()
        for _ in range(20):
            if not collector_on:
                gc.disable()
            t0 = time.process_time()
            held.append(receive(blob))
            times.append(time.process_time() - t0)
            gc.enable()
            del held[:-2]
        return statistics.mean(times) * 1e3

    gc.collect()
    before = len(gc.get_objects())
    plan = receive(blob)
    gc.collect()                                # what survives a pass (tuples of ints leave it)
    tracked = len(gc.get_objects()) - before
    del plan
    return Receiving(cpu_ms(True), cpu_ms(False), tracked, len(blob) / 1024)


def first_reads(plan, cost: CostModel) -> tuple:
    """What a rank's training thread derives from a step's Plan before its first
    attention and layout switch (rank ``world // 2``): its tokens' spans, both
    attention schedules (its projection) and the switch's index maps -- the
    placements and spans of the Plan it reads (``step_host_work.py`` measures
    each part, over many ranks)."""
    rank = plan.world_size // 2
    transport = transport_of(cost.routed(True))
    transport = transport if plan.routed else transport.direct()     # LaneCommunicator.transport_for
    shape = step_shape(cost, True).attn
    return (plan.attention_spans(rank), build_exchange(plan, rank),
            *(attention_schedule(plan, shape, transport, backward, rank) for backward in (False, True)))


def receive_costs(plan, cost: CostModel) -> tuple[Receiving, Receiving, Receiving]:
    """Receiving ``plan`` as the process path does (unpickle the :class:`CompactPlan`
    the child sends, make the Plan on its arrays), the same followed by a rank's
    first reads (held, as the step's context holds them), and, for comparison,
    as a pickled Plan object (how Plans crossed before)."""
    compact = pickle.dumps(CompactPlan.of(plan))
    assert pickle.loads(compact).plan() == plan
    return (receiving(compact, lambda blob: pickle.loads(blob).plan()),
            receiving(compact, lambda blob: (lambda p: (p, first_reads(p, cost)))(pickle.loads(blob).plan())),
            receiving(pickle.dumps(dataclasses.replace(plan)), pickle.loads))    # its fields, no caches


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(10_000):
            pass


def with_spinning_child(loop) -> float:
    """``loop()``'s seconds while a child process only burns a core: on a box
    with few free cores the share of the planning child's cost that is core
    contention, not the interpreter lock."""
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    child = spawn.Process(target=_spin, args=(stop,), daemon=True)
    child.start()
    time.sleep(0.3)             # spawned and spinning when the loop starts
    try:
        return loop()
    finally:
        stop.set()
        child.join()


def with_planning(plan_once, loop, shorter_switch: bool) -> float:
    """``loop()``'s seconds while a worker thread plans back to back (``plan_once``
    in a child process: the thread waits on it)."""
    stop = threading.Event()

    def planning() -> None:
        while not stop.is_set():
            if shorter_switch:
                with planning_switch_interval():
                    plan_once()
            else:
                plan_once()

    worker = threading.Thread(target=planning, daemon=True)
    worker.start()
    time.sleep(0.02)            # the worker is planning when the loop starts
    try:
        return loop()
    finally:
        stop.set()
        worker.join()


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """The cluster, model and batch the benchmark plans (``step_host_work.py`` plans the same)."""
    p.add_argument("--gpus", type=lambda s: [int(v) for v in s.split(",")], default=[64, 1024])
    p.add_argument("--cluster", default="h100-8x400g")
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--lengths", default="synthetic-longtail")
    p.add_argument("--max-seq-len", type=int, default=524288)
    p.add_argument("--seed", type=int, default=0)


def batch_pieces(args: argparse.Namespace) -> np.ndarray:
    return PieceTable.from_lengths(load_lengths(resolve_lengths(args.lengths)), args.max_seq_len).lengths


def benchmark_planning(args: argparse.Namespace, cluster, model, pieces: np.ndarray, world: int,
                       decide: bool = True) -> tuple[CostModel, list[int], PlanFn]:
    """The cost model, the batch and the planning function at ``world`` GPUs
    (``decide=False``: every batch remaps)."""
    cost = CostModel(cluster.with_nodes(max(world // cluster.topology.gpus_per_node, 1)), model)
    lens = batch(pieces, world, np.random.default_rng(args.seed))
    cap = max(int(1.05 * sum(lens) / world), -(-args.max_seq_len // world))
    # As pretrain_gpt.py --zeppelin plans (build_plan_fn): routed crossings, remap and decision on.
    return cost, lens, PlanFn("zeppelin", cost.routed(True), cap, remap=True, time_limit_s=10.0, decide=decide)


def run(args: argparse.Namespace) -> str:
    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    pieces = batch_pieces(args)
    x = torch.zeros(64, 64)
    loop = lambda: host_loop(args.ops, x)  # noqa: E731
    rows = []
    for world in args.gpus:
        cost, lens, plan_fn = benchmark_planning(args, cluster, model, pieces, world)
        plan_once = lambda: plan_fn(lens)  # noqa: E731
        plan_once()                                  # compiled loops loaded, caches warm
        t0 = time.process_time()
        plan = plan_once()
        plan_ms = (time.process_time() - t0) * 1e3
        compact, read, whole = receive_costs(plan, cost)
        child = PlanningProcess(plan_fn)
        in_child = lambda: child(lens)  # noqa: E731
        in_child()                                   # the child started, its caches warm
        cases: dict[str, list[float]] = {"alone": [], "default": [], "shorter": [], "process": [], "spin": []}
        for r in range(args.rounds):
            cases["alone"].append(loop())
            cases["default"].append(with_planning(plan_once, loop, shorter_switch=False))
            cases["shorter"].append(with_planning(plan_once, loop, shorter_switch=True))
            cases["process"].append(with_planning(in_child, loop, shorter_switch=False))
            cases["spin"].append(with_spinning_child(loop))
            print(f"  {world} GPUs, round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in cases.items()), file=sys.stderr)
        child.close()
        alone, default, shorter, process, spin = (statistics.median(cases[k]) * 1e3
                                                  for k in ("alone", "default", "shorter", "process", "spin"))
        rows.append(f"| {world} | {plan_ms:.0f} | {alone:.1f} | {default:.1f} ({default / alone:.1f}x) "
                    f"| {shorter:.1f} ({shorter / alone:.1f}x) | {process:.1f} ({process / alone:.1f}x) "
                    f"| {spin:.1f} ({spin / alone:.1f}x) "
                    + "".join(f"| {r.cpu_ms:.1f} | {r.paused_cpu_ms:.1f} | {r.tracked / 1000:.1f}k | {r.kib:.0f} "
                              for r in (compact, read, whole)) + "|")
    command = "python benchmarks/planning_interference.py " + shlex.join(sys.argv[1:])
    head = ("| GPUs | one decision, CPU ms | host loop alone, ms | while planning, default switch interval "
            f"(5 ms) | while planning, {PLANNING_SWITCH_INTERVAL_S * 1e3:g} ms switch interval (the prefetcher's) "
            "| while a child process plans | while a child process only spins (core contention) "
            "| receiving one Plan: CPU ms | the same, collector paused | tracked objects | sent, KiB "
            "| receiving it and a rank's first reads: CPU ms | collector paused | tracked objects | KiB "
            "| a pickled Plan object instead: CPU ms | collector paused | tracked objects | KiB |")
    return (f"# Planning on a thread or in a child process: what it costs the host loop\n\n"
            f"Command: `{command.strip()}`\n\n"
            f"{args.model} on {cluster.name}, Zeppelin's planner with its decision (as `pretrain_gpt.py "
            f"--zeppelin`), the batch of `benchmarks/planner_latency.py`; the host loop is {args.ops} torch ops "
            f"on a 64x64 tensor (each releases the interpreter lock while it runs, as a kernel launch does); "
            f"median of {args.rounds} interleaved rounds, wall-clock on a shared 2-core box.  In the child "
            f"process case (`--zeppelin-prefetch process`) a thread here waits on a spawned child and receives "
            f"its Plans; the spinning child is a control: a busy core and no planning.  Receiving one "
            f"Plan: CPU ms here to unpickle the `CompactPlan` the child sends (`plan/compact.py`: flat "
            f"arrays) and make the Plan on them (`plan/columns.py`: placements and spans made when read); "
            f"mean of 20 (the collector's full passes, set off every few "
            f"Plans, are part of the cost), each Plan held while the next two arrive, with the cyclic "
            f"collector on (as the loader receives it) and paused; the objects of one Plan the collector "
            f"tracks (walks in each full pass); then the same followed by what rank world/2 derives from it "
            f"before its first attention and layout switch (its spans, both attention schedules, the switch's "
            f"index maps; held with the Plan, as the step's context holds them); beside them, the same for a "
            f"pickled Plan object (how Plans crossed before).\n\n"
            f"{head}\n|" + " --- |" * 19 + "\n" + "\n".join(rows) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(p)
    p.add_argument("--ops", type=int, default=5000, help="torch ops in the host loop")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "planning_interference.md")
    args = p.parse_args()
    report = exit_on_user_error(lambda: run(args))
    print(report)
    old = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    kept = old[old.index(HOST_WORK_HEADING):] if HOST_WORK_HEADING in old else ""    # step_host_work.py's
    args.out.write_text(report + ("\n" + kept if kept else ""), encoding="utf-8")


if __name__ == "__main__":
    main()
