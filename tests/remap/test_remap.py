"""Remapping layer: index maps on random plans (pure), there-and-back identity of
values and gradients over gloo (4 ranks = 2 nodes x 2 GPUs, spawned once)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.comm.direct import DirectCommunicator
from megatron_zeppelin.comm.routing import RoutedCommunicator
from megatron_zeppelin.errors import ConfigError, PlanError
from megatron_zeppelin.plan import Mode, Plan, Span
from megatron_zeppelin.plan.plan import placement
from megatron_zeppelin.remap import (RemapCounters, ZeppelinRemap, build_exchange, pad_rows,
                                     remap_module_spec, remap_tokens, with_remap)
from megatron_zeppelin.step_context import StepContext, bind_step_context
from megatron_zeppelin.topology import Topology
from tests.distributed import world_fixture

WORLD, GPN = 4, 2
world = world_fixture(WORLD)


def random_plan(seed: int, world_size: int = WORLD, gpus_per_node: int = GPN) -> Plan:
    """Random attention placements (local / zigzag ring / ulysses) and a random
    linear layout: the batch's tokens cut at random points, spans shuffled per rank."""
    rng = random.Random(seed)
    lens = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 7))]
    attention = []
    for seq, L in enumerate(lens):
        k = rng.randrange(2, world_size + 1)
        mode = rng.choice([Mode.LOCAL, Mode.RING, Mode.ULYSSES]) if L >= 2 * k else Mode.LOCAL
        ranks = rng.sample(range(world_size), 1 if mode is Mode.LOCAL else k)
        attention.append(placement(seq, L, mode, ranks))
    rng.shuffle(attention)
    order = rng.sample(range(len(lens)), len(lens))
    tokens = [(seq, t) for seq in order for t in range(lens[seq])]
    cuts = sorted(rng.randrange(len(tokens) + 1) for _ in range(world_size - 1))
    linear = []
    for lo, hi in zip([0, *cuts], [*cuts, len(tokens)]):
        spans, i = [], lo
        while i < hi:
            seq, start = tokens[i]
            end = min(hi, i + lens[seq] - start)
            spans.append(Span(seq, start, start + end - i))
            i = end
        rng.shuffle(spans)
        linear.append(tuple(spans))
    return Plan("random", world_size, gpus_per_node, tuple(lens), tuple(attention),
                tuple(linear)).validate()


def token_ids(spans) -> list[tuple[int, int]]:
    return [(sp.seq, t) for sp in spans for t in range(sp.start, sp.end)]


def features(spans, seed: int, width: int = 3) -> torch.Tensor:
    """[t + pad, 2, width]: a deterministic vector per (seq, position), zero padding rows."""
    ids = token_ids(spans)
    rows = [torch.Generator().manual_seed(seed * 7919 + s * 1009 + t) for s, t in ids]
    x = torch.stack([torch.randn(2, width, generator=g) for g in rows]) if ids else torch.empty(0, 2, width)
    return torch.cat([x, torch.zeros(pad_rows(len(ids)), 2, width)])


# ------------------------------------------------------------------ pure maps
@settings(max_examples=80, deadline=None)
@given(st.integers(0, 100_000))
def test_exchange_maps_move_every_token_to_its_linear_owner(seed):
    plan = random_plan(seed)
    exs = [build_exchange(plan, r) for r in range(WORLD)]
    attn = [token_ids(plan.attention_spans(r)) for r in range(WORLD)]
    got = [[None] * ex.linear_tokens for ex in exs]
    for r, ex in enumerate(exs):
        for a, l in zip(ex.keep_attn.tolist(), ex.keep_linear.tolist()):
            got[r][l] = attn[r][a]
    for mid, (src, dst, n) in enumerate(exs[0].pairs):
        assert src != dst and n == len(exs[src].send_rows[mid]) == len(exs[dst].recv_rows[mid])
        for a, l in zip(exs[src].send_rows[mid].tolist(), exs[dst].recv_rows[mid].tolist()):
            got[dst][l] = attn[src][a]
    assert got == [token_ids(plan.linear[r]) for r in range(WORLD)]
    moved = sum(n for _, _, n in exs[0].pairs)
    assert moved == sum(t.length for t in plan.remap_schedule())


