"""Bytes one attention layer keeps for its backward, per rank, against plain varlen attention.

    python benchmarks/attention_memory.py [--heads 32,8,128] [--scale 256]

For each plan kind of ``stream_checks.cases`` (local, rings of 2 and 4, Ulysses,
two nodes routed), every rank runs the engine's forward on CPU tensors (threads
over the loopback transport) and we count the distinct storages its backward
holds: q, k, v, out, and what the forward saved (LSEs, Ulysses' gathered
heads).  Plain varlen attention on the same tokens (FlashAttention's contract)
keeps q, k, v, out and one fp32 LSE per query head and row.  The table prints
both and their ratio (target <= 1.3x).  Counts are exact byte counts of
tensors, so a CPU measures what a GPU would hold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loopback import Delays  # noqa: E402
from megatron_zeppelin.attention.engine import attention_passes  # noqa: E402
from megatron_zeppelin.comm.streams import HostStreams  # noqa: E402
import stream_checks  # noqa: E402


def _storages(obj) -> dict[int, int]:
    """Distinct storages (data pointer -> bytes) of the tensors inside ``obj``."""
    found = {}
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            found[s.data_ptr()] = s.nbytes()
    return found


def measure(case: stream_checks.Case, heads: tuple[int, int, int], dtype: torch.dtype) -> list[tuple]:
    h = stream_checks.Harness(case, torch.device("cpu"), dtype, HostStreams(), Delays(), heads)
    hq = heads[0]
    rows = []

    def rank(r: int):
        q, k, v, _ = (x.clone() for x in h.inputs[r])
        out, backward = attention_passes(q, k, v, plan=case.plan, rank=r, comm=h.comms[r],
                                         backend=h.backend, cache=h.caches[r])
        # What the backward closure holds: q, k, v, out and the forward's saved state.
        held = _storages([c.cell_contents for c in backward.__closure__])
        plain = sum(_storages((q, k, v, out)).values()) + hq * q.shape[0] * 4
        return q.shape[0], sum(held.values()), plain

    for r, (tokens, held, plain) in enumerate(stream_checks.run_ranks(h.hub, rank)):
        rows.append((case.name, r, tokens, held, plain))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    ap.add_argument("--scale", type=int, default=64, help="base sequence length of the plans")
    args = ap.parse_args(argv)
    heads = tuple(int(x) for x in args.heads.split(","))
    print(f"`python benchmarks/attention_memory.py --heads {args.heads} --scale {args.scale}` (bf16)\n")
    print("| plan | rank | tokens | kept for backward MiB | plain varlen MiB | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for case in stream_checks.cases(args.scale)[:5]:
        for name, r, tokens, held, plain in measure(case, heads, torch.bfloat16):
            worst = max(worst, held / plain)
            print(f"| {name} | {r} | {tokens} | {held / 2**20:.2f} | {plain / 2**20:.2f} | {held / plain:.2f}x |")
    print(f"\nworst ratio {worst:.2f}x (target <= 1.3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
