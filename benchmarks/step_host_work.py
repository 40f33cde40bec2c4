"""The training thread's per-step host work that grows with the plan: what one
rank derives from each step's Plan before its first attention and layout switch.

Planning runs in a child process (``plan_process.py``); what is left on each
rank's training thread, once per step (every layer of the step reuses it):

* the attention layer's forward and backward schedules (``attention/engine.py:
  build_schedule``) and the rank's lanes, wave batches and wire tags of each
  (what ``comm/lanes.py`` reads on the call) -- the rank's projection
  (``attention_schedule(..., rank)``), and beside it every rank's schedule,
  which the engine built before;
* the layout switch's index maps (``remap/exchange.py: build_exchange``) and
  its round schedule (``comm/rounds.py: start_round``, built once per step).

``--switch-calls`` measures instead what every layout switch CALL costs the
host (4 per layer: to the linear layout and back, forward and backward): the
remap's ``_Move.__call__`` and the communicator's ``start_round`` up to the lane
runner, which here moves nothing (``_IdleRunner``).  Its section follows the
other one in the same file.

For the Plan of ``benchmarks/planning_interference.py`` (Zeppelin with its
decision, routed crossings and remap, as ``pretrain_gpt.py --zeppelin``
plans), CPU milliseconds with the cyclic collector paused, and the objects the
collector tracks while the result is held; over every rank (a rank's work
depends on what reaches it), the median and the largest.

    python benchmarks/step_host_work.py --gpus 64,1024
    python benchmarks/step_host_work.py --gpus 64,1024 --switch-calls --sample 8

``--out`` replaces this section in ``docs/results/planning_interference.md``
(``planning_interference.py`` keeps it when it rewrites the file).
"""

from __future__ import annotations

import argparse
import gc
import math
import pickle
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks import each other by name
from planning_interference import (HOST_WORK_HEADING, add_batch_args, batch_pieces,  # noqa: E402
                                   benchmark_planning)

import torch  # noqa: E402

from megatron_zeppelin.comm.base import ByteCounters  # noqa: E402
from megatron_zeppelin.comm.rounds import LaneCommunicator, _round_schedule  # noqa: E402
from megatron_zeppelin.errors import exit_on_user_error  # noqa: E402
from megatron_zeppelin.plan.compact import CompactPlan  # noqa: E402
from megatron_zeppelin.model_config import load_model  # noqa: E402
from megatron_zeppelin.remap.exchange import build_exchange  # noqa: E402
from megatron_zeppelin.remap.remap import layout_move, pad_rows  # noqa: E402
from megatron_zeppelin.schedule.attention import attention_schedule  # noqa: E402
from megatron_zeppelin.sim.timeline import step_shape, transport_of  # noqa: E402
from megatron_zeppelin.step_context import RemapCounters  # noqa: E402
from megatron_zeppelin.topology import load_cluster  # noqa: E402

SWITCH_HEADING = "## The layout switch's per-call host work"


def measured(work: Callable[[], object]) -> tuple[float, int]:
    """CPU ms of ``work()``, the collector paused, and the objects it tracks
    while the result is held."""
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        t0 = time.process_time()
        held = work()
        ms = (time.process_time() - t0) * 1e3
        tracked = len(gc.get_objects()) - before
        del held
    finally:
        gc.enable()
    return ms, tracked


def engine_schedules(plan, shape, transport, rank: int, own: bool) -> list:
    """What a rank's first attention call derives: both passes' schedules (its
    projection when ``own``, else every rank's), and its lanes, batches and tags."""
    out = []
    for backward in (False, True):
        s = attention_schedule(plan, shape, transport, backward, rank if own else None)
        out.append((s, s.lanes(rank), s.wave_batches(rank), s.pair_tags(rank)))
    return out


def round_lanes(sizes: tuple, transport, world: int, rank: int, own: bool) -> tuple:
    """The switch's round schedule as a rank's ``start_round`` builds it (its
    projection when ``own``), and its lanes, batches and tags."""
    s, _ = _round_schedule(sizes, transport, world, rank if own else None)
    return s, s.lanes(rank), s.wave_batches(rank), s.pair_tags(rank)


class _IdleRunner:
    """A lane runner that takes a round and moves nothing: a switch call's host
    work up to the lanes, with no peer to answer."""

    stream = None

    def start(self, schedule, binding, recorder=None) -> None:
        return None