def test_broken_linear_layout_is_a_plan_error():
    plan = random_plan(3)
    broken = Plan(plan.strategy, WORLD, GPN, plan.seq_lens, plan.attention,
                  (plan.linear[0][1:],) + plan.linear[1:])
    with pytest.raises(PlanError, match="validate"):
        for r in range(WORLD):
            build_exchange(broken, r)


class _NoComm:
    """A communicator for one rank: rounds must be empty."""

    counters = ByteCounters()

    def start_round(self, messages, sends, recvs, *, routed=True):
        assert not messages
        return self

    def wait(self):
        pass


def _one_rank_plan() -> Plan:
    # One rank, linear order reversed: the switch is a pure local permutation.
    attention = (placement(0, 5, Mode.LOCAL, [0]), placement(1, 3, Mode.LOCAL, [0]))
    return Plan("perm", 1, 1, (5, 3), attention, ((Span(1, 0, 3), Span(0, 0, 5)),)).validate()


def test_buffer_limit_is_a_config_error():
    plan = _one_rank_plan()
    x = torch.zeros(8, 1, 64)
    with pytest.raises(ConfigError, match="exceeds the limit of 1000 bytes"):
        remap_tokens(x, plan=plan, rank=0, comm=_NoComm(), direction="to_linear", max_buffer_bytes=1000)
    assert remap_tokens(x, plan=plan, rank=0, comm=_NoComm(), direction="to_linear",
                        max_buffer_bytes=8 * 64 * 4).shape == (8, 1, 64)
    with pytest.raises(ValueError, match="direction must be"):
        ZeppelinRemap("sideways")


