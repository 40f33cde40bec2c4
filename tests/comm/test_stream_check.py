"""The CUDA branch's stream protocol, checked on CPU by the recording streams.

The engine runs unchanged on :class:`RecordingStreams`: every kernel, event,
wait and ``record_stream`` is recorded with vector clocks, and any read of
bytes another stream wrote (or a free of a block another stream may still
touch) that CUDA would not order is a violation.  Random plans (every tier,
routing on and off, Ulysses, remap) run forward and backward on threads over
the loopback transport (NCCL's stream semantics) and on gloo ranks; each must
give 0 violations *and* the reference's numbers.  The checker's own rules are
tested on hand-made races, so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_zeppelin.attention import plan_attention
from megatron_zeppelin.attention.backends import TorchBackend
from megatron_zeppelin.comm.direct import DirectCommunicator
from megatron_zeppelin.comm.routing import RoutedCommunicator
from megatron_zeppelin.comm.stream_check import OrderingViolation, RecordingStreams
from megatron_zeppelin.comm.streams import CudaStreams, HostStreams
from megatron_zeppelin.plan import Mode
from megatron_zeppelin.remap.remap import remap_tokens
from megatron_zeppelin.topology import Topology
from tests.attention.helpers import make_plan, random_plan, random_sequences, reference
from tests.distributed import world_fixture

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import stream_checks  # noqa: E402  (benchmarks/ is on the path only now)
from loopback import Delays  # noqa: E402

world = world_fixture(4)


# --------------------------------------------------------------- the checker
def test_an_unordered_read_of_another_streams_write_is_caught():
    s = RecordingStreams()
    a, b = s.new_stream(), s.new_stream()
    with s.use(a):
        x = torch.ones(8)
    with s.use(b):
        x.sum()
    with pytest.raises(OrderingViolation, match="reads bytes"):
        s.check()


def _written_then_awaited() -> tuple[RecordingStreams, object, object, torch.Tensor]:
    """Stream a writes ``x``; stream b waits on a's event after it."""
    s = RecordingStreams()
    a, b = s.new_stream(), s.new_stream()
    with s.use(a):
        x = torch.ones(8)
        ev = s.new_event()
        s.record(ev, a)
    s.wait_event(b, ev)
    return s, a, b, x


def test_an_event_wait_orders_the_read():
    s, a, b, x = _written_then_awaited()
    with s.use(b):
        y = x[4:] * 2
    with s.use(a):
        x[:4].zero_()                       # bytes b never read: no race
    s.check()
    with s.use(a):
        x[4:].zero_()                       # bytes b read, and a never waited on b
    with pytest.raises(OrderingViolation, match="writes bytes"):
        s.check()
    assert s.kernels >= 4 and y.shape == (4,)


def test_waiting_on_an_event_never_recorded_orders_nothing():
    s = RecordingStreams()
    a, b = s.new_stream(), s.new_stream()
    with s.use(a):
        x = torch.ones(8)
    s.wait_event(b, s.new_event())
    with s.use(b):
        x.add_(1)
    with pytest.raises(OrderingViolation, match="writes bytes"):
        s.check()


def test_a_free_under_another_streams_read_is_caught_unless_record_stream():
    for record in (False, True):
        s, a, b, x = _written_then_awaited()
        with s.use(b):
            x.sum()
            if record:
                s.record_stream(x, b)
        del x
        if record:
            s.check()
        else:
            with pytest.raises(OrderingViolation, match="freed while"):
                s.check()


class _Fake:
    def __init__(self) -> None:
        self.calls = []

    def __getattr__(self, name):
        return lambda *a: self.calls.append((name, a))


def test_the_cuda_implementation_calls_torch_cuda_as_declared():
    """``CudaStreams`` is torch.cuda itself (no GPU needed to see which call it makes)."""
    s = CudaStreams(torch.device("cuda", 0))
    stream, event, tensor = _Fake(), _Fake(), _Fake()
    s.wait_event(stream, event)
    s.record(event, stream)
    s.record_stream(tensor, stream)
    assert stream.calls == [("wait_event", (event,))]
    assert event.calls == [("record", (stream,))]
    assert tensor.calls == [("record_stream", (stream,))]
    host = HostStreams()
    assert host.fired(host.new_event()) and host.current_stream() is host.current_stream()


