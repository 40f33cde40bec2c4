"""Measure causal attention throughput per sequence length and fit the cost model's
kernel-efficiency curve ``eff(b) = eff_max * b / (b + b_half)`` (least squares in
efficiency space, :func:`attn_calibration.fit_curve`).

Run on a GPU node (one GPU is enough):

    python benchmarks/kernel_throughput.py --cluster h100-8x400g --model llama-7b --out docs/results/kernels-h100.md

It times forward+backward of causal attention (PyTorch SDPA, and flash-attn when
installed) at lengths 256..64K with the model's head shape, converts to TFLOP/s
with the same FLOP count the cost model uses, and prints the fitted
``attn_efficiency`` / ``attn_half_block`` to put into the cluster preset.
On a CPU it runs (tiny lengths) only to check that the script works.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from attn_calibration import fit_curve  # beside this file
from megatron_zeppelin.cost.model import ATTN_BWD_RATIO
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import causal_pairs
from megatron_zeppelin.topology import load_cluster


def sdpa_step(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()


def flash_step(q, k, v):
    from flash_attn import flash_attn_func  # optional: GPU only
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    out.sum().backward()


def time_kernel(step, length, heads, kv_heads, head_dim, device, dtype, repeats) -> float:
    shape = lambda h: (1, h, length, head_dim)  # noqa: E731  [b, heads, s, d] for SDPA
    q = torch.randn(shape(heads), device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(shape(kv_heads), device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(shape(kv_heads), device=device, dtype=dtype, requires_grad=True)
    step(q, k, v)  # warm-up of this shape (kernel selection, autotuning)
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            step(q, k, v)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        step(q, k, v)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="h100-8x400g")
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    cluster, model = load_cluster(args.cluster), load_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",")]
    if device == "cpu":
        lengths = [L for L in lengths if L <= 1024]
        print("no GPU: timing tiny lengths on CPU only to exercise the script", file=sys.stderr)
    kernels = {"sdpa": sdpa_step}
    try:
        import flash_attn  # noqa: F401
        if device == "cuda":
            kernels["flash"] = flash_step
    except ImportError:
        pass
    # FLOPs per layer and head group, as the cost model counts them (fwd + bwd).
    flops_per_pair = model.attn_flops_per_pair / model.num_layers * (1 + ATTN_BWD_RATIO)
    rows = [f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, dtype {dtype}, "
            f"heads {model.num_attention_heads}/{model.num_query_groups}, head dim {model.head_dim}", "",
            "| kernel | length | ms (fwd+bwd) | TFLOP/s | % of peak |", "| --- | --- | --- | --- | --- |"]
    fits = []
    for name, step in kernels.items():
        # The first call of a process loads kernels and grows the allocator: on the first
        # H200 run it made the shortest length 50x slow.  Pay it before any timing.
        time_kernel(step, lengths[0], model.num_attention_heads, model.num_query_groups, model.head_dim,
                    device, dtype, 1)
        measured = []
        for L in lengths:
            s = time_kernel(step, L, model.num_attention_heads, model.num_query_groups, model.head_dim,
                            device, dtype, args.repeats)
            tflops = causal_pairs(0, L) * flops_per_pair / s / 1e12
            measured.append(tflops)
            rows.append(f"| {name} | {L} | {s * 1e3:.3f} | {tflops:.1f} | "
                        f"{100 * tflops / cluster.gpu.peak_tflops:.1f} |")
        curve = fit_curve(lengths, measured, cluster.gpu.peak_tflops)
        fits.append(f"{name}: attn_efficiency = {curve.efficiency:.3f}, attn_half_block = {curve.half_block:.0f}")
    text = "\n".join(rows + ["", "Fitted (put into the cluster preset):"] + fits)
    text += f"\n\nCommand: python benchmarks/kernel_throughput.py {' '.join(sys.argv[1:])}\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
