"""CPU time of the replay on the four 64-GPU plans of ``docs/results/simulator-speed.md``.

The plans are those of ``tests/schedule/golden/schedule_digests.json`` (h100-8x400g,
llama-7b: Zeppelin with and without its decision, hybrid CP, and 78 CP=8 rings built
unpacked).  For each, the best CPU time of:

* ``loop``: ``replay_chain`` of one 4-layer chain (4 layers forward, then backward);
* ``replay_step``: compile the step's segments, then replay the 4- and 3-layer chains
  (the same schedules each time: what a schedule keeps once read, such as its
  columnar view, is not rebuilt);
* ``fresh``: ``replay_step`` of schedules just built, untimed (what a simulator
  run pays per replay: each schedule is replayed once);
* ``step_timeline``: build the schedules too (``reuse=False``; not for the unpacked rings,
  which ``step_timeline`` would pack).

It only uses what every tree since the compiled loop has, so an older tree can be timed by
putting it first on ``PYTHONPATH``:

    PYTHONPATH=$PWD python benchmarks/replay_speed.py
    git archive fe1c6b5 | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python benchmarks/replay_speed.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import megatron_zeppelin
from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.sim.replay import CompiledSegment, replay_chain, replay_step
from megatron_zeppelin.sim.timeline import PACKED_STRATEGIES, step_parts, step_timeline
from megatron_zeppelin.topology import load_cluster

PLANS = Path(__file__).resolve().parent.parent / "tests" / "schedule" / "golden" / "schedule_digests.json"
UNPACKED = "te_cp_cp8"          # uniform CP: one ring per sequence


def best_cpu_ms(run, repeat: int) -> tuple[float, object]:
    """The least CPU time of ``repeat`` calls of ``run``, in ms, and its last result."""
    times, result = [], None
    for _ in range(repeat):
        c0 = time.process_time()
        result = run()
        times.append((time.process_time() - c0) * 1e3)
    return min(times), result


def fresh_replay_ms(build, replay) -> float:
    """CPU time of ``replay(build())``, in ms, the build untimed."""
    parts = build()
    c0 = time.process_time()
    replay(parts)
    return (time.process_time() - c0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default="", help="comma-separated plan names (default: all four)")
    ap.add_argument("--repeat", type=int, default=7, help="runs of the loop; a third as many of the others")
    args = ap.parse_args()
    plans = json.loads(PLANS.read_text())["plans"]
    names = [n for n in args.plans.split(",") if n] or list(plans)
    if args.repeat < 1:
        print(f"replay_speed: --repeat {args.repeat}: give at least 1", file=sys.stderr)
        sys.exit(2)
    if unknown := [n for n in names if n not in plans]:
        print(f"replay_speed: no plan {', '.join(unknown)}; --plans takes {','.join(plans)}", file=sys.stderr)
        sys.exit(2)
    print(f"tree: {Path(megatron_zeppelin.__file__).parent.parent}")
    print("| plan | ops in the chain | loop | replay_step | fresh | step_timeline | step (s) |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        case = plans[name]
        cost = CostModel(load_cluster(case["cluster"], nodes=case["nodes"]), load_model(case["model"]),
                         routing=case["routing"])
        plan = Plan.from_dict(case["plan"])
        world = plan.world_size
        parts_packed = plan.strategy in PACKED_STRATEGIES and name != UNPACKED
        parts = step_parts(plan, cost, pack=parts_packed)
        fwd = [CompiledSegment(f, cost, n) for n, f, _ in parts]
        bwd = [CompiledSegment(b, cost, n) for n, _, b in parts]
        chain = fwd * 4 + list(reversed(bwd)) * 4
        replay_chain(chain, world)                               # compiles the loop on a cold cache
        replay_step(parts, cost.model.num_layers, cost, world)   # and what a step replay adds to it
        loop, _ = best_cpu_ms(lambda: replay_chain(chain, world), args.repeat)
        few = max(args.repeat // 3, 1)
        step_ms, step = best_cpu_ms(lambda: replay_step(parts, cost.model.num_layers, cost, world), few)
        fresh_ms = min(fresh_replay_ms(lambda: step_parts(plan, cost, pack=parts_packed),
                                       lambda new: replay_step(new, cost.model.num_layers, cost, world))
                       for _ in range(few))
        timeline = ("-" if name == UNPACKED else
                    f"{best_cpu_ms(lambda: step_timeline(plan, cost, reuse=False), few)[0]:.1f}")
        print(f"| {name} | {sum(seg.n for seg in chain):,} | {loop:.2f} | {step_ms:.2f} | {fresh_ms:.2f} | {timeline} | "
              f"{step.step_s!r} |", flush=True)


if __name__ == "__main__":
    main()
