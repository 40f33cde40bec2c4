"""Attention kernel calibration: the cost model's curve ``eff(L) = e * L / (L + h)``
for each kernel the engine can run, fitted on packed varlen batches.

The cost model (``CostModel.attn_efficiency``) prices a causal block of ``L`` query
tokens at ``peak * attn_efficiency * L / (L + attn_half_block)``; a local sequence is
one block of its own length.  So a kernel is timed on packs of equal documents of
length ``L`` (forward + backward through the engine's backend interface, the calls
the engine makes), converted to TFLOP/s with the cost model's FLOP count, and ``e``
and ``h`` are fitted by least squares in efficiency space.

Why not the old 1/eff-linear fit: short blocks are latency-bound, so ``1/eff``
against ``1/L`` is not a line there and the linearized fit came out negative on
the first H200 run (``../shared/gpu/h200-2026-11-26.md``); in efficiency space the
long blocks, which carry the time, dominate, and both H200 tables fit
(``tests/benchmarks/fixtures/h200-2026-11-26.json``).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO
from megatron_zeppelin.plan import causal_pairs

#: Kernels the engine can run, by backend name (``get_backend``), fastest first.
FUSED_KERNELS = ("torch_flash", "flash", "te")
#: A fit must hold the table it was fitted on within this, at every length.
FIT_TOLERANCE = 0.10
#: Half blocks searched (tokens): 1 (flat at once) .. 10M (still rising far past 64K).
HALF_BLOCK_RANGE = (1.0, 1e7)


@dataclass(frozen=True)
class Timing:
    """What is timed: packs of equal documents of each length, forward + backward."""

    lengths: tuple[int, ...]
    """Document lengths."""
    pack: int
    """Tokens per pack (a longer document is a pack of one); the pack size moves FA2's
    figure by < 4 % (H200 note): the document length is what matters."""
    heads: tuple[int, int, int]
    """Query heads, KV heads, head dim."""
    dtype: str
    """torch dtype name."""
    repeats: int
    """Timed calls per length (the median counts)."""

    def describe(self) -> str:
        return (f"packs of {self.pack} tokens of equal documents, heads {self.heads[0]}/{self.heads[1]} x "
                f"{self.heads[2]}, {self.dtype}, median of {self.repeats}")


#: On a GPU: the latency-bound short end to the flat long end, GQA 32/8 x 128 (LLaMA-3-8B's
#: attention, as the H200 table).
GPU_TIMING = Timing((128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536), 16384, (32, 8, 128), "bfloat16", 5)
#: A dry run times the torch kernels on the CPU at sizes that take a second.
DRY_TIMING = Timing((32, 64, 128), 128, (2, 1, 8), "float32", 2)


@dataclass(frozen=True)
class Curve:
    """``eff(L) = efficiency * L / (L + half_block)``, the cost model's form."""

    efficiency: float
    """Fraction of the GPU's peak approached by long blocks (``gpu.attn_efficiency``)."""
    half_block: float
    """Block length reaching half of that (``gpu.attn_half_block``)."""

    def eff(self, length: float) -> float:
        return self.efficiency * length / (length + self.half_block)

    def errors(self, lengths: Sequence[int], tflops: Sequence[float], peak: float) -> list[float]:
        """Relative error of the curve against each measured point."""
        return [self.eff(L) * peak / t - 1 for L, t in zip(lengths, tflops)]


def fit_curve(lengths: Sequence[int], tflops: Sequence[float], peak: float) -> Curve:
    """Least squares of ``eff(L)`` against ``tflops / peak``, with the efficiency a
    fraction of peak (<= 1, as a cluster preset requires).  For a fixed half block
    the best efficiency is closed-form; the half block is searched on a log grid,
    then on a finer grid around the best point (numpy only: no scipy on the GPU
    machine)."""
    L = np.asarray(lengths, float)
    y = np.asarray(tflops, float) / peak
    if L.size < 2 or np.any(L <= 0) or np.any(~np.isfinite(y)) or np.any(y <= 0) or np.any(y > 1):
        raise ValueError(f"a fit needs >= 2 positive lengths and TFLOP/s in (0, peak {peak}], got "
                         f"{list(lengths)}, {list(tflops)}")

    def best(halves: np.ndarray) -> tuple[float, float]:
        x = L / (L + halves[:, None])
        e = (x @ y) / np.einsum("ij,ij->i", x, x)
        residual = np.where(e <= 1, ((e[:, None] * x - y) ** 2).sum(axis=1), np.inf)
        i = int(np.argmin(residual))
        return float(halves[i]), float(e[i])

    lo, hi = (math.log(v) for v in HALF_BLOCK_RANGE)
    coarse = np.exp(np.linspace(lo, hi, 2001))
    h, _ = best(coarse)
    step = (hi - lo) / 2000
    h, e = best(np.exp(np.linspace(math.log(h) - step, math.log(h) + step, 2001)))
    return Curve(e, h)


