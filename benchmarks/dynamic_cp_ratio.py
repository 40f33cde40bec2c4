"""Megatron-LM's dynamic CP against its ``dp_balanced`` packing, in our replay, on NVIDIA's benchmark.

NVIDIA reports 1.21-1.50x for ``--dynamic-context-parallel`` over
``--sequence-packing-scheduler dp_balanced`` (Megatron-LM dev,
``examples/dynamic_context_parallel/README.md``: 1-16 nodes of 4 GPUs, trimmed
means of 20 iterations).  This script replays that benchmark's shape with the
simulator's cost model: the example's default model (12 layers, hidden 2048,
FFN 8192, 16 heads, vocabulary 131072), TP 1, CP 4, PP 1, one sequence per
micro-batch sample, global batch ``8 x DP`` sequences drawn as its mock
dataset draws them (log-normal, mean 1024, sigma 1.5, clipped to 128-8192:
``generate_lognormal_samples`` in ``megatron/training/datasets/sft_dataset.py``),
``--max-seqlen-per-dp-cp-rank 2048``.  The cluster is ``--cluster`` cut into
nodes of 4 GPUs (NVIDIA's cluster is not named beyond "four GPUs per node").
Zeppelin plans the same batches at TP 1 under the same per-GPU cap, in the
fewest micro-batches of equal modeled work that each fit one pass (``M``; the
Megatron schedulers pick their own count).

    python benchmarks/dynamic_cp_ratio.py [--cluster h100-8x400g] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError, exit_on_user_error
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.planner.micro_batches import Split, micro_batch_split
from megatron_zeppelin.sampler import DEFAULT_BATCH_FILL
from megatron_zeppelin.sim.simulate import build_strategies, simulate
from megatron_zeppelin.topology import load_cluster

#: ``benchmark_dcp.sh`` defaults and its mock dataset's length distribution.
MODEL = ModelConfig(name="dcp-example-1b", num_layers=12, hidden_size=2048, num_attention_heads=16,
                    num_query_groups=16, ffn_hidden_size=8192, vocab_size=131072)
GPUS_PER_NODE, CP, MICRO_BATCHES, CAP = 4, 4, 8, 2048
MIN_LEN, MAX_LEN, MEAN_LEN, SIGMA = 128, 8192, 1024, 1.5
#: NVIDIA's trimmed-mean speedups of dynamic CP over dp_balanced, by node count (README table).
NVIDIA = {1: 1.285, 2: 1.412, 4: 1.212, 8: 1.375, 16: 1.495}
STRATEGIES = ("megatron_dp_balanced", "megatron_dynamic_cp", "zeppelin")


def batches(nodes: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` global batches of ``8 x DP`` sequences from the mock dataset's distribution."""
    rng = np.random.default_rng(seed)
    dp = nodes * GPUS_PER_NODE // CP
    mu = np.log(MEAN_LEN) - SIGMA ** 2 / 2
    return [np.clip(rng.lognormal(mu, SIGMA, MICRO_BATCHES * dp), MIN_LEN, MAX_LEN).astype(int).tolist()
            for _ in range(steps)]


def fewest_micro_batches(sampled: list[list[int]], cost: CostModel) -> tuple[int, Split]:
    """The fewest micro-batches (and their split) every batch of ``sampled`` fits in."""
    world = cost.cluster.topology.world_size
    count = max(1, -(-max(sum(b) for b in sampled) // (world * CAP)))
    while True:
        split = micro_batch_split(count, tokens_per_gpu=CAP, data_parallel_size=world, max_seq_len=MAX_LEN,
                                  batch_fill=DEFAULT_BATCH_FILL, cost=cost)
        try:
            for b in sampled:
                if any(sum(b[i] for i in g) > world * CAP for g in split(b)):
                    raise InfeasibleError("over the cap")
        except InfeasibleError:
            count += 1
            continue
        return count, split


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="h100-8x400g", help="cluster preset whose GPU, NVLink and NICs to use")
    ap.add_argument("--nodes", default="1,2,4,8,16", help="node counts (4 GPUs each)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print("| nodes | GPUs | dp_balanced ms | dynamic CP ms | zeppelin ms | dynamic CP / dp_balanced (NVIDIA) "
          "| zeppelin / dp_balanced | zeppelin / dynamic CP | zeppelin M | CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for nodes in (int(n) for n in args.nodes.split(",")):
        t0 = time.process_time()
        base = load_cluster(args.cluster, nodes=nodes)
        nics = max(1, base.topology.nics_per_node * GPUS_PER_NODE // base.topology.gpus_per_node)
        topo = dataclasses.replace(base.topology, gpus_per_node=GPUS_PER_NODE, nics_per_node=nics,
                                   nic_affinity=())
        cost = CostModel(dataclasses.replace(base, topology=topo), MODEL)
        strategies = build_strategies(list(STRATEGIES), cost, cp_size=CP)
        sampled = batches(nodes, args.steps, args.seed)
        count, split = fewest_micro_batches(sampled, cost)
        result = simulate(sampled, strategies, tokens_per_gpu=CAP, split=split)
        ms = {n: result.strategies[n].step_time_s for n in STRATEGIES}
        bad = [f"{n}: {r.error}" for n, r in result.strategies.items() if not r.feasible]
        if bad:
            raise SystemExit(f"dynamic_cp_ratio: {'; '.join(bad)}")
        dp, dyn, zep = (ms[n] for n in STRATEGIES)
        print(f"| {nodes} | {nodes * GPUS_PER_NODE} | {dp * 1e3:.1f} | {dyn * 1e3:.1f} | {zep * 1e3:.1f} "
              f"| {dp / dyn:.2f}x ({NVIDIA.get(nodes, float('nan')):.2f}x) | {dp / zep:.2f}x | {dyn / zep:.2f}x "
              f"| {count} | {time.process_time() - t0:.1f} |", flush=True)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