# --------------------------------------------------------- the engine on it
@pytest.mark.parametrize("case", range(8))
def test_harness_plans_under_delays_have_no_violation(case):
    """gpu_check's delay plans (local, rings of 2 and 4, Ulysses, two nodes routed,
    remap both ways, a packed ring, a packed Ulysses group) on CPU: equal to fp32
    attention, 0 violations."""
    streams = RecordingStreams()
    plan_case = stream_checks.cases(3)[case]
    for delays in (Delays(), Delays(caller_s=0.001, transfer_s=0.001, compute_s=0.001)):
        h = stream_checks.Harness(plan_case, torch.device("cpu"), torch.float32, streams, delays, (4, 2, 8))
        errors = h.errors(h.run())
        assert max(errors.values()) < 1e-4, errors
    streams.check()
    assert streams.kernels > 50


@pytest.mark.parametrize("case", [2, 4])
def test_bf16_dkv_rounded_on_the_lane_has_no_violation(case):
    """bf16 rings under the default ring_grad_dtype (model): each dK/dV sum is
    rounded to bf16 on the lane that sends it (a tensor made on that lane, read by
    a routed message's other lane): 0 violations, within bf16 tolerance."""
    streams = RecordingStreams()
    plan_case = stream_checks.cases(3)[case]
    h = stream_checks.Harness(plan_case, torch.device("cpu"), torch.bfloat16, streams, Delays(), (4, 2, 8))
    assert max(h.errors(h.run()).values()) < stream_checks.TOLERANCE[torch.bfloat16]
    streams.check()
    assert streams.kernels > 50


@pytest.mark.parametrize("seed", range(4))
def test_random_plans_on_threads_have_no_violation(seed):
    """Random plans over 2 nodes x 2 GPUs (every tier, Ulysses), routing on and off."""
    rng = random.Random(seed)
    topo = Topology(nodes=2, gpus_per_node=2, nics_per_node=2)
    plan = random_plan(rng, topo, n_seqs=6)
    case = stream_checks.Case(f"random {seed}", plan, topo, 0.0 if seed % 2 else float("inf"))
    streams = RecordingStreams()
    h = stream_checks.Harness(case, torch.device("cpu"), torch.float32, streams, Delays(), (4, 2, 8))
    assert max(h.errors(h.run()).values()) < 1e-4
    streams.check()


def _gloo_case(rank, world_size, seed, routed):
    """plan_attention through autograd, then remap there and back, on gloo ranks
    with the recording streams behind the lanes."""
    topo = Topology(nodes=2, gpus_per_node=2, nics_per_node=2)
    plan = random_plan(random.Random(seed), topo, n_seqs=5)
    streams = RecordingStreams()
    comm = (RoutedCommunicator(None, topo, None, 0, streams=streams) if routed
            else DirectCommunicator(None, topo, streams=streams))
    seqs = random_sequences(plan, 4, 2, 8, torch.float64, seed)
    spans = plan.attention_spans(rank)
    q, k, v, dout = (torch.cat([seqs[sp.seq][i][sp.start:sp.end] for sp in spans]) if spans
                     else seqs[0][i][:0] for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    with streams.use(streams.caller()):
        out = plan_attention(q, k, v, plan=plan, rank=rank, comm=comm, backend=TorchBackend())
        hidden = out.reshape(out.shape[0], -1)
        padded = torch.cat([hidden, hidden.new_zeros((0 if hidden.shape[0] else 1, hidden.shape[1]))])
        there = remap_tokens(padded, plan=plan, rank=rank, comm=comm, direction="to_linear")
        back = remap_tokens(there, plan=plan, rank=rank, comm=comm, direction="to_attention")
        back[:out.shape[0]].reshape(out.shape).backward(dout)
    comm.close()
    refs = reference(seqs)
    want = [torch.cat([refs[sp.seq][i][sp.start:sp.end] for sp in spans]) if spans else None for i in range(4)]
    if spans:
        for got, w in zip((out.detach(), q.grad, k.grad, v.grad), want):
            torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-9)
    return streams.violations[:5], streams.kernels


@pytest.mark.parametrize("routed", [False, True])
def test_gloo_ranks_through_autograd_have_no_violation(world, routed):
    for seed in (11, 12):
        for violations, kernels in world.run(_gloo_case, seed, routed):
            assert violations == [] and kernels > 0


