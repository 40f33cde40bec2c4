"""Ablation of Zeppelin's layers, rung by rung, on the modeled step time.

In the spirit of the Zeppelin paper's ablation, each rung adds one layer on top
of the previous one, and every rung plans the same global batches:

* ``te_cp``: static context parallelism (the baseline);
* ``zeppelin_base``: Zeppelin's hierarchical partitioning and attention engine,
  no routing layer, no remapping (linear layout = attention layout);
* ``+routing`` (``zeppelin_noremap``): inter-node transfers spread over all NICs of a node;
* ``+remap`` (``zeppelin``): token-balanced layout for the linear modules.

    python benchmarks/ablation.py            # 3 models x 2 clusters x every length file
    python benchmarks/ablation.py --quick    # the middle model x 2 clusters x 2 length files, 1 step

Length distributions: ``../shared/data/lengths/*.npy`` when that folder exists,
plus the bundled synthetic ones (``configs/lengths/``).  Prints a markdown
report and writes it to docs/results/ablation.md.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.model import REMAP_SWITCHES_PER_LAYER
from megatron_zeppelin.errors import ConfigError, exit_on_user_error
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Mode, Plan
from megatron_zeppelin.presets import CONFIG_ROOT
from megatron_zeppelin.sampler import batch_budget
from megatron_zeppelin.sampler.lengths import load_lengths
from megatron_zeppelin.sim.simulate import BASELINE, build_strategies, sample_batches, simulate, te_cp_size
from megatron_zeppelin.sim.timeline import remap_time, step_timeline
from megatron_zeppelin.topology import load_cluster

REPO = Path(__file__).resolve().parent.parent
SHARED_LENGTHS = REPO.parent / "shared" / "data" / "lengths"
#: The ladder: each strategy adds one layer to the one before it.
RUNGS: tuple[str, ...] = (BASELINE, "zeppelin_base", "zeppelin_noremap", "zeppelin")
#: Column heading of each rung.
LABELS = {BASELINE: BASELINE, "zeppelin_base": "zeppelin_base", "zeppelin_noremap": "+routing",
          "zeppelin": "+remap"}
K = 1024
#: What the report's columns mean (printed under the command).
COLUMNS = (f"Step times come from the replay of each plan's schedule with cost-model durations (docs/simulator.md): "
           f"they rank variants, they do not predict a cluster to the percent.  The {BASELINE} rung is CP-only "
           f"(TP=1) at the smallest CP that holds the maximum length, and every rung runs at TP=1, so the rungs "
           f"isolate Zeppelin's layers (docs/results/speedup_matrix.md has {BASELINE} with its TP x CP searched).  "
           f"Speedups are vs {BASELINE}; each rung adds one layer to the one on "
           f"its left.  *Linear imbalance*: max/mean linear-layout tokens per rank.  *Slowest rank's linear load / "
           f"saving*: without remap, the linear tokens of the rank that decides the step / the mean, and the "
           f"linear time balancing would take off that rank (the most remap can gain, before its own cost).  "
           f"The remap and byte columns describe the top rung (+remap) per step: the layout switches' modeled "
           f"time and bytes (4 switches per layer), the attention communication (ring K/V and Ulysses "
           f"all-to-all bytes, forward + backward), remap bytes as a share of it, and the share of remap bytes "
           f"that cross nodes.")
#: Why a rung can lose (the mechanisms, true whatever the numbers).
READING = """## Reading the table

* **zeppelin_base** vs te_cp: hierarchical partitioning keeps short sequences local and gives each long
  sequence a group (ring or Ulysses) sized to its length, instead of one static CP group whose packed ring
  carries every sequence.