def pair_flops(heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs per causal (query, key) pair of one layer, as the
    cost model counts them (``ModelConfig.attn_flops_per_pair``, ``ATTN_BWD_RATIO``)."""
    return 4.0 * heads * head_dim * (1 + ATTN_BWD_RATIO)


def pack_documents(length: int, pack: int) -> list[int]:
    """Documents of ``length`` tokens filling ``pack`` tokens (the last one shorter
    when ``length`` does not divide it; one document when it is longer)."""
    total = max(pack, length)
    return [min(length, total - start) for start in range(0, total, length)]


def pack_tflops(documents: Sequence[int], heads: int, head_dim: int, seconds: float) -> float:
    """TFLOP/s of one fwd+bwd over the causal ``documents`` in ``seconds``."""
    return sum(causal_pairs(0, n) for n in documents) * pair_flops(heads, head_dim) / seconds / 1e12


# ---------------------------------------------------------------- timing
def wall_timer(device) -> Callable[[Callable[[], object], int], float]:
    """``timer(fn, repeats)``: median seconds per call of ``fn``, by CUDA events on
    a GPU (each call its own pair), by the host clock on a CPU."""
    import torch

    def cuda(fn, repeats):
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3

    def host(fn, repeats):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return cuda if device.type == "cuda" else host


def varlen_step(backend, length: int, pack: int, heads: tuple[int, int, int], device, dtype) -> Callable[[], object]:
    """One forward + backward of ``backend``'s varlen kernels over a pack of equal
    documents (the last one shorter when ``length`` does not divide ``pack``)."""
    import torch

    hq, hk, d = heads
    documents = pack_documents(length, pack)
    total = sum(documents)
    q, k, v, dout = (torch.randn(total, h, d, device=device, dtype=dtype) for h in (hq, hk, hk, hq))
    cu = torch.tensor([0, *np.cumsum(documents)], device=device, dtype=torch.int32)
    kw = dict(cu_seqlens=cu, max_seqlen=length, scale=d ** -0.5)

    def step():
        out, lse = backend.varlen_forward(q, k, v, **kw)
        return backend.varlen_backward(dout, q, k, v, out, lse, **kw)

    return step


def time_kernel(backend, setup: Timing, device) -> list[float]:
    """TFLOP/s of ``backend`` at each of ``setup.lengths``.  Every length runs once
    before any is timed (lazy kernel loading, allocator growth: the first H200 run's
    first length carried it), then once more right before its own timing."""
    import torch

    dtype = getattr(torch, setup.dtype)
    steps = [varlen_step(backend, L, setup.pack, setup.heads, device, dtype) for L in setup.lengths]
    for step in steps:
        step()
    timer = wall_timer(device)
    measured = []
    for L, step in zip(setup.lengths, steps):
        step()
        seconds = timer(step, setup.repeats)
        measured.append(pack_tflops(pack_documents(L, setup.pack), setup.heads[0], setup.heads[2], seconds))
    return measured


# ---------------------------------------------------------------- tables and presets
def load_tables(path: str | Path) -> dict:
    """A JSON table file (``tests/benchmarks/fixtures/h200-2026-11-26.json``): the
    peak and, per kernel, lengths, TFLOP/s, and where the fit must hold."""
    return json.loads(Path(path).read_text())


def check_table(table: dict, peak: float) -> tuple[Curve, list[float], bool]:
    """Fit ``table`` and judge it: positive, and within ``table['tolerance']`` at the
    lengths in ``table['check']`` ([shortest, longest])."""
    curve = fit_curve(table["lengths"], table["tflops"], peak)
    errors = curve.errors(table["lengths"], table["tflops"], peak)
    lo, hi = table["check"]
    held = [abs(err) <= table["tolerance"] for L, err in zip(table["lengths"], errors) if lo <= L <= hi]
    return curve, errors, curve.efficiency > 0 and curve.half_block >= 0 and all(held)


def table_markdown(lengths: Sequence[int], tflops: Sequence[float], curve: Curve, peak: float) -> str:
    """Measured and fitted TFLOP/s per length, one row each."""
    rows = ["| length | TFLOP/s | fit | error |", "| --- | --- | --- | --- |"]
    for L, t, err in zip(lengths, tflops, curve.errors(lengths, tflops, peak)):
        rows.append(f"| {L} | {t:.4g} | {curve.eff(L) * peak:.4g} | {100 * err:+.1f} % |")
    return "\n".join(rows)


def calibrated_preset(base_yaml: str, name: str, curve: Curve, stamp: str) -> str:
    """``base_yaml`` renamed ``name``, with the fitted curve and ``stamp`` (the kernel,
    the GPU, the date) beside both values."""
    text = re.sub(r"(?m)^name: .*$", f"name: {name}", base_yaml)
    for key, value in (("attn_efficiency", f"{curve.efficiency:.4g}"),
                       ("attn_half_block", f"{round(curve.half_block)}")):
        text, n = re.subn(rf"(?m)^(\s+){key}: .*$", rf"\g<1>{key}: {value}  # {stamp}", text)
        if n != 1:
            raise RuntimeError(f"the base preset has no single gpu.{key} line to replace")
    return text