def step_switches(plan, transport, rank: int, row: int, dtype: torch.dtype, layers: int,
                  collect: bool) -> tuple[float, float, float]:
    """CPU ms of a rank's layout switch calls over one step of ``layers`` layers
    (4 calls each, as the forward and backward make them: ``layout_move`` and
    the call, the maps cached on the step's context): the first layer's 4, each
    later call (mean), and the whole step; the collector on or paused.

    The tensors are on the meta device: hidden-size rows of the real shapes,
    whose copies cost no host time (on a GPU they are the device's work).
    """
    cpu = torch.device("cpu")
    comm = LaneCommunicator.__new__(LaneCommunicator)
    comm._bind(None, rank, transport.topology, ByteCounters(), transport.min_routed_bytes, dtype, cpu,
               _IdleRunner())
    cache, counters = {}, RemapCounters()
    tokens = sum(sp.length for sp in plan.attention_spans(rank))
    meta = torch.device("meta")
    x = torch.empty(tokens + pad_rows(tokens), row, dtype=dtype, device=meta)
    times = []
    gc.collect()
    if not collect:
        gc.disable()
    try:
        for _ in range(layers):
            t0 = time.process_time()
            y = x
            for direction in ("to_linear", "to_attention") * 2:     # forward, then the backward's reverses
                y = layout_move(plan=plan, rank=rank, comm=comm, direction=direction, device=meta,
                                counters=counters, cache=cache)(y)
            times.append((time.process_time() - t0) * 1e3)
    finally:
        gc.enable()
    return times[0], statistics.fmean(times[1:]) / 4 if layers > 1 else math.nan, sum(times)


def switch_rows(plan, cost, transport, world: int, decide: bool, ranks: list[int]) -> str:
    """One table row of the switch calls' host work."""
    row, layers = cost.model.hidden_size, cost.model.num_layers
    dtype = torch.bfloat16 if cost.model.dtype_bytes == 2 else torch.float32
    step_switches(plan, transport, ranks[0], row, dtype, 1, True)      # the meta kernels' first use, untimed
    paused = [step_switches(plan, transport, r, row, dtype, layers, False) for r in ranks]
    on = [step_switches(plan, transport, r, row, dtype, layers, True) for r in ranks]

    def cell(xs: list[tuple], i: int) -> str:
        v = [x[i] for x in xs]
        return f"{statistics.median(v):.3f} / {max(v):.3f}"

    return (f"| {world} | {'decided' if decide else 'remaps'}{' routed' if plan.routed else ''} "
            f"| {len(plan.remap_pairs())} | {cell(paused, 0)} | {cell(paused, 1)} | {cell(on, 1)} "
            f"| {cell(paused, 2)} | {cell(on, 2)} |")


