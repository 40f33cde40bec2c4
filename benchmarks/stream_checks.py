"""``gpu_check``'s engine sections: the CUDA branch run for real on one GPU.

Ranks are threads over :mod:`loopback` (NCCL's stream semantics), each rank's
caller on a stream of its own, forward and backward called per rank without
autograd's device thread.  Sections (each ``section_<name>(args, dry_run)``):

* ``delays``: every kind of plan -- local, ring of 2 and 4, Ulysses, two nodes
  with routing, remap both ways -- with streams held busy on purpose (the
  caller's before q/k/v are written, every transfer, the compute stream after
  each op, all at once); outputs and gradients read at once on the caller's
  stream and again after a sync, against fp32 attention on whole sequences;
* ``syncs``: host syncs in a repeated forward + backward (``torch.cuda.set_sync_debug_mode``);
* ``overhead``: the engine against one plain varlen call on the same tokens;
* ``concurrency``: ``torch.profiler``'s overlap of the loopback copies with kernels.

``dry_run`` runs the same code on CPU tensors under the recording checker
(``comm/stream_check.py``), which fails on any access CUDA would not order.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gpu_report import SectionResult
from loopback import DelayedStreams, Delays, LoopbackCommunicator, LoopbackHub, hold, run_ranks
from megatron_zeppelin.attention.backends import get_backend
from megatron_zeppelin.attention.engine import attention_passes
from megatron_zeppelin.attention.layout import shard_sequences
from megatron_zeppelin.comm.stream_check import RecordingStreams
from megatron_zeppelin.comm.streams import streams_for
from megatron_zeppelin.plan import Mode, Plan, placement
from megatron_zeppelin.planner.base import same_layout_linear
from megatron_zeppelin.planner.linear_layout import balance_linear
from megatron_zeppelin.remap.remap import layout_move, pad_rows
from megatron_zeppelin.topology import Topology

#: Delays on a GPU (seconds): long enough that an unordered read sees stale data.
GPU_DELAYS = {"none": Delays(), "caller late": Delays(caller_s=0.010), "links slow": Delays(transfer_s=0.001),
              "compute slow": Delays(compute_s=0.0005),
              "all": Delays(caller_s=0.010, transfer_s=0.001, compute_s=0.0005)}
#: On CPU the host sleeps instead, which shuffles the threads' interleaving.
CPU_DELAYS = {name: Delays(*(min(x, 0.001) for x in (d.caller_s, d.transfer_s, d.compute_s)))
              for name, d in GPU_DELAYS.items()}
#: Max abs error allowed against fp32 attention (bf16: the kernels' own rounding).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


@dataclass(frozen=True)
class Case:
    """One plan of the harness and the transport it runs on."""

    name: str
    plan: Plan
    topology: Topology
    min_routed_bytes: float = math.inf
    remap: bool = False


def _plan(world: int, gpn: int, spec: list[tuple[int, Mode, list[int]]], balanced: bool = False,
          packed_rings: tuple[tuple[int, ...], ...] = (), packed_ulysses: tuple[tuple[int, ...], ...] = ()) -> Plan:
    lens = [n for n, _, _ in spec]
    att = tuple(placement(i, n, mode, ranks) for i, (n, mode, ranks) in enumerate(spec))
    linear = balance_linear(att, lens, world, gpn) if balanced else same_layout_linear(world, att)
    return Plan("stream_checks", world, gpn, tuple(lens), att, linear, packed_rings=packed_rings,
                packed_ulysses=packed_ulysses).validate()


def cases(scale: int) -> list[Case]:
    """The plans of ``delays`` with sequences ``scale`` times a base length."""
    n = scale
    one_node = lambda w: Topology(nodes=1, gpus_per_node=w, nics_per_node=1)  # noqa: E731
    two_nodes = Topology(nodes=2, gpus_per_node=2, nics_per_node=2)
    locals4 = [(3 * n, Mode.LOCAL, [0]), (2 * n, Mode.LOCAL, [1]), (n, Mode.LOCAL, [0]), (n // 2, Mode.LOCAL, [1])]
    return [
        Case("local", _plan(2, 2, locals4), one_node(2)),
        Case("ring of 2", _plan(2, 2, [(8 * n, Mode.RING, [0, 1]), *locals4]), one_node(2)),
        Case("ring of 4 + ring of 2 + Ulysses", _plan(4, 4, [
            (8 * n, Mode.RING, [0, 1, 2, 3]), (4 * n, Mode.RING, [2, 3]), (4 * n, Mode.ULYSSES, [0, 1]),
            (2 * n, Mode.LOCAL, [0]), (n, Mode.LOCAL, [1]), (2 * n, Mode.LOCAL, [2]), (n, Mode.LOCAL, [3])]),
             one_node(4)),
        Case("Ulysses of 2", _plan(2, 2, [(6 * n, Mode.ULYSSES, [0, 1]), (n, Mode.LOCAL, [1])]), one_node(2)),
        Case("2 nodes, routed", _plan(4, 2, [
            (8 * n, Mode.RING, [0, 2, 1, 3]), (4 * n, Mode.RING, [2, 3]), (n, Mode.LOCAL, [0]),
            (n, Mode.LOCAL, [1])]), two_nodes, 0.0),
        Case("2 nodes, routed, remap both ways", _plan(4, 2, [
            (8 * n, Mode.RING, [0, 1, 2, 3]), (3 * n, Mode.LOCAL, [0]), (n, Mode.LOCAL, [1]),
            (n, Mode.LOCAL, [3])], balanced=True), two_nodes, 0.0, remap=True),
        # TE's THD ring: three sequences in one ring across nodes (one message per
        # step), beside an unpacked ring on the same ranks and local work.
        Case("2 nodes, packed ring + ring", _plan(4, 2, [
            (8 * n, Mode.RING, [0, 2, 1, 3]), (5 * n + 3, Mode.RING, [0, 2, 1, 3]), (n, Mode.LOCAL, [1]),
            (3 * n + 5, Mode.RING, [0, 2, 1, 3]), (4 * n + 4, Mode.RING, [0, 2, 1, 3])],
            packed_rings=((0, 1, 3),)), two_nodes),
        # FlexSP's packed group: two sequences in one all-to-all across nodes,
        # beside an unpacked group on the same ranks, another group and local work.
        Case("2 nodes, packed Ulysses + Ulysses", _plan(4, 2, [
            (6 * n, Mode.ULYSSES, [0, 2]), (4 * n + 4, Mode.ULYSSES, [0, 2]), (n, Mode.LOCAL, [1]),
            (3 * n + 5, Mode.ULYSSES, [0, 2]), (5 * n, Mode.ULYSSES, [1, 3])],
            packed_ulysses=((0, 3),)), two_nodes),
    ]


def _reference(seqs: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    """(out, dq, dk, dv) of fp32 causal attention on every whole sequence."""
    refs = []
    for q, k, v, dout in seqs:
        q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                                             is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        out.backward(dout.float())
        refs.append((out.detach(), q.grad, k.grad, v.grad))
    return refs


class Harness:
    """One plan's ranks on one device, reusable across runs (caches, communicators)."""

    def __init__(self, case: Case, device: torch.device, dtype: torch.dtype, streams: Any, delays: Delays,
                 heads: tuple[int, int, int], backend: str = "auto") -> None:
        self.case, self.device, self.dtype = case, device, dtype
        plan = case.plan
        self.streams = DelayedStreams(streams, delays.compute_s)
        self.delays = delays
        hub = self.hub = LoopbackHub(plan.world_size, device, self.streams, delays)
        self.comms = [LoopbackCommunicator(hub, r, case.topology, case.min_routed_bytes, dtype=dtype)
                      for r in range(plan.world_size)]
        self.callers = [self.streams.new_stream() for _ in range(plan.world_size)]
        self.streams.callers = {id(s) for s in self.callers}
        self.caches: list[dict] = [{} for _ in range(plan.world_size)]
        self.backend = get_backend(backend)
        hq, hk, d = heads
        g = torch.Generator().manual_seed(0)
        seqs = [tuple(torch.randn(n, h, d, generator=g).to(device, dtype) for h in (hq, hk, hk, hq))
                for n in plan.seq_lens]
        self.seqs = seqs
        self.inputs = [[shard_sequences(plan, r, [s[i] for s in seqs]) for i in range(4)]
                       for r in range(plan.world_size)]

    @functools.cached_property
    def ref(self) -> list[tuple[torch.Tensor, ...]]:
        # Computed only when errors are asked for: fp32 attention on whole sequences holds
        # heads x n x n scores (32 GiB at overhead's 16K-token ring of 2 with LLaMA-7B heads),
        # which an 80 GiB H100 cannot hold beside the timed work that never needs it.
        return _reference(self.seqs)

    def _rank(self, r: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        s, plan, caller = self.streams, self.case.plan, self.callers[r]
        src = self.inputs[r]
        with s.use(caller):
            hold(s, caller, self.delays.caller_s)
            q, k, v, dout = (torch.empty_like(x) for x in src)
            for dst, x in zip((q, k, v, dout), src):         # written behind the caller's delay
                dst.copy_(x)
            out, backward = attention_passes(q, k, v, plan=plan, rank=r, comm=self.comms[r], backend=self.backend,
                                             cache=self.caches[r])
            results = [out, *backward(dout)]
            if self.case.remap:
                move = layout_move(plan=plan, rank=r, comm=self.comms[r], direction="to_linear", device=self.device,
                                   cache=self.caches[r])
                tokens = out.shape[0]
                padded = torch.cat([out, out.new_zeros((pad_rows(tokens), *out.shape[1:]))])
                linear = move(padded)
                results += [linear, move.reversed()(linear)[:tokens]]
            at_once = [x.clone() for x in results]               # read on the caller's stream, no sync
        return at_once, results

    def run(self) -> list:
        return run_ranks(self.hub, self._rank)

    def errors(self, results: list) -> dict[str, float]:
        """Max abs error of out/dq/dk/dv (and the remapped rows), read at once and after a sync."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        plan, worst = self.case.plan, {}
        for r, (at_once, later) in enumerate(results):
            expect = [shard_sequences(plan, r, [ref[i] for ref in self.ref]) for i in range(4)]
            if self.case.remap:
                rows = [self.ref[sp.seq][0][sp.start:sp.end] for sp in plan.linear[r]]
                linear = torch.cat(rows) if rows else expect[0][:0]
                expect += [linear, expect[0]]
            names = ["out", "dq", "dk", "dv", "linear", "back"]
            for when, got in (("at once", at_once), ("after sync", later)):
                for name, g, e in zip(names, got, expect):
                    err = (g[:e.shape[0]].float() - e).abs().max().item() if e.numel() else 0.0
                    key = f"{name} ({when})"
                    worst[key] = max(worst.get(key, 0.0), err)
        return worst


def _env(dry_run: bool) -> tuple[torch.device, Any, dict, int, tuple[int, int, int], list[torch.dtype]]:
    if dry_run:
        return (torch.device("cpu"), RecordingStreams(), CPU_DELAYS, 4, (4, 2, 8),
                [torch.float32, torch.bfloat16])
    device = torch.device("cuda", torch.cuda.current_device())
    return device, streams_for(device), GPU_DELAYS, 128, (8, 2, 64), [torch.float32, torch.bfloat16]


def section_delays(args: Any, dry_run: bool = False) -> SectionResult:
    device, streams, delays, scale, heads, dtypes = _env(dry_run)
    rows = ["| plan | dtype | delays | worst error | at | tolerance |", "| --- | --- | --- | --- | --- | --- |"]
    failed, worst_ratio, runs = [], 0.0, 0
    for case in cases(scale):
        for dtype in dtypes:
            for name, delay in delays.items():
                h = Harness(case, device, dtype, streams, delay, heads)
                errs = h.errors(h.run())
                runs += 1
                where, err = max(errs.items(), key=lambda kv: kv[1])
                tol = TOLERANCE[dtype]
                worst_ratio = max(worst_ratio, err / tol)
                if not err <= tol:
                    failed.append(f"{case.name}, {str(dtype)[6:]}, {name}: {where} {err:.3g}")
                rows.append(f"| {case.name} | {str(dtype)[6:]} | {name} | {err:.2e} | {where} | {tol:g} |")
    violations = getattr(streams, "violations", [])
    if dry_run:
        rows.append(f"\nRecording checker (CPU): {streams.kernels} kernels seen, {len(violations)} ordering "
                    "violation(s)." + ("\n\n" + "\n".join(violations[:10]) if violations else ""))
    passed = not failed and not violations
    figure = (f"{runs} runs, worst error {worst_ratio:.2f}x its tolerance" +
              (f"; {len(violations)} ordering violations" if violations else "") +
              (f"; FAILED: {failed[0]}" if failed else ""))
    return SectionResult(passed, figure, "\n".join(rows))


def _count_syncs(fn) -> tuple[int, list[str]]:
    """Host syncs torch reports while ``fn`` runs (every thread: the mode is global),
    and where they came from."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    return len(syncs), sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})


def section_syncs(args: Any, dry_run: bool = False) -> SectionResult:
    if dry_run:
        device, streams, _, scale, heads, _ = _env(True)
        for case in cases(scale)[1:2]:
            Harness(case, device, torch.float32, streams, Delays(), heads).run()
        return SectionResult(True, "dry run: the counted code ran on CPU (no CUDA syncs to count)", "")
    device, streams, _, scale, heads, _ = _env(False)
    rows = ["| plan | syncs, first call (builds the plan's caches) | syncs, next call | where |",
            "| --- | --- | --- | --- |"]
    worst = 0
    for case in cases(scale):
        h = Harness(case, device, torch.bfloat16, streams, Delays(), heads)
        first, where = _count_syncs(h.run)
        again, where_again = _count_syncs(h.run)
        worst = max(worst, again)
        rows.append(f"| {case.name} | {first} | {again} | {', '.join(where + where_again) or '-'} |")
    return SectionResult(worst == 0, f"{worst} host syncs per repeated forward + backward (target 0)",
                         "\n".join(rows))


def _ms(fn, repeats: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / repeats


def section_overhead(args: Any, dry_run: bool = False) -> SectionResult:
    device, streams, _, scale, heads, _ = _env(dry_run)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = ["| plan | tokens | engine ms (all ranks) | one varlen call ms | ratio |", "| --- | --- | --- | --- | --- |"]
    ratios = []
    for case in cases(scale * (16 if cuda else 1))[:2]:
        h = Harness(case, device, dtype, streams, Delays(), (32, 8, 128) if cuda else heads)
        engine = _ms(h.run, 5, cuda)
        plan, backend = case.plan, h.backend
        hq, hk, d = (32, 8, 128) if cuda else heads
        q, k, v = (torch.randn(sum(plan.seq_lens), x, d, device=device, dtype=dtype) for x in (hq, hk, hk))
        lengths = tuple(plan.seq_lens)
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device, torch.int32)

        def plain() -> None:
            o, lse = backend.varlen_forward(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), scale=d ** -0.5,
                                            lengths=lengths)
            backend.varlen_backward(o, q, k, v, o, lse, cu_seqlens=cu, max_seqlen=max(lengths), scale=d ** -0.5,
                                    lengths=lengths)

        single = _ms(plain, 5, cuda)
        ratios.append(engine / single)
        rows.append(f"| {case.name} | {sum(plan.seq_lens)} | {engine:.2f} | {single:.2f} | {engine / single:.2f}x |")
    rows.append("\nBoth ranks run on this one device, one thread each: the engine's time holds every rank's "
                "work and the loopback copies, so it bounds the schedule's overhead, not NCCL's.")
    return SectionResult(True, f"engine / one varlen call: {', '.join(f'{r:.2f}x' for r in ratios)}",
                         "\n".join(rows))


