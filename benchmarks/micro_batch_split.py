"""Splitting a global batch into micro-batches: modeled step time of three splits.

Every split plans each micro-batch with the zeppelin planner and sums the
micro-batches' modeled step times (``sim.timeline.step_timeline``) over the same
global batches:

* ``zeppelin``: ``planner/micro_batches.py`` (equal modeled work per micro-batch);
* ``blaster``: FlexSP's sequence blaster as an anchor: sorted by length, cut into
  contiguous runs with the smallest largest run (similar lengths together);
* ``sampler``: the sampler's order, cut the same way.

    python benchmarks/micro_batch_split.py            # 3 length files, 8 steps
    python benchmarks/micro_batch_split.py --quick    # 1 file, 2 steps

Prints a markdown table (no timing of this machine: modeled seconds only).
"""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.planner.base import PlanContext, get_planner
from megatron_zeppelin.planner.micro_batches import micro_batch_split
from megatron_zeppelin.sampler import ZeppelinBatchSampler, batch_budget, load_lengths
from megatron_zeppelin.sim.timeline import step_timeline
from megatron_zeppelin.topology import load_cluster

NODES, MODEL, CLUSTER = 2, "llama-7b", "h100-8x400g"
MAX_SEQ_LEN, TOKENS_PER_GPU, MICRO_BATCHES, FILL = 131072, 32768, 4, 0.95


def contiguous_cuts(order: Sequence[int], lens: Sequence[int], count: int) -> list[list[int]]:
    """``order`` cut into ``count`` contiguous runs whose largest token count is the
    smallest possible (binary search on it, greedy runs): the blaster's cut rule."""
    sizes = [lens[i] for i in order]

    def runs(limit: int) -> list[list[int]]:
        out, tokens = [[]], 0
        for i, n in zip(order, sizes):
            if tokens + n > limit and out[-1]:
                out.append([])
                tokens = 0
            out[-1].append(i)
            tokens += n
        return out

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(runs(mid)) <= count else (mid + 1, hi)
    parts = runs(lo)
    while len(parts) < count:  # fewer runs than micro-batches: split the longest run
        k = max(range(len(parts)), key=lambda j: len(parts[j]))
        parts[k:k + 1] = [parts[k][:len(parts[k]) // 2], parts[k][len(parts[k]) // 2:]]
    return [sorted(part) for part in parts]


def modeled_step_s(lens: Sequence[int], parts: list[list[int]], plan: Callable, cost: CostModel) -> float:
    return sum(step_timeline(plan([lens[i] for i in part]), cost).step_s for part in parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    files = ["synthetic-longtail"] if args.quick else ["synthetic-longtail", "synthetic-books", "synthetic-web"]
    steps = 2 if args.quick else 8
    cluster = load_cluster(CLUSTER, nodes=NODES)
    world = cluster.topology.world_size
    cost = CostModel(cluster, load_model(MODEL))
    planner = get_planner("zeppelin")
    ctx = PlanContext(cost=cost, tokens_per_gpu=TOKENS_PER_GPU)
    plan = lambda seq_lens: planner.plan(list(seq_lens), ctx)  # noqa: E731
    ours = micro_batch_split(MICRO_BATCHES, tokens_per_gpu=TOKENS_PER_GPU, data_parallel_size=world,
                             max_seq_len=MAX_SEQ_LEN, batch_fill=FILL, cost=cost)
    splits = {
        "zeppelin": ours,
        "blaster": lambda lens: contiguous_cuts(sorted(range(len(lens)), key=lambda i: lens[i]), lens,
                                                MICRO_BATCHES),
        "sampler": lambda lens: contiguous_cuts(list(range(len(lens))), lens, MICRO_BATCHES),
    }
    print(f"{MODEL} on {world} x {cluster.gpu.name}, {MICRO_BATCHES} micro-batches of <= "
          f"{TOKENS_PER_GPU} tokens/GPU, max_seq_len {MAX_SEQ_LEN}, {steps} global batches per file; "
          "sum of the micro-batches' modeled step times\n")
    print("| lengths | split | modeled s (batches every split planned) | vs zeppelin | batches with an unplannable micro-batch |")
    print("|---|---|---|---|---|")
    for name in files:
        sampler = ZeppelinBatchSampler(load_lengths(f"configs/lengths/{name}.npy"), max_seq_len=MAX_SEQ_LEN,
                                       tokens_per_batch=batch_budget(MICRO_BATCHES * TOKENS_PER_GPU, world,
                                                                     MAX_SEQ_LEN, FILL),
                                       seed=0, num_batches=steps)
        batches = [b.seq_lens for b in sampler]
        # seconds[split][batch]: None where a micro-batch could not be planned.
        seconds = {split_name: [] for split_name in splits}
        for lens in batches:
            for split_name, split in splits.items():
                try:
                    seconds[split_name].append(modeled_step_s(lens, split(lens), plan, cost))
                except InfeasibleError:
                    seconds[split_name].append(None)
        common = [i for i in range(len(batches)) if all(v[i] is not None for v in seconds.values())]
        base = sum(seconds["zeppelin"][i] for i in common) or float("nan")
        for split_name, values in seconds.items():
            total = sum(values[i] for i in common)
            failed = sum(v is None for v in values)
            print(f"| {name} | {split_name} | {total:.2f} | {total / base:.3f}x | {failed} of {len(batches)} |")

if __name__ == "__main__":
    main()
