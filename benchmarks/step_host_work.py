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

For the Plan of ``benchmarks/planning_interference.py`` (Zeppelin with its
decision, routed crossings and remap, as ``pretrain_gpt.py --zeppelin``
plans), CPU milliseconds with the cyclic collector paused, and the objects the
collector tracks while the result is held; over every rank (a rank's work
depends on what reaches it), the median and the largest.

    python benchmarks/step_host_work.py --gpus 64,1024

``--out`` replaces this section in ``docs/results/planning_interference.md``
(``planning_interference.py`` keeps it when it rewrites the file).
"""

from __future__ import annotations

import argparse
import gc
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

from megatron_zeppelin.comm.rounds import _round_schedule  # noqa: E402
from megatron_zeppelin.errors import exit_on_user_error  # noqa: E402
from megatron_zeppelin.plan.compact import CompactPlan  # noqa: E402
from megatron_zeppelin.model_config import load_model  # noqa: E402
from megatron_zeppelin.remap.exchange import build_exchange  # noqa: E402
from megatron_zeppelin.schedule.attention import attention_schedule  # noqa: E402
from megatron_zeppelin.sim.timeline import step_shape, transport_of  # noqa: E402
from megatron_zeppelin.topology import load_cluster  # noqa: E402


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


def write_section(path: Path, section: str) -> None:
    """Replace (or append) this benchmark's section of ``path``."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    head = text.split(HOST_WORK_HEADING)[0].rstrip("\n")
    path.write_text((head + "\n\n" if head else "") + section, encoding="utf-8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(p)
    p.add_argument("--ranks", type=lambda s: [int(v) for v in s.split(",")], default=None,
                   help="ranks to measure (default: --sample ranks evenly spaced)")
    p.add_argument("--sample", type=int, default=64, help="ranks measured when --ranks is not given")
    p.add_argument("--whole-ranks", type=int, default=3,
                   help="ranks for which every rank's schedules are built (each costs the whole world)")
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
        write_section(args.out, report)


if __name__ == "__main__":
    main()