class _RecordingMLP(torch.nn.Module):
    """Stands in for Megatron's MLP: (output, bias), records what it saw."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(width, width, bias=False)
        self.seen = None

    def forward(self, hidden_states, padding_mask=None):
        self.seen = hidden_states.detach().clone()
        return self.linear_fc1(hidden_states), None


def test_mlp_mixin_runs_on_the_linear_layout_and_keeps_parameter_names():
    from dataclasses import dataclass

    @dataclass
    class Spec:  # the shape of Megatron's ModuleSpec
        module: type
        params: dict

    spec = remap_module_spec(Spec(_RecordingMLP, {}))
    assert spec.module is with_remap(_RecordingMLP) and issubclass(spec.module, _RecordingMLP)
    mlp = spec.module(4)
    assert [n for n, _ in mlp.named_parameters()] == ["linear_fc1.weight"]
    x = torch.arange(8 * 4, dtype=torch.float32).view(8, 1, 4).requires_grad_()
    with pytest.raises(ConfigError, match="ZeppelinRemap ran without a Zeppelin step context"):
        mlp(x)  # never an identity that silently skips the remap
    assert bind_step_context(mlp, StepContext(None, 0, None, None)) == 2
    with pytest.raises(ConfigError, match="ZeppelinRemap needs a Plan"):
        mlp(x)
    plan = _one_rank_plan()
    context = StepContext(plan, 0, _NoComm(), None)
    assert bind_step_context(mlp, context) == 2
    out, _ = mlp(x)
    assert [k[0] for k in context.cache] == ["remap_exchange"]  # derived maps live on the context
    assert torch.equal(mlp.seen, torch.cat([x[5:], x[:5]]).detach())  # seq 1 first on the linear layout
    assert torch.allclose(out, mlp.linear_fc1(x))  # and back to the attention layout
    out.sum().backward()
    assert torch.allclose(x.grad, mlp.linear_fc1.weight.sum(0).expand(8, 1, 4))


def test_mlp_factory_partial_of_megatron_0_19_is_rebound_to_the_remap_class():
    import functools

    class FactoryMLP(_RecordingMLP):
        @classmethod
        def as_mlp_submodule(cls, submodules, config, **_):  # the shape of MLP.as_mlp_submodule
            return cls(submodules)

    spec = remap_module_spec(functools.partial(FactoryMLP.as_mlp_submodule, submodules=4))
    mlp = spec(config=None, pg_collection=None, is_mtp_layer=False)
    assert type(mlp) is with_remap(FactoryMLP) and hasattr(mlp, "to_linear")
    assert [n for n, _ in mlp.named_parameters()] == ["linear_fc1.weight"]
    with pytest.raises(ConfigError, match="remap off"):
        remap_module_spec(functools.partial(lambda **kw: None, submodules=4))
    # 0.19's MoE spec: partial(MoELayer, submodules=...), the class itself.
    moe = remap_module_spec(functools.partial(_RecordingMLP, 4))
    assert moe.func is with_remap(_RecordingMLP) and moe.args == (4,)


# ------------------------------------------------------------- multi-process
def _communicator(rank, routed):
    topo = Topology(nodes=WORLD // GPN, gpus_per_node=GPN, nics_per_node=2)
    return (RoutedCommunicator(None, topo, ByteCounters(), 0, dtype=torch.float32) if routed
            else DirectCommunicator(None, topology=topo))


def _check_there_and_back(plan, rank, comm, seed, counters, width=3, cache=None):
    """Rows of ``width`` there and back with the backward: values and gradients exact."""
    x = features(plan.attention_spans(rank), seed, width).requires_grad_()
    y = remap_tokens(x, plan=plan, rank=rank, comm=comm, direction="to_linear", counters=counters, cache=cache)
    assert torch.equal(y, features(plan.linear[rank], seed, width)), "values on the linear layout"
    w = features(plan.linear[rank], seed + 1, width)
    z = remap_tokens(y * w, plan=plan, rank=rank, comm=comm, direction="to_attention",
                     counters=counters, cache=cache)
    assert torch.equal(z, x.detach() * features(plan.attention_spans(rank), seed + 1, width))
    g = features(plan.attention_spans(rank), seed + 2, width)
    (z * g).sum().backward()
    # d/dx of sum(g * back(w * there(x))) = w (in attention order) * g
    assert torch.equal(x.grad, features(plan.attention_spans(rank), seed + 1, width) * g), "gradients"


def _there_and_back(rank, world_size, seeds, routed, widths=(3,), step_cache=False):
    """Rows of each of ``widths`` there and back, per plan; ``step_cache``: with
    one cache per plan, as a step's switches run (later ones reuse prepared rounds)."""
    comm = _communicator(rank, routed)
    out = []
    for seed in seeds:
        plan, cache, counters = random_plan(seed), {} if step_cache else None, RemapCounters()
        for width in widths:
            _check_there_and_back(plan, rank, comm, seed, counters, width, cache)
        out.append((counters.remap_intra_node, counters.remap_inter_node))
    if routed:
        comm.close()
    return out


def expected_remap_bytes(plan: Plan, rank: int, row_bytes: int) -> tuple[int, int]:
    """Bytes ``rank`` sends over one there-and-back with its backward (4 switches)."""
    intra = inter = 0
    for t in plan.remap_schedule():
        for src, dst in ((t.src, t.dst), (t.dst, t.src)):  # to_linear, to_attention
            if src == rank:
                n = 2 * t.length * row_bytes  # forward and backward move the same rows
                if src // GPN == dst // GPN:
                    intra += n
                else:
                    inter += n
    return intra, inter


def _check_remap_bytes(results, seeds, routed, widths=(3,)):
    for i, seed in enumerate(seeds):
        got = [per_seed[i] for per_seed in results]
        want = [tuple(map(sum, zip(*(expected_remap_bytes(random_plan(seed), rank, 2 * w * 4) for w in widths))))
                for rank in range(WORLD)]
        if not routed:  # the communicator counts exactly the schedule's messages, per sender
            assert got == want
        else:
            # Routed: every inter-node byte still crosses once (through some proxy's NIC),
            # and the dispatch / combine hops add intra-node bytes.
            assert sum(g[1] for g in got) == sum(w[1] for w in want)
            assert sum(g[0] for g in got) >= sum(w[0] for w in want)
    assert any(inter for per_seed in results for _, inter in per_seed)  # some plan crossed nodes