# ------------------------------------------------------ transfers in waves
def test_a_ring_step_is_one_wave_and_tiers_use_their_own_lanes():
    """Every transfer of a ring step is in one wave (posted as one batch: the
    step's critical path is one transfer, not k); inter-node transfers travel on
    the inter lane and intra-node ones on the intra lane, so neither waits for the other."""
    from megatron_zeppelin.attention import build_schedule
    from megatron_zeppelin.comm.lanes import lane_of
    from megatron_zeppelin.comm.rounds import LaneCommunicator
    from megatron_zeppelin.plan import placement
    from megatron_zeppelin.schedule.attention import AttnShape, Transport

    comm = LaneCommunicator.__new__(LaneCommunicator)        # only its transport is read
    comm.transport = Transport(Topology(nodes=2, gpus_per_node=2, nics_per_node=1))
    plan = make_plan(4, 2, [32, 16], [placement(0, 32, Mode.RING, (0, 1, 2, 3)), placement(1, 16, Mode.RING, (2, 3))])
    sched = build_schedule(plan, AttnShape(4, 2, 8, 4, 4), comm).forward
    for index, k in ((0, 4), (1, 2)):
        for step in range(k - 1):
            ops = [op for op in sched.ops if op.is_comm and sched.messages[op.key[0]][:3] == ("kv", index, step)]
            assert len(ops) == k and {sched.wave(op.id) for op in ops} == {step}
    lanes = {(op.rank // 2 != op.peer // 2, lane_of(op)) for op in sched.ops if op.is_comm}
    assert lanes == {(True, "inter"), (False, "intra")}


class _TimedStreams(HostStreams):
    """Host streams whose events carry a fake device clock: 1 ms per record."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0

    def new_event(self, timing: bool = False):
        return SimpleNamespace(t=None)

    def record(self, event, stream) -> None:
        self.ticks += 1
        event.t = self.ticks

    def elapsed_ms(self, start, end) -> float:
        return float(end.t - start.t)


def test_traces_take_the_devices_times():
    """On CUDA a trace's op times come from timed events (the device's clock), not
    from when the host enqueued the op: every stamp is the call's begin plus the
    events' elapsed time."""
    from loopback import LoopbackCommunicator, LoopbackHub, run_ranks

    from megatron_zeppelin.comm.lanes import StepRecorder

    plan = stream_checks.cases(2)[1].plan                       # a ring of 2 and locals
    streams = _TimedStreams()
    hub = LoopbackHub(2, torch.device("cpu"), streams)
    recorders = [StepRecorder() for _ in range(2)]
    seqs = random_sequences(plan, 4, 2, 8, torch.float32, 0)

    def rank(r):
        comm = LoopbackCommunicator(hub, r)
        comm.recorder = recorders[r]
        spans = plan.attention_spans(r)
        q, k, v = (torch.cat([seqs[sp.seq][i][sp.start:sp.end] for sp in spans]) for i in range(3))
        plan_attention(q, k, v, plan=plan, rank=r, comm=comm, backend=TorchBackend())

    run_ranks(hub, rank)
    for rec in recorders:
        (trace,) = rec.calls
        stamps = {**trace.start_ns, **trace.end_ns}.values()
        assert stamps and all((t - trace.begin_ns) % 1_000_000 == 0 and t > trace.begin_ns for t in stamps)


def test_stream_overlap_counts_lane_time_beside_compute():
    """Lane streams are those that ran the slow-link sleeps; their sleeps and copies
    are transfer time; compute is any other kernel on another stream -- a rank's
    stream that also copies (the harness's clones) stays a compute stream."""
    def event(cat, ts, dur, stream, name="k"):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}

    trace = {"traceEvents": [event("kernel", 0, 10, 7), event("kernel", 12, 10, 7),     # compute stream 7
                             event("gpu_memcpy", 40, 5, 7),                            # a rank's own copy
                             event("gpu_memcpy", 5, 10, 20), event("kernel", 30, 4, 20, "spin_kernel"),
                             event("kernel", 20, 4, 20, "spin_kernel"),
                             event("gpu_memcpy", 50, 4, 30)]}                          # no sleeps: not a lane
    assert stream_checks.stream_overlap(trace) == (18, 5 + 3 + 2)


class _SlowEventStreams(HostStreams):
    """Host streams whose events report "not yet" a few times (a transfer in flight)."""

    def new_event(self, timing: bool = False):
        return SimpleNamespace(asked=0)

    def fired(self, event) -> bool:
        event.asked += 1
        return event.asked > 3


