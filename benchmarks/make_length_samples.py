"""Write the bundled synthetic document-length samples (``configs/lengths/*.npy``).

They let ``python -m megatron_zeppelin.sim`` and the benchmarks run on a fresh
checkout.  Shapes follow what long-context corpora look like: a log-normal body
of short documents and, for the long-tailed ones, a Pareto tail of very long
documents (whole repositories, books), far past any context window.  The seed
is fixed, so rerunning this script reproduces the committed files bit for bit.

    python benchmarks/make_length_samples.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "configs" / "lengths"
MAX_DOC = 2 * 1024 * 1024
"""Longest document kept, tokens (everything longer is clipped)."""


def lognormal(rng: np.random.Generator, n: int, median: float, sigma: float) -> np.ndarray:
    return rng.lognormal(np.log(median), sigma, n)


def pareto(rng: np.random.Generator, n: int, start: float, alpha: float) -> np.ndarray:
    """Pareto tail: P(X > x) = (start / x) ** alpha for x >= start."""
    return start * (1 + rng.pareto(alpha, n))


def samples(seed: int) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (lengths, description)."""
    rng = np.random.default_rng(seed)
    web = lognormal(rng, 4000, 900, 1.1)
    longtail = np.concatenate([lognormal(rng, 3400, 2500, 1.2), pareto(rng, 600, 16384, 1.1)])
    books = np.concatenate([lognormal(rng, 900, 60000, 0.9), pareto(rng, 100, 200000, 1.2)])
    out = {}
    for name, values, what in (
            ("synthetic-web", web, "web-like: log-normal, median ~900 tokens, few long pages"),
            ("synthetic-longtail", longtail,
             "code/papers-like: log-normal body (median ~2.5K) + 15% Pareto tail from 16K"),
            ("synthetic-books", books, "book-like: log-normal median ~60K + Pareto tail from 200K")):
        lens = np.clip(np.rint(values), 16, MAX_DOC).astype(np.int64)
        out[name] = (rng.permutation(lens), what)
    # CPU scale for the trainer demo: with --max-seq-len 1024 --tokens-per-gpu 384
    # a step holds local sequences, intra-node rings and inter-node rings at once.
    tiny = np.concatenate([lognormal(rng, 900, 60, 1.0), pareto(rng, 100, 400, 1.0)])
    lens = np.clip(np.rint(tiny), 16, MAX_DOC).astype(np.int64)
    out["tiny-longtail"] = (rng.permutation(lens), "CPU demo scale: log-normal median ~60 + 10% Pareto tail from 400")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20260101)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (lens, what) in samples(args.seed).items():
        np.save(args.out / f"{name}.npy", lens)
        p50, p90, p99 = np.percentile(lens, [50, 90, 99]).astype(int)
        print(f"{name}.npy: {len(lens)} docs, p50 {p50}, p90 {p90}, p99 {p99}, max {lens.max()}, "
              f"{lens.sum() / 1e6:.1f}M tokens -- {what}")


if __name__ == "__main__":
    main()