* **+routing** speeds up inter-node transfers (a node's traffic spreads over all its NICs); cells whose
  groups stay inside nodes gain nothing.  The planner re-plans with the cheaper links, and its greedy
  packing is a heuristic, so a cell can come out a hair slower.
* **+remap** enables the remapping layer: the linear modules may run on a token-balanced layout.  The
  step is decided by the slowest rank, so balancing gains at most the linear time it takes off that rank
  (the *saving* column, on +routing's plans; nothing when that rank holds no more than the mean), and it
  costs the remap's all-to-all-v, which every rank waits for.  When the saving is below the remap time,
  +remap loses.  Tokens a node must shed cross the NICs (the *across nodes* column), so the remap costs
  most where NICs are few (a800-4x200g: 4 NICs for 8 GPUs).  The planner also places attention
  differently when it may remap, so a cell's gain is not the saving alone.  Remap's other benefit, no
  rank holding more than the mean of the linear activations (memory), is outside a step-time model."""


# ------------------------------------------------------------------- bytes
def ring_bytes(plan: Plan, cost: CostModel) -> float:
    """Bytes all ring attention of one step moves (``CostModel.ring_bytes``)."""
    return sum(cost.ring_bytes(plan.seq_lens[p.seq], p.size) for p in plan.attention if p.mode is Mode.RING)


def ulysses_bytes(plan: Plan, cost: CostModel) -> float:
    """Bytes all Ulysses groups of one step move (``CostModel.ulysses_bytes``)."""
    return sum(cost.ulysses_bytes(plan.seq_lens[p.seq], p.size)
               for p in plan.attention if p.mode is Mode.ULYSSES)


def remap_bytes(plan: Plan, cost: CostModel) -> tuple[float, float]:
    """(all, inter-node) bytes the layout switches of one step move: the remap
    schedule's tokens, ``hidden_bytes_per_token`` each, four switches per layer."""
    topo = cost.cluster.topology
    schedule = plan.remap_schedule()
    total = sum(t.length for t in schedule)
    inter = sum(t.length for t in schedule if not topo.same_node(t.src, t.dst))
    scale = cost.model.hidden_bytes_per_token * REMAP_SWITCHES_PER_LAYER * cost.model.num_layers
    return total * scale, inter * scale


# -------------------------------------------------------------------- cell
@dataclass
class AblationCell:
    """One (model, cluster, lengths) cell of the ablation; byte and remap figures
    are means per step of the top rung (``zeppelin``)."""

    seqs: float
    """Mean sequences per global batch."""
    cp_size: int
    """te_cp's static CP size."""
    step_ms: dict[str, float | None]
    """Mean modeled step time of each rung (None: infeasible)."""
    speedup: dict[str, float | None]
    """te_cp's step time / each rung's (None: either infeasible)."""
    linear_imbalance: dict[str, float | None]
    """Mean max/mean linear tokens per rank of each rung."""
    critical_linear: float | None
    """Without remap (``zeppelin_noremap``): the slowest rank's linear tokens / the
    mean, averaged over steps.  Remap can only shorten the step by moving tokens
    off that rank, so at <= 1 it cannot win there."""
    critical_saving_ms: float | None
    """Without remap: linear time balancing would take off the slowest rank (its
    linear time minus the mean's, mean over steps; negative: it would add)."""
    remap_ms: float = 0.0
    """Modeled remap time per step (every rank pays it)."""
    remap_gb: float = 0.0
    """Remap bytes per step, GB (all layers, 4 switches each)."""
    remap_inter_gb: float = 0.0
    """The part of ``remap_gb`` that crosses nodes."""
    ring_gb: float = 0.0
    """Ring K/V bytes per step, GB (forward + backward)."""
    ulysses_gb: float = 0.0
    """Ulysses all-to-all bytes per step, GB (forward + backward)."""
    errors: list[str] = field(default_factory=list)
    """Why a rung could not place a batch."""

    @property
    def remap_share(self) -> float | None:
        """Remap bytes / attention communication bytes (None: no attention traffic)."""
        attn = self.ring_gb + self.ulysses_gb
        return self.remap_gb / attn if attn else None

    @property
    def remap_inter_share(self) -> float | None:
        """Fraction of the remap bytes that cross nodes (None: no remap)."""
        return self.remap_inter_gb / self.remap_gb if self.remap_gb else None


def ablation_cell(cost: CostModel, doc_lengths: np.ndarray, *, max_seq_len: int, tokens_per_gpu: int,
                  steps: int, seed: int = 0, rungs: Sequence[str] = RUNGS) -> AblationCell:
    """Simulate every rung on the same ``steps`` batches of ``doc_lengths``."""
    world = cost.cluster.topology.world_size
    cp = te_cp_size(max_seq_len, tokens_per_gpu)
    if world % cp:
        raise ConfigError(f"{BASELINE} needs CP={cp} for {max_seq_len} tokens at {tokens_per_gpu} tokens/GPU, "
                          f"which does not divide {world} GPUs; change --nodes or --tokens-per-gpu")
    batches = sample_batches(doc_lengths, max_seq_len=max_seq_len, steps=steps, seed=seed,
                             tokens_per_batch=batch_budget(tokens_per_gpu, world, max_seq_len))
    routed = cost.routed(True)
    critical: list[tuple[float, float]] = []
    top: list[tuple[float, float, float, float, float]] = []   # remap s, remap, inter, ring, ulysses bytes

    def measure(step: int, name: str, plan: Plan) -> None:
        if name == "zeppelin_noremap":
            tokens = plan.linear_tokens_per_rank()
            mine, mean = tokens[step_timeline(plan, routed).slowest_rank], sum(tokens) / len(tokens)
            critical.append((mine / mean, cost.linear_s(mine) - cost.linear_s(mean)))
        elif name == "zeppelin":
            top.append((remap_time(routed, plan), *remap_bytes(plan, cost), ring_bytes(plan, cost),
                        ulysses_bytes(plan, cost)))

    result = simulate(batches, build_strategies(list(rungs), cost, cp_size=cp), tokens_per_gpu=tokens_per_gpu,
                      on_plan=measure)
    rs = result.strategies
    cell = AblationCell(
        seqs=sum(map(len, result.seq_lens)) / len(result.seq_lens), cp_size=cp,
        step_ms={n: r.step_time_s * 1e3 if r.step_time_s else None for n, r in rs.items()},
        speedup={n: result.speedup(n) for n in rs},
        linear_imbalance={n: float(np.mean(r.linear_imbalance)) if r.feasible else None for n, r in rs.items()},
        critical_linear=float(np.mean([c[0] for c in critical])) if critical else None,
        critical_saving_ms=float(np.mean([c[1] for c in critical])) * 1e3 if critical else None,
        errors=[f"{n}: {r.error}" for n, r in rs.items() if not r.feasible])
    if top:
        remap_s, remap, inter, ring, uly = np.mean(top, axis=0)
        cell.remap_ms, cell.remap_gb, cell.remap_inter_gb = remap_s * 1e3, remap / 1e9, inter / 1e9
        cell.ring_gb, cell.ulysses_gb = ring / 1e9, uly / 1e9
    return cell


# ------------------------------------------------------------------ report
def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _rung(cell: "AblationCell", name: str) -> str:
    """Speedup over te_cp; the step time when te_cp could not run; or infeasible."""
    speedup, ms = cell.speedup.get(name), cell.step_ms.get(name)
    return f"{speedup:.2f}x" if speedup else ("infeasible" if ms is None else f"{ms:.0f} ms")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def regressions(key: str, cell: AblationCell) -> list[str]:
    """One line per rung slower than the rung before it (Zeppelin rungs only)."""
    out = []
    for prev, cur in zip(RUNGS[1:], RUNGS[2:]):
        a, b = cell.step_ms.get(prev), cell.step_ms.get(cur)
        if a and b and b > a * (1 + 1e-9):
            detail = "; the planner placed differently on the cheaper links (see below)"
            if cur == "zeppelin":
                detail = (f"; without remap the slowest rank held {cell.critical_linear:.2f}x the mean linear "
                          f"tokens, so balancing saves it at most {cell.critical_saving_ms:.0f} ms, while the "
                          f"remap costs {cell.remap_ms:.0f} ms per step ({cell.remap_gb:.1f} GB, "
                          f"{_pct(cell.remap_inter_share)} of it across nodes)")
            out.append(f"* {key}: {LABELS[cur]} is {b - a:.1f} ms ({100 * (b / a - 1):.2f}%) slower than "
                       f"{LABELS[prev]}{detail}")
    return out


def report(rows: list[tuple[tuple[str, str, str], AblationCell]], args: argparse.Namespace, elapsed: float,
           command: str) -> str:
    head = ["model", "cluster", "lengths", "seqs/batch", f"{BASELINE} CP", f"{BASELINE} ms",
            *[f"{LABELS[n]}" for n in RUNGS[1:]], "linear imbalance (no remap -> remap)",
            "slowest rank's linear load / saving (no remap)", "remap ms",
            "remap GB", "attn comm GB (ring + Ulysses)", "remap / attn comm", "remap across nodes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    slower, errors = [], []
    for (model, cluster, lengths), c in rows:
        imb = c.linear_imbalance
        lines.append("| " + " | ".join([
            model, cluster, lengths, f"{c.seqs:.0f}", str(c.cp_size),
            f"{c.step_ms[BASELINE]:.0f}" if c.step_ms.get(BASELINE) else "infeasible",
            *[_rung(c, n) for n in RUNGS[1:]],
            f"{imb['zeppelin_noremap']:.2f} -> {imb['zeppelin']:.2f}"
            if imb.get("zeppelin_noremap") and imb.get("zeppelin") else "-",
            f"{c.critical_linear:.2f}x / {c.critical_saving_ms:.0f} ms" if c.critical_linear is not None else "-",
            f"{c.remap_ms:.0f}", f"{c.remap_gb:.1f}", f"{c.ring_gb:.1f} + {c.ulysses_gb:.1f}",
            _pct(c.remap_share), _pct(c.remap_inter_share)]) + " |")
        slower += regressions(f"{model} / {cluster} / {lengths}", c)
        errors += [f"* {model} / {cluster} / {lengths}: {e}" for e in c.errors]
    summary = ["", f"Geometric-mean speedup over {BASELINE} (cells where both ran):", ""]
    for cluster in args.clusters:
        parts = []
        for n in RUNGS[1:]:
            s = [c.speedup[n] for (_, cl, _), c in rows if cl == cluster and c.speedup.get(n)]
            if s:
                parts.append(f"{LABELS[n]} {geomean(s):.2f}x")
        summary.append(f"* {cluster}: " + ", ".join(parts))
    summary += ["", "Rungs slower than the rung before them:", ""] + (slower or ["* none"])
    if errors:
        summary += ["", "Infeasible:", ""] + errors
    setup = (f"{args.nodes} nodes per cluster, max sequence length {args.max_seq_len}, {args.tokens_per_gpu} "
             f"tokens/GPU, {args.steps} global batch(es) per cell (the simulator's sampler and batch fill).")
    return (f"# Ablation: {BASELINE} -> zeppelin_base -> +routing -> +remap\n\nCommand: `{command}` "
            f"({elapsed:.0f} s on a shared 2-core CPU box)\n\n{setup}  {COLUMNS}\n\n"
            + "\n".join(lines + summary) + f"\n\n{READING}\n")


def default_lengths() -> list[Path]:
    shared = sorted(SHARED_LENGTHS.glob("*.npy")) if SHARED_LENGTHS.is_dir() else []
    return sorted((CONFIG_ROOT / "lengths").glob("synthetic-*.npy")) + shared


def main() -> None:
    def csv(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=csv, default=["llama-3b", "llama-7b", "llama-13b"])
    p.add_argument("--clusters", type=csv, default=["h100-8x400g", "a800-4x200g"])
    p.add_argument("--lengths", type=lambda s: [Path(x) for x in csv(s)], default=None,
                   help="length files (default: configs/lengths/synthetic-*.npy + ../shared/data/lengths/*.npy)")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=128 * K)
    p.add_argument("--tokens-per-gpu", type=int, default=16 * K)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="the middle model only, 2 length files, 1 step")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "ablation.md")
    args = p.parse_args()
    lengths = args.lengths or default_lengths()
    if args.quick:
        args.models, lengths, args.steps = [args.models[len(args.models) // 2]], lengths[:2], 1
    command = ("python benchmarks/ablation.py " + shlex.join(sys.argv[1:])).strip()
    print(command, file=sys.stderr)

    def run() -> str:
        docs = {path.stem: load_lengths(path) for path in lengths}
        cells = [(m, c, d) for m in args.models for c in args.clusters for d in docs]
        rows, start = [], time.monotonic()
        for i, (m, c, d) in enumerate(cells):
            cost = CostModel(load_cluster(c, nodes=args.nodes), load_model(m))
            rows.append(((m, c, d), ablation_cell(cost, docs[d], max_seq_len=args.max_seq_len,
                                                  tokens_per_gpu=args.tokens_per_gpu, steps=args.steps,
                                                  seed=args.seed)))
            print(f"[{i + 1}/{len(cells)}] {time.monotonic() - start:5.0f}s {m} {c} {d}", file=sys.stderr)
        return report(rows, args, time.monotonic() - start, command)

    text = exit_on_user_error(run)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