def test_local_work_runs_while_a_ring_step_waits_for_its_transfer():
    """Rule 3: the compute lane runs the first op whose inputs have fired, so a ring
    step whose K/V is still in flight does not hold local work behind it, although
    the ring step comes first in lane order (on CUDA it would sit at the head of the
    compute stream, waiting)."""
    from loopback import LoopbackCommunicator, LoopbackHub, run_ranks

    from megatron_zeppelin.comm.lanes import StepRecorder

    plan = stream_checks.cases(2)[1].plan                       # a ring of 2 and locals on both ranks
    hub = LoopbackHub(2, torch.device("cpu"), _SlowEventStreams())
    recorders = [StepRecorder() for _ in range(2)]
    seqs = random_sequences(plan, 4, 2, 8, torch.float32, 0)
    schedules = {}

    def rank(r):
        comm = LoopbackCommunicator(hub, r)
        comm.recorder = recorders[r]
        spans = plan.attention_spans(r)
        q, k, v = (torch.cat([seqs[sp.seq][i][sp.start:sp.end] for sp in spans]) for i in range(3))
        plan_attention(q, k, v, plan=plan, rank=r, comm=comm, backend=TorchBackend(), cache=schedules.setdefault(r, {}))

    run_ranks(hub, rank)
    for r, rec in enumerate(recorders):
        (trace,) = rec.calls
        (layer,) = [v for k, v in schedules[r].items() if k[0] == "layer_schedules"]
        compute = layer.forward.lanes(r).compute
        waiting = [op for op in compute if op.key[0] == "ring" and op.deps]        # steps after the first
        local = [op for op in compute if op.key[0] == "local"]
        assert waiting and local and compute.index(waiting[0]) < compute.index(local[0])   # lane order: ring first
        assert trace.start_ns[local[0].id] < trace.start_ns[waiting[0].id]                 # run order: local first


def test_a_failing_kernel_ends_the_call_at_once():
    """A compute op that raises stops the lanes waiting on it: the call ends with
    that error now, not at the transfer deadline (60 s here)."""
    import time

    from loopback import LoopbackCommunicator, LoopbackHub, run_ranks

    from megatron_zeppelin.attention.backends import TorchBackend as Kernels

    class Broken(Kernels):               # the backward's dK/dV sends wait on its compute ops
        def backward(self, *args, **kwargs):
            raise RuntimeError("kernel failed")

    plan = stream_checks.cases(2)[1].plan
    hub = LoopbackHub(2, torch.device("cpu"))
    seqs = random_sequences(plan, 4, 2, 8, torch.float32, 0)

    def rank(r):
        comm = LoopbackCommunicator(hub, r, timeout=__import__("datetime").timedelta(seconds=60))
        spans = plan.attention_spans(r)
        q, k, v = (torch.cat([seqs[sp.seq][i][sp.start:sp.end] for sp in spans]).requires_grad_()
                   for i in range(3))
        plan_attention(q, k, v, plan=plan, rank=r, comm=comm, backend=Broken()).sum().backward()

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="kernel failed"):
        run_ranks(hub, rank)
    assert time.monotonic() - t0 < 20


def _inter_group_case(rank, world_size):
    """A communicator given a second group runs its inter-node lane on it (NCCL: a
    communicator of its own); a routed round still lands every message."""
    import torch.distributed as dist

    from megatron_zeppelin.comm.base import Message

    inter = dist.new_group(list(range(world_size)))        # collective, as data_parallel_lane_groups
    topo = Topology(nodes=2, gpus_per_node=2, nics_per_node=2)
    comm = RoutedCommunicator(None, topo, None, 0, inter_group=inter)
    lanes = {lane: p2p.group for lane, p2p in comm.runner.p2p.items()}
    messages = [Message(i, src, (src + 2) % 4, 8) for i, src in enumerate(range(4))]   # every one crosses nodes
    sends = {m.id: torch.full((8,), float(m.src)) for m in messages if m.src == rank}
    recvs = {m.id: torch.empty(8) for m in messages if m.dst == rank}
    comm.start_round(messages, sends, recvs).wait()
    inter_bytes = sum(comm.counters.inter_node_per_nic.values())
    comm.close()
    return lanes["inter"] is inter, lanes["intra"] is None, {m: t.tolist() for m, t in recvs.items()}, inter_bytes


def test_the_inter_lane_runs_on_its_own_group(world):
    for rank, (own, intra_default, got, inter_bytes) in enumerate(world.run(_inter_group_case)):
        assert own and intra_default and inter_bytes > 0
        src = (rank + 2) % 4
        assert got == {src: [float(src)] * 8}
