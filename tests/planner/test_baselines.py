"""Baseline planners: te_cp, packing_dp, megatron_hybrid_cp, flexsp."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import itertools
import math
import pathlib
import random
import types
from collections import deque
from typing import Callable, List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.tp import tp_view
from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Mode
from megatron_zeppelin.planner.base import PlanContext, get_planner
from megatron_zeppelin.planner.flexsp import (SeqTime, bucket_lengths, greedy_groups, seq_time_fn, solve_milp,
                                              ulysses_sizes)
from megatron_zeppelin.planner.hybrid_cp import gpus_needed, hybrid_cp_rounds
from megatron_zeppelin.planner.te_cp import te_cp_size
from megatron_zeppelin.topology import Topology, load_cluster

BASELINES = ("te_cp", "packing_dp", "megatron_hybrid_cp", "flexsp")
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLUSTER = load_cluster("h100-8x400g")


def make_ctx(nodes: int, gpus_per_node: int, cap: int, model: str = "llama-7b", **kw) -> PlanContext:
    topo = Topology(nodes=nodes, gpus_per_node=gpus_per_node, nics_per_node=1)
    cost = CostModel(dataclasses.replace(CLUSTER, topology=topo), load_model(model))
    return PlanContext(cost=cost, tokens_per_gpu=cap, **{"time_limit_s": 2.0, **kw})


@st.composite
def batches(draw, max_world: int = 8):
    """A topology, a per-GPU cap and a batch whose total fits the cluster."""
    gpn = draw(st.sampled_from([1, 2, 4]))
    nodes = draw(st.integers(1, max(1, max_world // gpn)))
    cap = draw(st.integers(8, 200))
    world = nodes * gpn
    lens = draw(st.lists(st.integers(1, cap * world), min_size=1, max_size=12))
    budget = cap * world // 2  # half full: feasibility should not hinge on bin-packing luck
    kept, total = [], 0
    for L in lens:
        if total + L <= budget:
            kept.append(L)
            total += L
    return nodes, gpn, cap, kept or [1]


def groups_of(plan) -> dict[tuple[int, ...], list[int]]:
    """Rank sets of the placements (a local placement is a group of one)."""
    out: dict[tuple[int, ...], list[int]] = {}
    for p in plan.attention:
        out.setdefault(tuple(p.ranks), []).append(p.seq)
    return out


# ------------------------------------------------------------------ all baselines
@FAST
@given(batches(), st.sampled_from(BASELINES))
def test_plans_validate_or_are_infeasible(case, name):
    nodes, gpn, cap, lens = case
    ctx = make_ctx(nodes, gpn, cap)
    try:
        plan = get_planner(name).plan(lens, ctx)
    except InfeasibleError as exc:
        assert str(exc).startswith(f"{name}: ")
        return
    assert plan.strategy == name
    assert plan.seq_lens == tuple(lens)
    plan.validate()
    # No remap: the linear layout is the attention layout.
    assert plan.remap_schedule() == []
    assert plan.attention_tokens_per_rank() == plan.linear_tokens_per_rank()


@pytest.mark.parametrize("name", BASELINES)
def test_deterministic(name):
    lens = [3000, 17, 900, 900, 2500, 64, 1200, 5, 700, 410]
    ctx = make_ctx(2, 4, 4096)
    first = get_planner(name).plan(lens, ctx).to_json()
    assert get_planner(name).plan(list(lens), ctx).to_json() == first


# -------------------------------------------------------------------------- te_cp
def test_te_cp_size_rule():
    assert te_cp_size([100], 32, 8) == 4          # ceil(100/2) = 50 > 32, ceil(100/4) = 25
    assert te_cp_size([32, 5], 32, 8) == 1
    assert te_cp_size([100], 32, 12) == 4         # 4 divides 12
    with pytest.raises(InfeasibleError):
        te_cp_size([200], 32, 12)                 # needs 8, which does not divide 12; 16 > 12
    assert te_cp_size([10_000], 32, 8, cp_size=2) == 2   # configured size wins
    with pytest.raises(ConfigError):
        te_cp_size([10], 32, 8, cp_size=3)


def test_te_cp_exact_small_case():
    # 4 GPUs on one node, CP 2: replicas {0,1} and {2,3}; LPT by tokens: 12->A, 8->B,
    # 6->B (14), 3->A (15).  3 tokens cannot make 4 zigzag chunks: local on rank 0.
    plan = get_planner("te_cp").plan([12, 8, 6, 3], make_ctx(1, 4, 10, cp_size=2))
    got = {p.seq: (p.mode, p.ranks) for p in plan.attention}
    assert got == {0: (Mode.RING, (0, 1)), 1: (Mode.RING, (2, 3)), 2: (Mode.RING, (2, 3)),
                   3: (Mode.LOCAL, (0,))}
    assert plan.attention_tokens_per_rank() == [9, 6, 7, 7]


@FAST
@given(batches())
def test_te_cp_splits_every_sequence_over_its_group(case):
    nodes, gpn, cap, lens = case
    ctx = make_ctx(nodes, gpn, cap)
    world = nodes * gpn
    try:
        plan = get_planner("te_cp").plan(lens, ctx)
    except InfeasibleError:
        return
    c = te_cp_size(lens, cap, world)
    assert max(math.ceil(L / c) for L in lens) <= cap
    for p in plan.attention:
        L = plan.seq_lens[p.seq]
        if c > 1 and L >= 2 * c:
            assert p.mode is Mode.RING and p.size == c
            assert p.ranks == tuple(range(p.ranks[0], p.ranks[0] + c)) and p.ranks[0] % c == 0
        else:
            assert p.mode is Mode.LOCAL
    assert max(plan.attention_tokens_per_rank()) <= cap


def test_te_cp_static_size_from_context():
    plan = get_planner("te_cp").plan([100, 100, 40], make_ctx(2, 4, 64, cp_size=8))
    assert {p.size for p in plan.attention} == {8}
    assert plan.tier_counts().inter == 3      # one CP group spanning both nodes
    with pytest.raises(InfeasibleError, match="sequence 0"):
        get_planner("te_cp").plan([300, 10], make_ctx(2, 4, 64, cp_size=2))


# --------------------------------------------------------------------- packing_dp
def test_packing_dp_infeasible_names_sequence():
    with pytest.raises(InfeasibleError, match=r"sequence 1 has 65 tokens.*cap of 64"):
        get_planner("packing_dp").plan([10, 65, 3], make_ctx(1, 4, 64))


def test_packing_dp_infeasible_when_ranks_are_full():
    with pytest.raises(InfeasibleError, match=r"^packing_dp: sequence 2 \(length 6\) does not fit on any rank"):
        get_planner("packing_dp").plan([6, 6, 6], make_ctx(1, 2, 10))


def test_packing_dp_exact_small_case():
    plan = get_planner("packing_dp").plan([5, 4, 3, 3], make_ctx(1, 2, 10))
    assert {p.seq: p.ranks for p in plan.attention} == {0: (0,), 1: (1,), 2: (1,), 3: (0,)}
    assert all(p.mode is Mode.LOCAL for p in plan.attention)


@FAST
@given(batches())
def test_packing_dp_balances_tokens(case):
    nodes, gpn, cap, lens = case
    if max(lens) > cap:
        return
    plan = get_planner("packing_dp").plan(lens, make_ctx(nodes, gpn, cap))
    loads = plan.attention_tokens_per_rank()
    # LPT: the last sequence added to the fullest rank went to the emptiest one.
    assert max(loads) - min(loads) <= max(lens)
    assert sum(loads) == sum(lens)


# ------------------------------------------------------------- megatron_hybrid_cp
@FAST
@given(batches(max_world=16))
def test_hybrid_cp_groups_are_aligned_powers_of_two(case):
    nodes, gpn, cap, lens = case
    world = nodes * gpn
    if world & (world - 1) or max(gpus_needed(L, cap) for L in lens) > world:
        return
    rounds = hybrid_cp_rounds(lens, cap, world)
    assert sorted(s for r in rounds for g in r for s in g.seqs) == list(range(len(lens)))
    for groups in rounds:
        covered = sorted(r for g in groups for r in range(g.first_rank, g.first_rank + g.size))
        assert covered == list(range(world))          # fill_empty_gpus leaves no rank idle
        for g in groups:
            assert g.size & (g.size - 1) == 0 and g.first_rank % g.size == 0
            assert all(gpus_needed(lens[s], cap) <= g.size for s in g.seqs)
    plan = get_planner("megatron_hybrid_cp").plan(lens, make_ctx(nodes, gpn, cap))
    for p in plan.attention:
        L = plan.seq_lens[p.seq]
        need = max(1, 2 ** math.ceil(math.log2(L / cap)))
        assert p.size >= need and math.ceil(L / p.size) <= cap or p.mode is Mode.LOCAL
        assert p.ranks == tuple(range(p.ranks[0], p.ranks[0] + p.size))


def test_hybrid_cp_gpus_needed():
    assert [gpus_needed(L, 100) for L in (1, 100, 101, 200, 201, 800, 801)] == [1, 1, 2, 2, 4, 8, 16]


def megatron_balanced_cp_scheduler():
    """``BalancedCPScheduler`` compiled from the installed Megatron-Core source.

    Only the class is taken (importing ``megatron.core`` costs ~10 s); its
    ``torch.distributed.ProcessGroup`` annotation is the one name it needs from torch."""
    spec = importlib.util.find_spec("megatron")
    path = None if spec is None else next(
        (p for p in (pathlib.Path(d) / "core/pipeline_parallel/hybrid_cp_schedule.py"
                     for d in spec.submodule_search_locations) if p.exists()), None)
    if path is None:
        pytest.skip("megatron-core with hybrid CP (>= 0.16) is not installed")
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BalancedCPScheduler")
    ns = {"deque": deque, "lru_cache": functools.lru_cache, "ceil": math.ceil, "log2": math.log2,
          "Callable": Callable, "List": List, "Optional": Optional, "Tuple": Tuple,
          "torch": types.SimpleNamespace(distributed=types.SimpleNamespace(ProcessGroup=object))}
    exec(compile(ast.Module([cls], []), str(path), "exec"), ns)
    return ns["BalancedCPScheduler"]


def test_hybrid_cp_matches_megatron_scheduler():
    scheduler = megatron_balanced_cp_scheduler()

    class Group:  # the scheduler only asks the DP x CP group for its size
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    for trial in range(300):
        rng = random.Random(trial)
        world, cap = rng.choice([2, 4, 8, 16]), rng.choice([64, 256])
        n, kind = rng.randint(1, 40), trial % 3
        if kind == 0:    # mostly short, a fifth up to the whole world
            lens = [rng.randint(1, cap * world) if rng.random() < 0.2 else rng.randint(1, cap)
                    for _ in range(n)]
        elif kind == 1:  # log-uniform: every CP size appears
            lens = [max(1, int((cap * world) ** rng.random())) for _ in range(n)]
        else:            # uniform up to a random CP size
            lens = [rng.randint(1, cap * rng.choice([c for c in (1, 2, 4, world) if c <= world]))
                    for _ in range(n)]
        _, ids = scheduler(cap, Group(world)).get_groups_and_subsamples(list(enumerate(lens)), None)
        want = []
        for rnd in ids:   # ranks holding identical sub-sample lists form one CP group
            by_list = {tuple(lst): sum(1 for other in rnd if other == lst) for lst in rnd}
            want.append(sorted((n, seqs) for seqs, n in by_list.items()))
        got = [sorted((g.size, tuple(g.seqs)) for g in r) for r in hybrid_cp_rounds(lens, cap, world)]
        assert got == want, (world, cap, lens)


def test_hybrid_cp_infeasible_when_world_too_small():
    with pytest.raises(InfeasibleError, match="megatron_hybrid_cp: sequence 0"):
        get_planner("megatron_hybrid_cp").plan([1000], make_ctx(1, 4, 100))


# -------------------------------------------------------------------------- flexsp
def test_bucket_lengths_minimise_padding():
    rng = random.Random(0)
    for _ in range(60):
        lens = [rng.randint(1, 50) for _ in range(rng.randint(1, 12))]
        k = rng.randint(1, 5)
        buckets = bucket_lengths(lens, 10**9, k)
        values = sorted(set(lens))
        assert len(buckets) == min(k, len(values))
        assert sorted(s for b in buckets for s in b.seqs) == list(range(len(lens)))
        assert all(b.shortest <= lens[s] <= b.boundary for b in buckets for s in b.seqs)
        pad = sum(b.boundary - lens[s] for b in buckets for s in b.seqs)
        def padding(lo: int, hi: int) -> int:   # one bucket over values[lo:hi]
            inside = [L for L in lens if values[lo] <= L <= values[hi - 1]]
            return values[hi - 1] * len(inside) - sum(inside)
        best = min(sum(padding(lo, hi) for lo, hi in zip((0,) + cuts, cuts + (len(values),)))
                   for cuts in itertools.combinations(range(1, len(values)), len(buckets) - 1))
        assert pad == best


def test_bucket_lengths_adds_buckets_until_padding_is_small():
    lens = list(range(1, 101))
    assert len(bucket_lengths(lens, capacity=sum(lens), min_buckets=2)) == 100  # exact needed
    assert len(bucket_lengths(lens, capacity=10**9, min_buckets=2)) == 2


def test_ulysses_sizes_divide_kv_heads():
    assert ulysses_sizes(16, 32) == [1, 2, 4, 8, 16]
    assert ulysses_sizes(64, 2) == [1, 2]
    assert ulysses_sizes(24, 8) == [1, 2, 4, 8]


@FAST
@given(batches())
def test_flexsp_groups_fit_world_and_memory(case):
    nodes, gpn, cap, lens = case
    ctx = make_ctx(nodes, gpn, cap, time_limit_s=1.0)
    world = nodes * gpn
    try:
        plan = get_planner("flexsp").plan(lens, ctx)
    except InfeasibleError as exc:
        assert "flexsp" in str(exc)
        return
    groups = groups_of(plan)
    ranks = [r for g in groups for r in g]
    assert len(ranks) == len(set(ranks)) and sum(len(g) for g in groups) <= world
    for g, seqs in groups.items():
        d = len(g)
        assert d & (d - 1) == 0 and 32 % d == 0 and g[0] % d == 0
        assert g == tuple(range(g[0], g[0] + d))
        assert sum(math.ceil(plan.seq_lens[s] / d) for s in seqs) <= cap
        assert all(p.mode is (Mode.LOCAL if d == 1 else Mode.ULYSSES)
                   for p in plan.attention if p.seq in seqs)


def test_flexsp_respects_kv_heads():
    ctx = make_ctx(1, 8, 100, model="tiny")                       # 2 KV heads
    plan = get_planner("flexsp").plan([180, 150, 90, 20], ctx)
    assert max(p.size for p in plan.attention) <= 2
    with pytest.raises(InfeasibleError, match="flexsp: sequence 0"):
        get_planner("flexsp").plan([250], ctx)                   # needs 4 GPUs


def _makespan(plan, t) -> float:
    return max(sum(t(plan.seq_lens[s], len(g)) for s in seqs) for g, seqs in groups_of(plan).items())


def test_flexsp_matches_brute_force_optimum():
    """Small batches with exact buckets: the plan is within the MIP gap of the best
    grouping found by enumerating every group multiset and assignment."""
    ctx = make_ctx(1, 4, 4096, time_limit_s=5.0)
    t = seq_time_fn(ctx.cost)
    layouts = [(4,), (2, 2), (2, 1, 1), (1, 1, 1, 1), (2, 1), (1, 1, 1), (2,), (1, 1), (1,)]
    for lens in ([9000, 3000, 1500, 800, 800], [5000, 4000, 100], [15000, 300, 300, 200]):
        best = math.inf
        for sizes in layouts:
            for assign in itertools.product(range(len(sizes)), repeat=len(lens)):
                load = [0.0] * len(sizes)
                mem = [0] * len(sizes)
                for L, g in zip(lens, assign):
                    load[g] += t(L, sizes[g])
                    mem[g] += math.ceil(L / sizes[g])
                if max(mem) <= 4096:
                    best = min(best, max(load))
        plan = get_planner("flexsp").plan(lens, ctx)
        assert best * (1 - 1e-12) <= _makespan(plan, t) <= best * 1.011


def test_flexsp_milp_is_no_worse_than_its_greedy_start():
    cap = 8192
    ctx = make_ctx(2, 4, cap)
    t = seq_time_fn(ctx.cost)
    lens = [14000, 9000, 5000, 3000, 2000, 1000, 900, 500, 400, 300, 200, 100]
    buckets = bucket_lengths(lens, 8 * cap, min_buckets=len(lens))    # one bucket per length
    sizes = ulysses_sizes(8, 32)
    greedy = greedy_groups(lens, lens, sizes, 8, cap, t.column)
    milp = solve_milp(buckets, sizes, 8, cap, t, 5.0)
    assert greedy is not None and milp is not None
    assert sum(d for d, _ in milp) <= 8
    assert sorted(k for _, counts in milp for k in counts) == list(range(len(lens)))
    span_greedy = max(sum(t(lens[i], d) for i in m) for d, m in greedy)
    span_milp = max(sum(t(buckets[k].boundary, d) * c for k, c in counts.items()) for d, counts in milp)
    assert span_milp <= span_greedy * 1.011    # optimal within the 1 % MIP gap


def test_flexsp_seq_time_column_equals_one_sequence_at_a_time():
    """FlexSP's ``t`` for a whole array of lengths equals, bit for bit, the
    per-sequence formula (Ulysses alone on the group plus ``1/d`` of the linear
    work), with and without tensor parallelism."""
    lens = sorted({1, 2, 5, 4095, 4096, 4097} | set(random.Random(3).sample(range(1, 400_000), 2000)))
    base = make_ctx(4, 8, 1 << 20).cost
    for cost in (base, tp_view(base, 2)):
        t = SeqTime(cost)
        for d in (1, 2, 4, 8, 16):
            link = cost.alltoall_link(range(d))
            want = [cost.ulysses_cost([L], d, link, latency=False).total_s + cost.linear_s(L) / d for L in lens]
            assert t.column(np.array(lens), d).tolist() == want
            assert [t(L, d) for L in lens[:50]] == want[:50]


def test_flexsp_greedy_bisects_to_the_tightest_first_fit():
    """40 equal sequences (past a pruning block) of 10 s each on 4 one-GPU groups:
    the limit doubles from 10 s to 160 s, then bisects down to 100 s, where the
    first fit makes 4 groups of 10 in index order (ties: lower index first)."""
    groups = greedy_groups([10] * 40, [10] * 40, [1], 4, 1000, lambda L, d: L * 1.0)
    assert groups == [(1, list(range(k, k + 10))) for k in range(0, 40, 10)]
    # Memory: the 100-token sequence needs 2 GPUs at a cap of 60 (50 s); the
    # other two then share 2 GPUs (30 + 25 s) rather than 60 s alone on one.
    assert greedy_groups([100, 60, 50], [100, 60, 50], [1, 2], 4, 60, lambda L, d: L / d) == \
        [(2, [0]), (2, [1, 2])]
    assert greedy_groups([100], [100], [1, 2], 1, 60, lambda L, d: L / d) is None   # needs 2 GPUs of 1


def test_flexsp_greedy_groups_hold_the_batch():
    """Every sequence in exactly one group, within the world, the cap, Ulysses'
    2d-token minimum and the group's time limit, longest first in each group."""
    cap, world = 32768, 16
    ctx = make_ctx(2, 8, cap)
    t = seq_time_fn(ctx.cost)
    lens = [random.Random(i).randint(1, 4000) for i in range(200)]
    groups = greedy_groups(lens, lens, ulysses_sizes(world, 32), world, cap, t.column)
    assert groups is not None
    assert sorted(i for _, m in groups for i in m) == list(range(len(lens)))
    assert sum(d for d, _ in groups) <= world
    for d, m in groups:
        assert sum(-(-lens[i] // d) for i in m) <= cap
        assert d == 1 or min(lens[i] for i in m) >= 2 * d
        assert [lens[i] for i in m] == sorted((lens[i] for i in m), reverse=True)
