"""Published attention-kernel throughput per sequence length, fitted to the cost model's
kernel curve, and the cluster presets each fit sets.

    python benchmarks/published_kernels.py            # writes docs/results/published-kernels.md
    python benchmarks/published_kernels.py --check    # exit 1 when a preset differs from its fit

The cost model prices attention at ``peak * e * L / (L + h)`` (``CostModel.attn_efficiency``);
a whole causal sequence of ``L`` tokens is one block of ``L``.  The FlashAttention papers
give forward + backward TFLOP/s for batches of equal sequences of ``L`` = 512 .. 16K tokens
(batch = 16K / L, hidden 2048) with the FLOP count the cost model uses (backward 2.5x
forward, causal half of full), so ``e`` and ``h`` are fitted to them directly, by the same
least squares as our own GPU calibration (``attn_calibration.fit_curve``).  Causal series set
the presets: a local sequence is causal, and a ring's off-diagonal blocks, which run faster,
are then charged conservatively.

The points were read off the figures as published (the bar labels; where a legend hides a
label, the bar's height against the labelled bars of its panel, +-1 TFLOP/s), and each series
names its paper, figure and panel.  Nothing here was measured by us except the H200 table the
cross-check reads (``tests/benchmarks/fixtures/h200-2026-11-26.json``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from attn_calibration import Curve, check_table, fit_curve, load_tables, table_markdown  # beside this file
from megatron_zeppelin.cost.model import ATTN_BWD_RATIO
from megatron_zeppelin.errors import exit_on_user_error
from megatron_zeppelin.topology import load_cluster

REPO = Path(__file__).resolve().parent.parent
H200_TABLES = REPO / "tests" / "benchmarks" / "fixtures" / "h200-2026-11-26.json"
#: Sequence lengths of every published series (tokens).
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
#: The papers' dense bf16 peaks (datasheets): A100 SXM4, H100 SXM5.
A100_PEAK, H100_PEAK = 312.0, 989.0
FA2 = "FlashAttention-2 (Dao, arXiv 2307.08691)"
FA3 = "FlashAttention-3 (Shah et al., arXiv 2407.08608)"
#: Where the FA2 figures are published as images beside the paper (the same plots).
FA2_A100_FIGURE = "fwd+bwd speed on A100 80GB SXM4 (Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark.png)"
FA2_H100_FIGURE = "fwd+bwd speed on H100 80GB SXM5 (Dao-AILab/flash-attention assets/flash2_h100_fwd_bwd_benchmark.png)"


@dataclass(frozen=True)
class Series:
    """One published curve: forward + backward TFLOP/s of one kernel at ``LENGTHS``."""

    name: str
    """Short key, used by the presets table."""
    paper: str
    """Paper and arXiv number."""
    figure: str
    """Figure and panel the numbers are read from."""
    gpu: str
    """GPU the paper measured on."""
    peak_tflops: float
    """That GPU's dense bf16 peak (the efficiency's denominator)."""
    head_dim: int
    """Head dimension of the panel."""
    causal: bool
    """Causal mask (the papers halve the FLOPs, as ``causal_pairs`` does)."""
    tflops: tuple[float, ...]
    """Forward + backward TFLOP/s at each of ``LENGTHS``."""
    note: str = ""
    """How the numbers were read, where that is not plain bar labels."""

    def fit(self) -> Curve:
        return fit_curve(LENGTHS, self.tflops, self.peak_tflops)

    def worst_error(self) -> float:
        return max(abs(e) for e in self.fit().errors(LENGTHS, self.tflops, self.peak_tflops))


def forward_backward(forward: tuple[float, ...], backward: tuple[float, ...]) -> tuple[float, ...]:
    """Forward + backward TFLOP/s from separate forward and backward figures: the
    backward does ``ATTN_BWD_RATIO`` times the forward's FLOPs, so the times add as
    ``1/f + r/b`` per forward FLOP."""
    r = ATTN_BWD_RATIO
    return tuple((1 + r) / (1 / f + r / b) for f, b in zip(forward, backward))


SERIES = (
    Series("fa2-a100-causal-d128", FA2, FA2_A100_FIGURE + ", panel (d)", "A100 SXM4", A100_PEAK, 128, True,
           (99, 133, 155, 173, 182, 189)),
    Series("fa2-a100-causal-d64", FA2, FA2_A100_FIGURE + ", panel (c)", "A100 SXM4", A100_PEAK, 64, True,
           (88, 119, 140, 156, 165, 171)),
    Series("fa2-a100-full-d128", FA2, FA2_A100_FIGURE + ", panel (b)", "A100 SXM4", A100_PEAK, 128, False,
           (152, 173, 187, 196, 201, 203), "512 and 1K: labels behind the legend, read from the bar heights"),
    Series("fa2-a100-full-d64", FA2, FA2_A100_FIGURE + ", panel (a)", "A100 SXM4", A100_PEAK, 64, False,
           (132, 153, 162, 171, 175, 176), "1K: label behind the legend, read from the bar height"),
    Series("fa2-h100-causal-d128", FA2, FA2_H100_FIGURE + ", panel (d)", "H100 SXM5", H100_PEAK, 128, True,
           (163, 221, 265, 294, 308, 328)),
    Series("fa2-h100-causal-d64", FA2, FA2_H100_FIGURE + ", panel (c)", "H100 SXM5", H100_PEAK, 64, True,
           (141, 192, 232, 257, 273, 284)),
    Series("fa2-h100-full-d128", FA2, FA2_H100_FIGURE + ", panel (b)", "H100 SXM5", H100_PEAK, 128, False,
           (248, 294, 320, 326, 335, 338)),
    Series("fa3-h100-full-d128", FA3,
           "forward figure panel (c) (Dao-AILab/flash-attention assets/flash3_fp16_fwd.png) with the "
           "backward-speed figure, head dim 128", "H100 SXM5", H100_PEAK, 128, False,
           forward_backward((467, 565, 625, 638, 646, 648), (316, 424, 501, 542, 559, 561)),
           "fwd+bwd composed from the forward and backward figures; the backward values are from a "
           "transcription of the paper's backward figure (not checked against the image here); we found no "
           "causal backward figure per length, so FA3 has no causal fwd+bwd series here"),
)
BY_NAME = {s.name: s for s in SERIES}


@dataclass(frozen=True)
class PresetFit:
    """Which fit sets a cluster preset's ``attn_efficiency`` / ``attn_half_block``."""

    preset: str
    """Cluster preset name (``configs/clusters/``)."""
    series: str
    """Key of the series whose fit it takes."""
    why: str
    """Why that series."""
    scaled_by: tuple[str, str] | None = None
    """``(preset, reference)``: the efficiency is multiplied by the ratio of the two presets'
    ``linear_efficiency`` (a preset calibrated to a system's measured end-to-end speed slows
    its attention as much as its GEMMs); ``None``: the fit as it is."""

    def curve(self) -> Curve:
        fit = BY_NAME[self.series].fit()
        if self.scaled_by is None:
            return fit
        own, ref = (load_cluster(name).gpu.linear_efficiency for name in self.scaled_by)
        return Curve(fit.efficiency * own / ref, fit.half_block)

    def values(self) -> tuple[float, int]:
        """The two numbers as the preset writes them."""
        c = self.curve()
        return round(c.efficiency, 3), round(c.half_block)


