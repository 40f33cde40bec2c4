"""``python -m megatron_zeppelin.data.lengths``: what a dataset's document lengths look like.

    python -m megatron_zeppelin.data.lengths data/arxiv_text_document --plot lengths.png
    python -m megatron_zeppelin.data.lengths lengths.npy --cluster h100-8x400g --nodes 4 \\
        --model llama-7b --max-seq-len 131072 --tokens-per-gpu 16384

Prints the document count, total tokens and percentiles -- by document and by
token, because attention cost follows the tokens in long documents, not the
number of documents -- and a histogram with power-of-two bins.  With
``--cluster`` it also runs the simulator on these lengths: modeled step time of
static context parallelism (te_cp) against Zeppelin, and how many sequences
Zeppelin keeps local, rings inside a node, or rings across nodes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from megatron_zeppelin.data.indexed import document_lengths, is_indexed_prefix
from megatron_zeppelin.errors import ConfigError, exit_on_user_error
from megatron_zeppelin.sampler.lengths import load_lengths
from megatron_zeppelin.validation import OneLineParser, check_not_an_input, check_output_file

PERCENTILES = (50, 90, 99, 99.9)


def read_lengths(source: str) -> np.ndarray:
    """Lengths from a Megatron dataset prefix (``PREFIX.idx`` exists) or a lengths file."""
    if is_indexed_prefix(source):
        lengths = document_lengths(source)
        if not lengths.any():
            raise ConfigError(f"dataset prefix {source}: every document is empty")
        return lengths
    if not Path(source).exists() and Path(source + ".bin").exists():
        raise ConfigError(f"dataset prefix {source}: missing {source}.idx; rebuild it with python -m "
                          f"megatron_zeppelin.data.prepare --input FILE.jsonl --output-prefix {source}")
    return load_lengths(source)


def token_percentile(lengths: np.ndarray, q: float) -> int:
    """Length L such that ``q`` % of all tokens sit in documents of length <= L."""
    ordered = np.sort(lengths)
    cum = np.cumsum(ordered)
    return int(ordered[np.searchsorted(cum, cum[-1] * q / 100.0)])


def log2_histogram(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Power-of-two bins ``[2^k, 2^(k+1))``: (left edges, documents, tokens) per bin."""
    positive = lengths[lengths > 0]
    top = int(np.floor(np.log2(positive.max()))) + 1
    edges = 2 ** np.arange(top + 1, dtype=np.int64)
    which = np.searchsorted(edges, positive, side="right") - 1
    docs = np.bincount(which, minlength=top)
    tokens = np.bincount(which, weights=positive, minlength=top)
    return edges[:-1], docs, tokens


def summary(lengths: np.ndarray) -> str:
    """The text report: totals, percentiles, histogram."""
    total = int(lengths.sum())
    lines = [f"{lengths.size:,} documents, {total:,} tokens; mean {lengths.mean():,.0f}, "
             f"min {lengths.min():,}, max {lengths.max():,}"]
    by_doc = ", ".join(f"p{q:g} {int(np.percentile(lengths, q)):,}" for q in PERCENTILES)
    by_tok = ", ".join(f"p{q:g} {token_percentile(lengths, q):,}" for q in PERCENTILES)
    lines += [f"document length by document: {by_doc}",
              f"document length by token:    {by_tok}",
              "", f"{'length':>21}  {'docs':>9}  {'tokens':>6}"]
    left, docs, tokens = log2_histogram(lengths)
    peak = docs.max()
    for lo, n, t in zip(left, docs, tokens):
        if n:
            bar = "#" * max(1, round(40 * n / peak))
            lines.append(f"[{lo:>9,}, {2 * lo:>9,})  {n:>9,}  {100 * t / total:>5.1f}%  {bar}")
    return "\n".join(lines)