def run(args: argparse.Namespace) -> str:
    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    pieces = batch_pieces(args)
    rows = []
    for world, decide in ((w, d) for w in args.gpus for d in (True, False)):
        cost, lens, plan_fn = benchmark_planning(args, cluster, model, pieces, world, decide=decide)
        # As the training thread receives it from the planning child (remap pairs carried).
        plan = pickle.loads(pickle.dumps(CompactPlan.of(plan_fn(lens)))).plan()
        transport = transport_of(cost.routed(True))
        transport = transport if plan.routed else transport.direct()     # LaneCommunicator.transport_for
        shape = step_shape(cost, True).attn
        ranks = args.ranks or list(range(0, world, -(-world // args.sample)))
        if args.switch_calls:
            rows.append(switch_rows(plan, cost, transport, world, decide, ranks))
            print(rows[-1], file=sys.stderr)
            continue
        own = [measured(lambda r=r: engine_schedules(plan, shape, transport, r, True)) for r in ranks]
        exchange = [measured(lambda r=r: build_exchange(plan, r)) for r in ranks]
        every_move = [measured(plan.remap_schedule)] * 3     # what build_exchange walked before, per rank
        # The switch's round as start_round builds it (rows of the hidden size, in the model's dtype).
        row = cost.model.hidden_size
        sizes = tuple((i, s, d, n * row, cost.model.dtype_bytes)
                      for i, (s, d, n) in enumerate(plan.remap_pairs()))
        whole_round = [measured(lambda r=r: round_lanes(sizes, transport, world, r, False))
                       for r in list(ranks)[:args.whole_ranks]]
        own_round = [measured(lambda r=r: round_lanes(sizes, transport, world, r, True)) for r in ranks]
        whole = [measured(lambda r=r: engine_schedules(plan, shape, transport, r, False))
                 for r in list(ranks)[:args.whole_ranks]]
        t = plan.tier_counts()

        def cell(xs: list[tuple[float, int]]) -> str:
            ms, objs = zip(*xs)
            return (f"{statistics.median(ms):.1f} / {max(ms):.1f} | "
                    f"{statistics.median(objs) / 1000:.1f}k / {max(objs) / 1000:.1f}k")

        tiers = f"{t.local}/{t.intra}/{t.inter}/{t.ulysses}{' routed' if plan.routed else ''}"
        rows.append(f"| {world} | {'decided' if decide else 'remaps'} | {tiers} "
                    f"| {cell(whole)} | {cell(own)} | {len(plan.remap_pairs())} | {cell(every_move)} "
                    f"| {cell(exchange)} | {cell(whole_round)} | {cell(own_round)} |")
        print(rows[-1], file=sys.stderr)
    command = "python benchmarks/step_host_work.py " + shlex.join(sys.argv[1:])
    if args.switch_calls:
        return switch_section(args, cluster, model, command, rows)
    return (f"{HOST_WORK_HEADING}\n\nCommand: `{command.strip()}`\n\n"
            f"What each rank's training thread derives from a step's Plan before the step's first attention and "
            f"layout switch (planning itself runs in the child process), for the Plan of "
            f"`planning_interference.py` ({args.model} on {cluster.name}, Zeppelin with its decision: `decided`; "
            f"and without it, every batch remapping: `remaps`): the "
            f"attention layer's forward and backward schedules with the rank's lanes, wave batches and wire tags "
            f"of each, as every rank's schedule (what the engine built before) and as the rank's projection "
            f"(what it builds now: the same ops, order, waves, message ids and bytes, "
            f"`tests/schedule/test_rank_schedule.py`); and the layout switch's index maps (`build_exchange`, on "
            f"the Plan as the planning child sends it: the remap's message pairs come with it) and the switch's "
            f"round schedule with its lanes (`start_round`). "
            f"CPU ms with the collector paused and objects the collector tracks while the result is held, "
            f"median / largest over the ranks measured ({args.ranks or f'{args.sample} evenly spaced'}; every "
            f"rank's schedules: for the first {args.whole_ranks} of them), on the shared 2-core box.\n\n"
            "| GPUs | plan | tiers (local/intra/inter/ulysses) | every rank's schedules: CPU ms | tracked objects "
            "| the rank's projection: CPU ms | tracked objects | remap messages | every rank's moves "
            "(`remap_schedule`, walked by `build_exchange` before): CPU ms | tracked objects "
            "| `build_exchange` now: CPU ms | tracked objects | the switch's round, every rank's: CPU ms "
            "| tracked objects | the rank's projection: CPU ms | tracked objects |\n"
            "|" + " --- |" * 16 + "\n" + "\n".join(rows) + "\n\n"
            "What it says: every rank's schedules are work that grows with the world, which the engine did on "
            "every rank each step; the rank's projection grows with the rings and Ulysses groups that reach "
            "the rank (routed: also the rings with a member on its node, whose pieces it may relay).  Every "
            "rank's moves are no longer walked on the training thread (the child sends the pairs); what "
            "`build_exchange` still costs is the rank's own index maps, arrays as long as its tokens (made with "
            "numpy: torch's arange and cat ran on the intra-op threads, which spin on a loaded host): work that "
            "grows with the tokens per GPU, not with the world.  The switch's round is the rank's projection too "
            "(the messages it sends or receives, and the routed ones it may relay).\n")


def switch_section(args: argparse.Namespace, cluster, model, command: str, rows: list[str]) -> str:
    return (f"{SWITCH_HEADING}\n\nCommand: `{command.strip()}`\n\n"
            f"What every layout switch call costs a rank's training thread, for the same Plans ({args.model} on "
            f"{cluster.name}): a step's {model.num_layers} layers x 4 calls (to the linear layout and back, "
            f"forward and backward), each `layout_move` and the call (`_Move.__call__`, the communicator's "
            f"`start_round` up to the lane runner, which here moves nothing), the maps cached on the step's "
            f"context as in training.  Tensors on the meta device (hidden-size rows of the real shapes; their "
            f"copies are the device's work).  CPU ms, median / "
            f"largest over the ranks measured ({args.ranks or f'{args.sample} evenly spaced'}), on the shared "
            f"2-core box.\n\n"
            "| GPUs | plan | remap messages | the step's first layer (4 calls, builds the maps and rounds): CPU ms "
            "| each later call, collector paused: CPU ms | collector on: CPU ms "
            "| the step's calls, collector paused: CPU ms | collector on: CPU ms |\n"
            "|" + " --- |" * 8 + "\n" + "\n".join(rows) + "\n")


def write_section(path: Path, heading: str, section: str) -> None:
    """Replace (or append) the section under ``heading`` of ``path`` (up to the next
    ``## `` heading)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    head, _, rest = text.partition(heading)
    tail = rest[rest.index("\n## ") + 1:] if "\n## " in rest else ""
    parts = [head.rstrip("\n"), section.rstrip("\n"), tail.rstrip("\n")]
    path.write_text("\n\n".join(p for p in parts if p) + "\n", encoding="utf-8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(p)
    p.add_argument("--ranks", type=lambda s: [int(v) for v in s.split(",")], default=None,
                   help="ranks to measure (default: --sample ranks evenly spaced)")
    p.add_argument("--sample", type=int, default=64, help="ranks measured when --ranks is not given")
    p.add_argument("--whole-ranks", type=int, default=3,
                   help="ranks for which every rank's schedules are built (each costs the whole world)")
    p.add_argument("--switch-calls", action="store_true",
                   help="measure the layout switch calls of a step instead (their own section)")
    p.add_argument("--out", type=Path, default=None,
                   help="replace this section of that file (e.g. docs/results/planning_interference.md)")
    args = p.parse_args()
    if args.ranks and max(args.ranks) >= min(args.gpus) or min(args.ranks or [0]) < 0:
        p.error(f"--ranks must lie in 0..{min(args.gpus) - 1} (the smallest --gpus)")
    if args.sample < 1 or args.whole_ranks < 1:
        p.error("--sample and --whole-ranks must be >= 1")
    report = exit_on_user_error(lambda: run(args))
    print(report)
    if args.out is not None:
        write_section(args.out, SWITCH_HEADING if args.switch_calls else HOST_WORK_HEADING, report)


if __name__ == "__main__":
    main()