def stream_overlap(trace: dict) -> tuple[float, float]:
    """(µs the transfer lanes were busy, µs of it beside compute kernels on other streams).

    A lane stream is one that ran the sleep kernels standing for a slow link
    (``Delays.transfer_s``: only lanes get them); its busy time is those and its
    copies.  The ranks' own streams copy too (the harness writes q/k/v and clones
    the results), so copying does not make a stream a lane."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "stream" in e.get("args", {})]
    span = lambda e: (e["ts"], e["ts"] + e["dur"], e["args"]["stream"])  # noqa: E731
    kernels = [e for e in events if e.get("cat") == "kernel"]
    sleeps = [e for e in kernels if any(w in e.get("name", "").lower() for w in ("sleep", "spin"))]
    lanes = {e["args"]["stream"] for e in sleeps}
    copies = [e for e in events if e["args"]["stream"] in lanes
              and (e.get("cat") in ("gpu_memcpy", "gpu_memset") or "Memcpy" in e.get("name", ""))]
    busy = [span(e) for e in (*sleeps, *copies)]
    compute = [span(e) for e in kernels if e["args"]["stream"] not in lanes]
    total = overlap = 0.0
    for start, end, stream in busy:
        total += end - start
        spans = sorted((max(s, start), min(e, end)) for s, e, _ in compute if s < end and e > start)
        cursor = start
        for s, e in spans:
            s = max(s, cursor)
            if e > s:
                overlap += e - s
                cursor = e
    return total, overlap


def section_concurrency(args: Any, dry_run: bool = False) -> SectionResult:
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    device, streams, _, scale, heads, _ = _env(dry_run)
    cuda = device.type == "cuda"
    # LLaMA-7B heads and the overhead section's sizes: each rank's local work (milliseconds
    # of kernels) outlasts the host's latency in starting a transfer, so there is work to
    # fill the transfer with; every transfer held 0.2 ms on its lane (a slow link).
    case = cases(scale * (16 if cuda else 1))[1]
    slow = Delays(transfer_s=0.0002 if cuda else 0.0)
    h = Harness(case, device, torch.bfloat16 if cuda else torch.float32, streams, slow,
                (32, 8, 128) if cuda else heads)
    h.run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        h.run()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        total, overlap = stream_overlap(json.loads(path.read_text()))
    if not cuda:
        return SectionResult(True, "dry run: the profiled ring ran on CPU (no CUDA streams to overlap)", "")
    share = 100 * overlap / total if total else 0.0
    return SectionResult(total > 0 and overlap > 0, f"{share:.0f} % of transfer time beside compute kernels",
                         f"torch.profiler over *{case.name}*, every transfer held 0.2 ms on its lane (a slow "
                         f"link): the lanes were busy {total / 1e3:.2f} ms, {overlap / 1e3:.2f} ms of it beside "
                         f"compute kernels on the ranks' streams ({share:.1f} %).")


SECTIONS = {"delays": section_delays, "syncs": section_syncs, "overhead": section_overhead,
            "concurrency": section_concurrency}


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/stream_checks.py [--dry-run] [SECTION ...]``: the engine
    sections alone (``gpu_check`` runs them with the rest)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors under the recording checker")
    ap.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)} (default: all)")
    args = ap.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    args.sections = args.sections or list(SECTIONS)
    if not args.dry_run and not torch.cuda.is_available():
        print("stream_checks: no CUDA GPU here; pass --dry-run to run the sections on CPU")
        return 0
    failed = 0
    for name in args.sections:
        t0 = time.perf_counter()
        result = SECTIONS[name](args, dry_run=args.dry_run)
        failed += not result.passed
        print(f"## {name}: {'PASS' if result.passed else 'FAIL'} ({time.perf_counter() - t0:.0f} s): "
              f"{result.figure}\n\n{result.body}\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