HOPPER_WHY = ("the causal fwd+bwd figure per length published for Hopper at head dim 128 (for FlashAttention-3 we "
              "found no causal backward figure per length); FlashAttention-2 is the "
              "kernel family the engine runs (`torch_flash`, `flash`), and our own H200 run of it "
              "(torch_flash varlen, e = 0.339) matches this fit's level")
PRESETS = (
    PresetFit("a800-4x200g", "fa2-a100-causal-d128",
              "A800 = A100 compute (datasheet); LLaMA's head dim 128; FlashAttention-3 does not run on Ampere"),
    PresetFit("a100-40g-4x100g", "fa2-a100-causal-d64",
              "FlexSP's GPT models have 64 heads (head dim 64 at 7B); the level follows FlexSP's measured "
              "MFU as the preset's linear_efficiency does", scaled_by=("a100-40g-4x100g", "a800-4x200g")),
    PresetFit("h100-8x400g", "fa2-h100-causal-d128", HOPPER_WHY),
    PresetFit("h800-8x400g", "fa2-h100-causal-d128", "H800 = H100 compute (datasheet); " + HOPPER_WHY),
    PresetFit("h200-8x400g", "fa2-h100-causal-d128",
              "H200 = H100 compute, 989 TFLOP/s dense bf16 (datasheet; only HBM grows, and attention at "
              "these lengths is compute-bound); " + HOPPER_WHY),
)


def preset_mismatches() -> list[str]:
    """One line per preset whose YAML values differ from its fit."""
    bad = []
    for p in PRESETS:
        gpu = load_cluster(p.preset).gpu
        want = p.values()
        if (gpu.attn_efficiency, gpu.attn_half_block) != want:
            bad.append(f"{p.preset}: attn_efficiency {gpu.attn_efficiency}, attn_half_block {gpu.attn_half_block}; "
                       f"the fit to {p.series} gives {want[0]}, {want[1]}")
    return bad