def plot(lengths: np.ndarray, out: Path, title: str) -> None:
    """Histogram (documents per bin, bars) with each bin's share of tokens (line)."""
    from megatron_zeppelin.sim.plot import pyplot, save_figure  # matplotlib only when plotting

    plt = pyplot()

    left, docs, tokens = log2_histogram(lengths)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(left, docs, width=left, align="edge", color="#4c72b0", edgecolor="white", label="documents")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("document length (tokens, power-of-two bins)")
    ax.set_ylabel("documents")
    share = ax.twinx()
    share.plot(left * np.sqrt(2), 100 * tokens / tokens.sum(), color="#dd8452", marker="o", label="tokens")
    share.set_ylabel("share of tokens (%)")
    share.set_ylim(bottom=0)
    ax.set_title(title)
    fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.88))
    fig.tight_layout()
    save_figure(fig, out)


def what_if(lengths: np.ndarray, args: argparse.Namespace) -> str:
    """Run the simulator on these lengths (te_cp vs zeppelin); its table plus Zeppelin's tiers."""
    from megatron_zeppelin.sim.cli import run as run_sim  # the planners load only when asked for

    with tempfile.TemporaryDirectory() as tmp:
        # The simulator reads a lengths file: hand it the user's, or one made from the dataset's index.
        # Named after the index it came from: the simulator prints this file's name.
        path = Path(tmp) / f"{Path(args.source).name}.idx-lengths.npy"
        if is_indexed_prefix(args.source):
            np.save(path, lengths)
        else:
            path = Path(args.source)
        argv = ["--lengths", str(path), "--cluster", args.cluster, "--model", args.model,
                "--strategies", "te_cp,zeppelin", "--steps", str(args.steps), "--seed", str(args.seed),
                "--no-progress"]
        for flag in ("nodes", "max_seq_len", "tokens_per_gpu"):
            if getattr(args, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        result = run_sim(argv)  # prints its summary and table
    tiers = result.strategies["zeppelin"].tiers
    if not tiers:
        return "zeppelin: no feasible step"
    mean = {k: np.mean([getattr(t, k) for t in tiers]) for k in ("local", "intra", "inter")}
    return (f"zeppelin per step (mean of {len(tiers)}): {mean['local']:.1f} sequences local, "
            f"{mean['intra']:.1f} intra-node rings, {mean['inter']:.1f} inter-node rings")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m megatron_zeppelin.data.lengths", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="Megatron dataset prefix (PREFIX.idx/.bin) or a lengths file (.npy/text)")
    p.add_argument("--plot", type=Path, default=None, help="write the histogram here (.png)")
    what = p.add_argument_group("what-if (runs the simulator when --cluster is given)")
    what.add_argument("--cluster", default=None, help="cluster preset name or YAML file")
    what.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the simulator's)")
    what.add_argument("--model", default="llama-7b", help="model preset name or YAML file")
    what.add_argument("--max-seq-len", type=int, default=None, help="longer documents are cut into pieces")
    what.add_argument("--tokens-per-gpu", type=int, default=None, help="per-GPU token cap")
    what.add_argument("--steps", type=int, default=4, help="global batches to simulate")
    what.add_argument("--seed", type=int, default=0, help="sampler seed")
    return p


def run(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.plot is not None:   # before any reading: writable, a format matplotlib writes, not the source
        from megatron_zeppelin.sim.plot import check_plot_path
        sources = [Path(args.source), Path(f"{args.source}.idx"), Path(f"{args.source}.bin")]
        check_not_an_input(args.plot, "--plot", {f"the source {p.name}": p for p in sources if p.exists()})
        check_plot_path(args.plot)
        check_output_file(args.plot, "--plot")
    lengths = read_lengths(args.source)
    print(summary(lengths))
    if args.plot is not None:
        plot(lengths, args.plot, title=f"{Path(args.source).name}: {lengths.size:,} documents")
        print(f"histogram written to {args.plot}")
    if args.cluster is not None:
        print()
        print(what_if(lengths, args))


def main(argv: Sequence[str] | None = None) -> None:
    exit_on_user_error(lambda: run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
