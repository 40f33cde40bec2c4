"""Overlap measured from executed traces (``train --dump-trace DIR``).

For every (rank, step) whose rank holds both ring work and local work, whether
some of its local compute ran while one of its ring transfers was in flight --
read from the trace timestamps alone.  Also replays every trace with the cost
model next to ``sim --plan`` of the same step's Plan (``--plans DIR``).

    python -m megatron_zeppelin.train --nodes 2 --gpus-per-node 4 --nics-per-node 4 --strategy zeppelin \\
        --model tiny --lengths LENGTHS.npy --max-seq-len 4096 --tokens-per-gpu 2048 --steps 6 \\
        --dump-trace out/traces --dump-plans out/plans --quiet
    python benchmarks/trace_overlap.py out/traces --plans out/plans --cluster cpu-sim --model tiny

Last line: ``overlap: pairs=<n> overlapping=<m> fraction=<m/n> replay_max_rel_diff=<x>``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.schedule.trace import local_overlap, read_trace
from megatron_zeppelin.sim.modeled_trace import from_settings, replay_trace, with_recorded_topology
from megatron_zeppelin.sim.timeline import step_timeline
from megatron_zeppelin.topology import load_cluster


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", type=Path)
    p.add_argument("--plans", type=Path, default=None)
    p.add_argument("--cluster", default="cpu-sim")
    p.add_argument("--model", default="tiny")
    args = p.parse_args()
    pairs = overlapping = 0
    worst = 0.0
    for path in sorted(args.traces.glob("step*.json"), key=lambda q: int(q.stem[4:])):
        schedule, meta, times = read_trace(path)
        flags = local_overlap(schedule, times)
        pairs += len(flags)
        overlapping += sum(flags.values())
        line = (f"{path.name}: ranks with ring+local work {sorted(flags)}, overlapping "
                f"{sorted(r for r, f in flags.items() if f)}")
        if args.plans is not None:
            step = int(path.stem[4:])
            doc = json.loads((args.plans / f"plan_{step:06d}.json").read_text())
            base = CostModel(load_cluster(args.cluster), load_model(args.model))
            cost = with_recorded_topology(base, doc.get("engine"))
            replayed = replay_trace(schedule, meta, cost, str(path))
            attn, transport = from_settings(doc.get("engine"), cost)
            planned = step_timeline(Plan.from_dict(doc), cost, attn=attn, transport=transport).step_s
            worst = max(worst, abs(replayed - planned) / planned)
            line += f"; replay {replayed * 1e3:.3f} ms, sim --plan {planned * 1e3:.3f} ms"
        print(line)
    fraction = overlapping / pairs if pairs else float("nan")
    print(f"overlap: pairs={pairs} overlapping={overlapping} fraction={fraction:.3f} replay_max_rel_diff={worst:.2e}")


if __name__ == "__main__":
    main()