@pytest.mark.parametrize("routed", [False, True], ids=["direct", "routed"])
def test_remap_there_and_back_is_the_identity(world, routed):
    seeds = list(range(20, 32))
    _check_remap_bytes(world.run(_there_and_back, seeds, routed), seeds, routed)


@pytest.mark.parametrize("routed", [False, True], ids=["direct", "routed"])
def test_switches_of_two_row_sizes_in_one_step(world, routed):
    """One step's switches (one cache) of rows of 3, then 5, then 3 elements: the
    step's later switches reuse prepared rounds, which must be the right
    direction's and row size's (values, gradients and bytes exact)."""
    seeds, widths = list(range(40, 46)), (3, 5, 3)
    _check_remap_bytes(world.run(_there_and_back, seeds, routed, widths, True), seeds, routed, widths)


class _RecordingRunner:
    """A lane runner that records what each round would run and moves nothing."""

    stream = None

    def __init__(self) -> None:
        self.started = []

    def start(self, schedule, binding, recorder=None):
        self.started.append((schedule, binding.ids))


@pytest.mark.parametrize("routed", [False, True], ids=["direct", "routed"])
def test_prepared_round_is_the_one_of_its_direction_and_row_size(routed):
    """Every switch of a step starts the round an uncached build gives for its
    direction and row size; the repeats reuse the prepared one (same objects)."""
    from megatron_zeppelin.comm.rounds import LaneCommunicator, _round_schedule
    from megatron_zeppelin.remap.remap import layout_move

    plan, rank = next((p, r) for p in map(random_plan, range(100)) for r in range(WORLD)
                      if sum(r in (s, d) for s, d, _ in build_exchange(p, r).pairs) >= 2)
    topo = Topology(nodes=WORLD // GPN, gpus_per_node=GPN, nics_per_node=2)
    comm, runner = LaneCommunicator.__new__(LaneCommunicator), _RecordingRunner()
    comm._bind(None, rank, topo, ByteCounters(), 0 if routed else math.inf, torch.float32,
               torch.device("cpu"), runner)
    cache = {}
    # Rows of 3 and 5 both ways, then again; then rows of 3 in float64: a direct
    # round sizes its messages by the tensors (the same tuple, another round).
    calls = [("to_linear", 3, 4), ("to_attention", 3, 4), ("to_linear", 5, 4), ("to_attention", 5, 4)] * 2
    calls.append(("to_linear", 3, 4 if routed else 8))
    for direction, width, _ in calls:
        tokens = len(token_ids(plan.attention_spans(rank) if direction == "to_linear" else plan.linear[rank]))
        layout_move(plan=plan, rank=rank, comm=comm, direction=direction, device=torch.device("cpu"),
                    cache=cache)(torch.zeros(tokens + pad_rows(tokens), width,
                                             dtype=torch.float64 if len(runner.started) == 8 else torch.float32))
    pairs = build_exchange(plan, rank).pairs
    transport = comm.transport_for(True)
    for (direction, width, itemsize), (schedule, ids) in zip(calls, runner.started, strict=True):
        sizes = tuple((i, *((s, d) if direction == "to_linear" else (d, s)), n * width, itemsize)
                      for i, (s, d, n) in enumerate(pairs))
        want, want_ids = _round_schedule(sizes, transport, WORLD, rank)
        assert schedule.ops == want.ops and ids == want_ids
        assert schedule.ops, "the rank sends or receives in every round"
    assert all(a is b for (a, _), (b, _) in zip(runner.started[4:8], runner.started[:4])), "prepared once"
    assert len({id(s) for s, _ in runner.started[:4]}) == 4
