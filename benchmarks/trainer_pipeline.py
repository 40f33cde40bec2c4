"""Trainer ``--pp``: zeppelin against the reference through the same pipeline, per layout.

    python benchmarks/trainer_pipeline.py [--steps 5]

Each layout trains ``--strategy zeppelin`` (remap and routing on) and
``--strategy reference`` on gloo ranks with the tiny model on the bundled
long-tailed sample; one rank per (pipeline stage x TP rank) saves every step's
summed gradients.  Prints one markdown row per layout: the losses, the largest
relative loss difference and the largest ``|g_z - g_r| / |g_r|`` over every
parameter, step and saving rank (docs/results/pipeline.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from megatron_zeppelin.train import trainer
from megatron_zeppelin.train.cli import parse_args
from megatron_zeppelin.train.launch import launch

#: name -> (nodes, GPUs per node, ranks that save gradients, flags, tokens per GPU).
LAYOUTS = {
    "PP 2 x DP 2 (4 x 1 nodes, 2 micro-batches)": (4, 1, (0, 2), ("--pp", "2", "--micro-batches", "2"), 256),
    "PP 2 x DP 2, 4 micro-batches, remap (2 x 2)": (2, 2, (0, 2), ("--pp", "2", "--micro-batches", "4"), 320),
    "PP 2 x TP 2 x DP 2 + SP (4 x 2, 2 micro-batches)": (4, 2, (0, 1, 4, 5), ("--pp", "2", "--micro-batches", "2",
                                                                             "--tp", "2", "--sequence-parallel"), 384),
}


def train(strategy: str, nodes: int, gpus: int, ranks: tuple[int, ...], flags: tuple[str, ...], tokens_per_gpu: int,
          steps: int, out: Path) -> list[dict]:
    """One run; ``ranks`` write ``out/grads/<step>.<rank>.pt`` (the forked ranks inherit the wrapper)."""
    real = trainer.allreduce_grads
    done = [0]

    def saving(model, *args):
        norm = real(model, *args)
        rank = torch.distributed.get_rank()
        if rank in ranks:
            torch.save({n: p.grad.clone() for n, p in model.named_parameters()}, out / "grads" / f"{done[0]}.{rank}.pt")
        done[0] += 1
        return norm

    (out / "grads").mkdir(parents=True)
    trainer.allreduce_grads = saving
    try:
        launch(parse_args(["--nodes", str(nodes), "--gpus-per-node", str(gpus), "--strategy", strategy,
                           "--model", "tiny", "--lengths", "tiny-longtail", "--max-seq-len", "512",
                           "--tokens-per-gpu", str(tokens_per_gpu), "--steps", str(steps), "--seed", "1", "--quiet",
                           "--json-log", str(out / "log.jsonl"), *flags]))
    finally:
        trainer.allreduce_grads = real
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    print("| layout | steps | zeppelin losses | max loss rel. diff | max gradient rel. diff (parameters x steps x ranks) | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (nodes, gpus, ranks, flags, tokens) in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            zep = train("zeppelin", nodes, gpus, ranks, flags, tokens, args.steps, Path(tmp) / "z")
            ref = train("reference", nodes, gpus, ranks, flags, tokens, args.steps, Path(tmp) / "r")
            seconds = time.perf_counter() - t0
            loss = max(abs(z["loss"] - r["loss"]) / abs(r["loss"]) for z, r in zip(zep, ref))
            worst, pairs = 0.0, 0
            for f in sorted((Path(tmp) / "z" / "grads").glob("*.pt")):
                a, b = torch.load(f), torch.load(Path(tmp) / "r" / "grads" / f.name)
                for k in a:
                    worst, pairs = max(worst, float((a[k] - b[k]).norm() / b[k].norm())), pairs + 1
        losses = ", ".join(f"{z['loss']:.6f}" for z in zep)
        print(f"| {name} | {len(zep)} | {losses} | {loss:.1e} | {worst:.1e} ({pairs}) | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