def h200_cross_check() -> list[str]:
    """Our H200 FA2 tables against the H100 FA2 fit the Hopper presets take (same compute,
    same kernel family), and against their own fit."""
    tables = load_tables(H200_TABLES)
    hopper = BY_NAME["fa2-h100-causal-d128"].fit()
    lines = []
    for name, table in tables["tables"].items():
        if table["kernel"] != "torch_flash":
            continue
        own, _, _ = check_table(table, tables["peak_tflops"])
        errs = hopper.errors(table["lengths"], table["tflops"], tables["peak_tflops"])
        lines.append(f"| {name} | {own.efficiency:.3f} / {own.half_block:.0f} | "
                     + " | ".join(f"{100 * e:+.0f} %" for e in errs) + " |")
    columns = ["H200 table", "its own fit e / h", *map(str, tables["tables"]["fa2-varlen-gqa"]["lengths"])]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *lines]


def report(argv: list[str]) -> str:
    cmd = " ".join(["python benchmarks/published_kernels.py", *argv])
    out = ["# Published attention-kernel figures and the presets they set", "",
           f"Command: `{cmd}` (no GPU: the numbers are the papers').", "",
           "Each series is forward + backward TFLOP/s per sequence length (batches of 16K tokens of equal "
           "sequences, hidden 2048), fitted to the cost model's `eff(L) = e L / (L + h)` by least squares in "
           "efficiency space (`benchmarks/attn_calibration.py: fit_curve`).", "",
           "| series | paper, figure | GPU | head dim | causal | e | h | worst error | sets |",
           "|---|---|---|---|---|---|---|---|---|"]
    setting = {p.series: [] for p in PRESETS}
    for p in PRESETS:
        setting[p.series].append(p.preset)
    for s in SERIES:
        c = s.fit()
        out.append(f"| {s.name} | {s.paper}, {s.figure} | {s.gpu} | {s.head_dim} | {'yes' if s.causal else 'no'} | "
                   f"{c.efficiency:.3f} | {c.half_block:.0f} | {100 * s.worst_error():.1f} % | "
                   f"{', '.join(setting.get(s.name, [])) or '-'} |")
    out += ["", "## The presets", "", "| preset | series | attn_efficiency | attn_half_block | why |",
            "|---|---|---|---|---|"]
    for p in PRESETS:
        e, h = p.values()
        scale = ""
        if p.scaled_by:
            own, ref = p.scaled_by
            scale = f" x linear_efficiency {own} / {ref}"
        out.append(f"| {p.preset} | {p.series}{scale} | {e} | {h} | {p.why} |")
    out += ["", "`nvidia-h200-torch-flash-calibrated` and `nvidia-h100-80gb-hbm3-torch-flash-calibrated` keep "
            "our own calibrations (`scripts/gpu_check.sh`, 2026-11-26, torch_flash varlen packs, 128 to 64K "
            "tokens: one H200 e = 0.339, h = 684; one H100 e = 0.339, h = 729). Their long-block efficiency is "
            "the H100 FA2 paper fit's (0.337) to 1 %; their half block is longer (varlen packs of short "
            "documents run slower than the paper's single sequences). `cpu-sim` describes CPU processes and "
            "takes nothing from here.", "",
            "## Below 512 tokens", "",
            "The papers start at 512 tokens; a ring's chunks of short documents (TE CP cuts every sequence "
            "into 2 x CP chunks) are shorter, so there the curve is an extrapolation. Our H200 tables reach "
            "128 tokens: the Hopper presets' fit (H100 FA2, causal, head dim 128) against them, per length "
            "(+ = the fit is faster than measured):", "", *h200_cross_check(), "",
            "## Points and fits", ""]
    for s in SERIES:
        out += [f"**{s.name}** ({s.paper}, {s.figure}; peak {s.peak_tflops:g} TFLOP/s"
                + (f"; {s.note}" if s.note else "") + ")", "",
                table_markdown(LENGTHS, [round(t, 1) for t in s.tflops], s.fit(), s.peak_tflops), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="only compare the presets with their fits; exit 1 and name each one that differs")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "published-kernels.md")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    for s in SERIES:
        c = s.fit()
        print(f"{s.name}: e={c.efficiency:.3f} h={c.half_block:.0f} worst={100 * s.worst_error():.1f}%")
    bad = preset_mismatches()
    for line in bad:
        print(line)
    if not args.check:
        args.out.write_text(report([a for a in argv if a != "--check"]) + "\n", encoding="utf-8")
    print(f"published_kernels: series={len(SERIES)} presets={len(PRESETS)} differing={len(bad)}")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
