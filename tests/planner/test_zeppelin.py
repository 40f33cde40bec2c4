"""Zeppelin planner: valid, deterministic, sensible tiers, balanced step time."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings, strategies as st

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Mode, zigzag_shards
from megatron_zeppelin.planner.base import PlanContext, get_planner, same_layout_linear
from megatron_zeppelin.planner.zeppelin import planner as zeppelin, search
from megatron_zeppelin.planner.surrogate import StepSurrogate, surrogate_clock
from megatron_zeppelin.planner.zeppelin_decide import DecidingZeppelinPlanner
from megatron_zeppelin.plan.shards import zigzag_shard_tokens
from megatron_zeppelin.planner.zeppelin import ZeppelinPlanner, min_ring_size
from megatron_zeppelin.planner.zeppelin.planner import gc_paused
from megatron_zeppelin.sim.timeline import step_shape, step_timeline
from megatron_zeppelin.topology import Topology, load_cluster
from tests.planner.placement_oracle import as_plan, find_placement

MAX_SEQ = 131072


def make_ctx(nodes: int, gpn: int = 8, nics: int | None = None, cap: int = 16384,
             cluster: str = "h100-8x400g", model: str = "llama-7b") -> PlanContext:
    topo = Topology(nodes=nodes, gpus_per_node=gpn, nics_per_node=gpn if nics is None else nics)
    cluster_cfg = dataclasses.replace(load_cluster(cluster), topology=topo)
    return PlanContext(cost=CostModel(cluster_cfg, load_model(model)), tokens_per_gpu=cap)


def long_tail_batches(seed: int, budget: int, count: int, max_seq: int = MAX_SEQ) -> list[list[int]]:
    """Documents with lognormal lengths plus a Pareto tail, cut at ``max_seq`` and
    packed greedily into global batches of at most ``budget`` tokens (the
    sampler's rule: the piece that does not fit opens the next batch)."""
    rng = np.random.default_rng(seed)
    docs = np.concatenate([rng.lognormal(8.3, 1.3, 4000), 20000 * (1 + rng.pareto(1.2, 400))])
    docs = np.maximum(rng.permutation(docs).astype(np.int64), 16)
    batches, cur = [], []
    for d in docs:
        while d > 0:
            piece = int(min(d, max_seq))
            d -= piece
            if sum(cur) + piece > budget:
                batches.append(cur)
                cur = []
                if len(batches) == count:
                    return batches
            cur.append(piece)
    return batches


# ------------------------------------------------------------- validity
@st.composite
def batches_and_topologies(draw):
    nodes = draw(st.integers(1, 4))
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    nics = draw(st.sampled_from([n for n in (1, 2, 4) if gpn % n == 0]))
    cap = draw(st.integers(64, 4096))
    world = nodes * gpn
    fill = draw(st.floats(0.05, 0.97))
    lens = []
    while True:
        # Mostly short, sometimes far longer than one GPU's cap.
        length = draw(st.one_of(st.integers(1, cap), st.integers(cap, cap * world)))
        if sum(lens) + length > fill * cap * world:
            break
        lens.append(length)
    return lens or [1], nodes, gpn, nics, cap


@settings(max_examples=120, deadline=None, derandomize=True)
@given(batches_and_topologies())
def test_plans_are_valid_on_random_batches_and_topologies(case):
    lens, nodes, gpn, nics, cap = case
    plan = ZeppelinPlanner().plan(lens, make_ctx(nodes, gpn, nics, cap))
    plan.validate()   # coverage, zigzag geometry, token cap in both layouts
    assert plan.token_cap == cap and plan.strategy == "zeppelin"
    counts = plan.linear_tokens_per_rank()
    # Either the remap balances the linear tokens, or the plan keeps the
    # attention layout (balanced attention + linear time, nothing to move).
    if plan.remap_schedule():
        assert max(counts) - min(counts) <= 1
    else:
        assert counts == plan.attention_tokens_per_rank()
    for p in plan.attention:
        # Never more ranks than the token cap forces plus what balance asks for,
        # and every ring is at least the size the cap forces.
        assert p.size >= min_ring_size(plan.seq_lens[p.seq], cap)


def test_nearly_full_batch_is_placed_and_the_token_packing_is_valid(monkeypatch):
    # 94 % full: wide groups need few free slots per rank, so a balanced pass
    # places the batch (Ulysses: ceil(L / d) per rank; rings without Ulysses).
    lens = [1417, 1453, 1453, 1453, 1460, 1546, 2194]
    ctx = make_ctx(1, 8, 1, cap=1453)
    for c in (ctx, dataclasses.replace(ctx, tp_size=32)):   # TP 32: one head, no Ulysses
        ZeppelinPlanner().plan(lens, c).validate()
    # Where every balanced pass strands a sequence, the tokens-only last
    # resort packs the three over-cap sequences onto the four free GPUs as
    # rings of 4.
    def stranded(*args):
        raise InfeasibleError("stranded")
    monkeypatch.setattr(zeppelin, "_one_pass", stranded)
    plan = ZeppelinPlanner().plan(lens, ctx).validate()
    assert sorted(p.size for p in plan.attention) == [1, 1, 1, 1, 4, 4, 4]


def test_passes_of_the_other_layout_come_before_the_last_resort(monkeypatch):
    """A 99.95 %-full batch of 9 python-dirs sequences on 32 H100s: every remap
    pass and three of the four remap-off passes strand a sequence.  With remap on
    the planner takes the remap-off pass's plan (Ulysses groups; its linear layout
    is its attention layout) instead of the tokens-only last resort (rings), which
    the replay times 1.8x slower (7.74 s against 13.88 s; 3.5x when the replay ran
    one in-order send lane per rank, before it ran the engine's two lanes and wave
    batches).  The batch strands these passes at the attention constants it was
    found with (the h100 preset before its FlashAttention-2 fit)."""
    lens = [107382, 13010, 311081, 66972, 4102, 15724, 5703, 44, 27]
    h100 = load_cluster("h100-8x400g", nodes=4)
    h100 = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, attn_efficiency=0.55, attn_half_block=1024))
    cost = CostModel(h100, load_model("llama-7b"), routing=True)
    ctx = PlanContext(cost=cost, tokens_per_gpu=16384)
    plan = ZeppelinPlanner().plan(lens, ctx).validate()
    assert plan == ZeppelinPlanner().plan(lens, dataclasses.replace(ctx, remap_enabled=False))
    assert plan.tier_counts().ulysses == 7 and plan.linear_tokens_per_rank() == plan.attention_tokens_per_rank()
    monkeypatch.setattr(zeppelin, "PASSES", tuple(p for p in zeppelin.PASSES if p.remap))
    last_resort = ZeppelinPlanner().plan(lens, ctx).validate()
    assert last_resort.tier_counts().ulysses == 0
    assert step_timeline(plan, cost).step_s * 1.5 < step_timeline(last_resort, cost).step_s


def test_deterministic():
    ctx = make_ctx(8)
    lens = long_tail_batches(3, 16384 * 64, 1)[0]
    a = ZeppelinPlanner().plan(lens, ctx)
    b = get_planner("zeppelin").plan(list(lens), ctx)
    assert a.to_json() == b.to_json()


def test_sequence_longer_than_the_cluster_is_infeasible():
    ctx = make_ctx(2, 2, 1, cap=100)
    with pytest.raises(InfeasibleError, match=r"sequence 1 has 401 tokens.*max-seq-len to at most 400"):
        ZeppelinPlanner().plan([10, 401], ctx)
    with pytest.raises(InfeasibleError, match="more than the cluster holds"):
        ZeppelinPlanner().plan([100] * 5, ctx)


def test_shard_sizes_match_the_plan_geometry():
    for length, k in [(17, 2), (100, 7), (131072, 8), (131071, 9)]:
        want = [sum(e - s for s, e in shard) for shard in zigzag_shards(length, k)]
        assert zigzag_shard_tokens(length, k).tolist() == want
    assert min_ring_size(16384, 16384) == 1
    assert min_ring_size(16385, 16384) == 2
    assert min_ring_size(131072, 16384) == 8


# ---------------------------------------------------------------- tiers
def test_short_sequences_stay_local():
    ctx = make_ctx(2, 4, 2, cap=16384)
    plan = ZeppelinPlanner().plan([1000 + 37 * i for i in range(40)], ctx)
    assert all(p.mode is Mode.LOCAL for p in plan.attention)
    # Alone, a tiny sequence still stays local: a ring would only add latency.
    assert ZeppelinPlanner().plan([5], ctx).attention[0].mode is Mode.LOCAL
    assert ZeppelinPlanner().plan([], ctx).validate().linear == ((),) * 8


def _nodes(placement, gpn: int) -> set[int]:
    return {r // gpn for r in placement.ranks}


def test_cap_forces_the_minimum_group_and_it_stays_in_a_node():
    ctx = make_ctx(2, 4, 2, cap=4096)
    # Two sequences of 3 GPUs' worth each (a group of >= 3 forced by the cap)
    # among short ones: one per node balances the nodes, and no NIC is needed.
    lens = [3 * 4096 - 10, 3 * 4096 - 20] + [500] * 10
    plan = ZeppelinPlanner().plan(lens, ctx)
    groups = plan.attention[:2]
    assert all(p.mode is not Mode.LOCAL and p.size >= 3 for p in groups)
    assert [len(_nodes(p, 4)) for p in groups] == [1, 1]
    assert _nodes(groups[0], 4) | _nodes(groups[1], 4) == {0, 1}


def test_groups_span_nodes_only_when_a_node_is_too_small():
    ctx = make_ctx(2, 4, 4, cap=4096)
    fits_node, needs_two = 4 * 4096 - 400, 6 * 4096 - 100
    plan = ZeppelinPlanner().plan([fits_node, fits_node - 50, 300, 200], ctx)
    assert [len(_nodes(p, 4)) for p in plan.attention[:2]] == [1, 1]
    plan = ZeppelinPlanner().plan([needs_two, 300, 200], ctx)
    assert len(_nodes(plan.attention[0], 4)) == 2 and plan.attention[0].size >= 6


def test_ulysses_groups_divide_the_heads():
    # llama-7b has 32 heads: a Ulysses group must have 2, 4, 8, 16 or 32 ranks.
    ctx = make_ctx(8)
    sizes = [p.size for lens in long_tail_batches(11, 16384 * 64, 3)
             for p in ZeppelinPlanner().plan(lens, ctx).attention if p.mode is Mode.ULYSSES]
    # Long sequences on routed NICs: whole-length kernels beat short ring blocks.
    assert sizes and all(32 % d == 0 for d in sizes)
    # With tensor parallelism 8 each rank sees 4 heads: groups of 2 or 4 only.
    tp_ctx = dataclasses.replace(ctx, tp_size=8)
    tp_sizes = [p.size for lens in long_tail_batches(11, 16384 * 64, 3)
                for p in ZeppelinPlanner().plan(lens, tp_ctx).attention if p.mode is Mode.ULYSSES]
    assert all(d in (2, 4) for d in tp_sizes)


def test_remap_off_keeps_the_attention_layout():
    ctx = dataclasses.replace(make_ctx(2, gpn=4), remap_enabled=False)
    for lens in long_tail_batches(5, 16384 * 8, 3):
        plan = ZeppelinPlanner().plan(lens, ctx).validate()
        assert plan.remap_schedule() == []
        assert plan.linear_tokens_per_rank() == plan.attention_tokens_per_rank()


# -------------------------------------------------------------- balance
def _lower_bound_ratio(plan, ctx) -> float:
    # The lower bound has no gradient sync: compare the ranks' work only.
    return step_timeline(plan, ctx.cost).compute_s / ctx.cost.lower_bound_s(plan.seq_lens)


def test_balance_on_a_synthetic_long_tail_at_64_gpus():
    ctx = make_ctx(8)
    te_cp = get_planner("te_cp")
    ratios = []
    for lens in long_tail_batches(7, 16384 * 64, 4):
        plan = ZeppelinPlanner().plan(lens, ctx)
        plan.validate()
        ratio = _lower_bound_ratio(plan, ctx)
        ratios.append(ratio)
        assert ratio <= 1.25, ratio
        linear = plan.linear_tokens_per_rank()
        assert max(linear) / np.mean(linear) <= 1.05
        try:
            static = te_cp.plan(lens, ctx)
        except InfeasibleError:
            continue
        assert step_timeline(plan, ctx.cost).step_s <= step_timeline(static, ctx.cost).step_s
    assert np.mean(ratios) <= 1.2, ratios


def test_attention_pairs_balance_when_the_batch_allows_it():
    # Many medium sequences, nothing near the cap: pairs can be balanced.
    ctx = make_ctx(2, 4, 4, cap=65536)
    rng = np.random.default_rng(0)
    lens = rng.integers(2000, 12000, 60).tolist()
    plan = ZeppelinPlanner().plan(lens, ctx)
    pairs = np.array(plan.attn_pairs_per_rank(), dtype=float)
    assert pairs.max() / pairs.mean() <= 1.10


def test_ranks_finish_together_on_a_synthetic_long_tail():
    # Batches filled to 95 % (the simulator's default) with sequences up to 8
    # GPUs' worth: the replay's ranks finish the step together.  Causal pairs
    # per rank are a looser proxy since the passes are picked by the surrogate
    # of the replay: a rank in Ulysses groups waits on their all-to-alls, so
    # equal finishes can hold unequal pairs (up to 1.12x here).
    ctx = make_ctx(8)
    finish, pairs_imbalance = [], []
    for seed in (7, 11):
        for lens in long_tail_batches(seed, int(0.95 * 16384 * 64), 4):
            plan = ZeppelinPlanner().plan(lens, ctx)
            ranks = step_timeline(plan, ctx.cost).ranks
            total = np.array([r.total_s for r in ranks])
            finish.append(total.max() / total.mean())
            pairs = np.array(plan.attn_pairs_per_rank(), dtype=float)
            pairs_imbalance.append(pairs.max() / pairs.mean())
    assert np.median(finish) <= 1.01 and max(finish) <= 1.02, finish
    assert max(pairs_imbalance) <= 1.15, pairs_imbalance


def test_the_passes_plans_are_compared_by_the_surrogate():
    # Several passes run on a small cluster; the planner returns the one whose
    # plan the surrogate of the replay puts fastest (ties: the first pass).
    ctx = make_ctx(2)
    lens = long_tail_batches(7, int(0.95 * 16384 * 16), 1)[0]
    arr = np.asarray(lens, dtype=np.int64)
    packer = zeppelin._Packer(arr, ctx, zeppelin._TierTimes(ctx.cost, 8, 2))
    local_s = packer.local_s
    mean_s = float(local_s.sum()) / 16
    light = (arr <= zeppelin.LIGHT_TOKENS * ctx.tokens_per_gpu) & (local_s <= zeppelin.LIGHT_TIME * mean_s)
    order = np.argsort(-arr, kind="stable")
    heavy, light_seqs = order[~light[order]].tolist(), order[light[order]]
    budget = max(1, zeppelin.PASS_BUDGET // max(len(heavy), 1))
    plans = [zeppelin._built("zeppelin", tuple(lens), zeppelin._layout(r.assign), r.remap, ctx)
             for r in (zeppelin._one_pass(packer, heavy, light_seqs, float(local_s[light].sum()), mean_s, p)
                       for p in zeppelin.PASSES if p.remap)][:budget]
    assert len(plans) > 1
    clock = StepSurrogate(ctx.cost)
    times = [clock.step_s(p) for p in plans]
    assert times.index(min(times)) > 0  # not the first pass: the choice matters
    chosen = ZeppelinPlanner().plan(lens, ctx)
    assert chosen == plans[times.index(min(times))]


def test_without_remap_attention_and_linear_time_are_balanced_together():
    # A quarter-full batch of short documents and no remap layer: the linear
    # modules run on the attention layout, so balancing attention alone (the
    # remap-on placement kept in place) leaves the token-heavy ranks slow.
    ctx = make_ctx(8)
    rng = np.random.default_rng(1)
    lens = np.minimum(rng.lognormal(7.5, 1.0, 120).astype(int) + 1, 16384).tolist()
    in_place = ZeppelinPlanner().plan(lens, dataclasses.replace(ctx, remap_enabled=False)).validate()
    assert in_place.remap_schedule() == []
    balanced = ZeppelinPlanner().plan(lens, ctx).validate()
    assert balanced.remap_schedule()   # remap on: token-balanced linear layout
    attention_only = dataclasses.replace(balanced, linear=same_layout_linear(64, balanced.attention))
    assert step_timeline(in_place, ctx.cost).compute_s < 0.97 * step_timeline(attention_only, ctx.cost).compute_s


def test_small_topologies_plan_and_balance():
    te_cp = get_planner("te_cp")
    for nodes, gpn, nics in [(2, 2, 1), (2, 4, 2), (1, 8, 4), (4, 8, 1)]:
        world = nodes * gpn
        ctx = make_ctx(nodes, gpn, nics, cap=16384)
        for lens in long_tail_batches(nodes * 10 + gpn, 16384 * world, 3, min(MAX_SEQ, 16384 * world)):
            plan = ZeppelinPlanner().plan(lens, ctx).validate()
            step = step_timeline(plan, ctx.cost).compute_s   # the sync is the same for both
            try:
                # te_cp's plan timed with the engine's transfer dtypes (dK/dV in fp32;
                # TE's own ring sends them in bf16): this compares placements.
                static = step_timeline(te_cp.plan(lens, ctx), ctx.cost,
                                       attn=step_shape(ctx.cost, False).attn).compute_s
            except InfeasibleError:
                static = float("inf")
            # Within 10 %: with one NIC per node, static CP's packed intra-node
            # rings hide communication that separate rings expose, and the
            # remap to the balanced linear layout crosses that one NIC.
            assert step <= 1.1 * static
            # Tiny batches can be one long sequence: splitting it costs kernel
            # efficiency, and with one NIC its ring is bound by the link; the
            # lower bound charges neither.
            assert step <= 2.5 * ctx.cost.lower_bound_s(lens)


def test_plans_a_thousand_sequences_quickly():
    ctx = make_ctx(8, cap=200_000)
    rng = np.random.default_rng(1)
    lens = np.minimum(rng.lognormal(8.0, 1.2, 1000).astype(int) + 1, MAX_SEQ).tolist()
    planner = ZeppelinPlanner()
    planner.plan(lens, ctx)
    t0 = time.process_time()
    for _ in range(3):
        planner.plan(lens, ctx)
    # Budget 20 ms on an idle core; generous here because CI machines are shared.
    assert (time.process_time() - t0) / 3 < 0.2


def test_a_missed_target_weighs_a_groups_total_work():
    # Once no size fits the target, a candidate is judged by the step it leads
    # to: its own peak, or the level its total work lifts every rank to.
    narrow, wide = (1.00, 8, 0.50), (0.90, 32, 0.70)
    assert search._lower(narrow, wide, 0.5) is narrow      # 1.00 vs max(0.90, 1.20)
    assert search._lower(wide, narrow, 0.5) is narrow
    assert search._lower(None, wide, 0.5) is wide and search._lower(wide, None, 0.5) is wide
    cheap_wide = (0.90, 32, 0.55)
    assert search._lower(narrow, cheap_wide, 0.3) is cheap_wide  # 1.00 vs max(0.90, 0.85)
    # Nothing else to run (floor 0): idle ranks cost nothing, so the wider ring
    # with the lower peak wins although it does more work in total.
    six, eight = (1.00, 6, 0.75), (0.94, 8, 0.94)
    assert search._lower(six, eight, 0.0) is eight


def test_a_lone_long_sequence_uses_every_rank_when_the_model_says_so():
    # One sequence that needs 6 of 8 ranks (cap): a ring over all 8 is faster by
    # the cost model, and leaves no rank idle.
    topo = Topology(nodes=2, gpus_per_node=4, nics_per_node=4)
    cost = CostModel(dataclasses.replace(load_cluster("cpu-sim"), topology=topo), load_model("tiny"))
    ctx = PlanContext(cost=cost, tokens_per_gpu=384)
    link = cost.link_for(range(8))
    assert cost.ring_cost([2048], 8, link).total_s < cost.ring_cost([2048], 6, link).total_s
    plan = ZeppelinPlanner().plan([2048], ctx).validate()
    assert plan.attention[0].size == 8
    pairs = plan.attn_pairs_per_rank()
    assert max(pairs) / (sum(pairs) / len(pairs)) < 1.01


def test_routing_no_longer_buys_inter_node_rings_the_replay_calls_slower():
    # llama-13b's 40 heads allow Ulysses groups of 10, 20, 40 across nodes; on
    # the A800 cluster (2 GPUs per slow NIC) a routed ring's crossing gets all
    # NICs.  The planner's old additive estimate took routed inter-node rings
    # here that replayed at 25.96 s against 20.22 s for the unrouted plan.  Its
    # passes are now compared by the replay's surrogate: the routed plan
    # replays within 5 % of the unrouted one (1.7 % measured), and the decision,
    # which compares its candidates by the same clock, picks a plan within 2 %
    # of the better of the two (the surrogate puts them 0.06 % apart, the
    # replay 1.7 %: it picks the routed one).
    ctx = make_ctx(8, nics=4, cluster="a800-4x200g", model="llama-13b")
    unrouted = dataclasses.replace(ctx, cost=ctx.cost.routed(False))
    lens = long_tail_batches(7, int(0.95 * 16384 * 64), 3)[2]
    routed_plan = ZeppelinPlanner().plan(lens, ctx).validate()
    unrouted_plan = dataclasses.replace(ZeppelinPlanner().plan(lens, unrouted).validate(), routed=False)
    step = {name: step_timeline(plan, ctx.cost).step_s
            for name, plan in (("routed", routed_plan), ("unrouted", unrouted_plan))}
    assert step["routed"] <= 1.05 * step["unrouted"], step
    decided = DecidingZeppelinPlanner().plan(lens, dataclasses.replace(
        ctx, remap_decided=False, step_model=surrogate_clock(ctx.cost)))
    assert step_timeline(decided, ctx.cost).step_s <= min(step.values()) * 1.02


# ------------------------------------------------------- full batches
def test_a_99_percent_full_batch_on_2x2_is_placed():
    # The second batch of the docs sample with --tokens-per-gpu 512 --max-seq-len
    # 2048 on 2x2: 2,033 tokens for 2,048 slots; every greedy pass strands a
    # sequence, the backtracking search places it.
    for remap in (True, False):
        ctx = dataclasses.replace(make_ctx(2, 2, 2, 512, model="tiny"), remap_enabled=remap)
        plan = ZeppelinPlanner().plan([955, 801, 157, 85, 35], ctx).validate()
        assert max(plan.attention_tokens_per_rank()) <= 512


@st.composite
def full_batches_and_topologies(draw):
    """A batch built the sampler's way with the budget at 100 % of the
    capacity: documents (cut at max_seq_len) are added until the next one does
    not fit."""
    nodes = draw(st.integers(1, 4))
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    cap = draw(st.integers(64, 2048))
    capacity = nodes * gpn * cap
    max_seq = draw(st.integers(cap // 2, capacity))
    lens = []
    while True:
        length = draw(st.one_of(st.integers(1, max(cap // 8, 1)), st.integers(1, min(cap, max_seq)),
                                st.integers(min(cap, max_seq), max_seq)))
        if sum(lens) + length > capacity:
            break
        lens.append(length)
    return lens or [1], nodes, gpn, cap, draw(st.booleans())


#: A 100 %-full batch on 4 x 8 ranks whose greedy passes all strand a sequence;
#: only the backtracking last resort places it (found by this test's search).
FULL_32_RANKS = ([3, 7, 11, 11, 12, 19, 22, 26, 30, 33, 34, 34, 35, 41, 50, 51, 54, 58, 59, 61, 61, 63, 63, 66,
                  82, 84, 100, 100, 113, 117, 124, 127, 128, 153, 173, 200, 209, 225, 228, 246, 253, 269, 273,
                  287, 289, 322, 358, 359, 398, 405, 407, 411] + [424] * 26, 4, 8, 574, False)
#: 2,573 tokens for 2,576 slots on 4 x 4 ranks: a placement exists (the oracle's:
#: 855 and 355 as rings of 8 and 11) but the depth-first search stopped at its
#: step budget; the limited-discrepancy round finds one after 176 steps.
FULL_16_RANKS = ([8, 10, 14, 14, 15, 15, 16, 19, 54, 54, 72, 137, 142, 160, 161, 355, 472, 855], 4, 4, 161, False)
#: Largest world on which a planner failure is checked by the placement oracle
#: (under 0.1 s per batch at 16 ranks; 26 s for FULL_32_RANKS).
ORACLE_MAX_WORLD = 16


# No shrinking: a failure runs the planner's bounded searches and the oracle on
# every shrink step (5+ minutes on the 16-rank example); the failing batch is
# reported as drawn, with the placement the oracle found.  The drawn batches
# move with integer literals anywhere in the imported project code (Hypothesis
# mixes them into its draws), so derandomize alone does not pin them.
@settings(max_examples=100, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(full_batches_and_topologies())
@example(FULL_32_RANKS)
@example(FULL_16_RANKS)
def test_batches_filled_to_the_whole_capacity_are_placed_when_a_placement_exists(case):
    lens, nodes, gpn, cap, remap = case
    ctx = dataclasses.replace(make_ctx(nodes, gpn, gpn, cap, model="tiny"), remap_enabled=remap)
    try:
        plan = ZeppelinPlanner().plan(lens, ctx).validate()
    except InfeasibleError as exc:
        # Zigzag shards come in fixed sizes: some full batches have no
        # placement at all (the sampler defers a piece of those).  The error
        # is then one line, and only then allowed.
        assert "\n" not in str(exc) and str(exc).startswith("zeppelin: no placement of the batch"), exc
        assert nodes * gpn <= ORACLE_MAX_WORLD, f"unchecked failure on {nodes * gpn} ranks: {exc}"
        found = find_placement(lens, cap, nodes * gpn, _ulysses_sizes(ctx))
        assert found is None, f"{exc}, but this one exists (mode, ranks per sequence): {found}"
        return
    assert sorted(plan.seq_lens) == sorted(lens)


def _ulysses_sizes(ctx: PlanContext) -> list[int]:
    heads = int(np.gcd(*ctx.local_heads))
    return [d for d in range(2, heads + 1) if heads % d == 0]


def test_the_placement_oracle_tells_full_batches_with_and_without_a_placement():
    ctx = dataclasses.replace(make_ctx(1, 2, 2, 3, model="tiny"), remap_enabled=False)
    # Two ranks of 3 and three sequences of 2: no ring of 2 tokens exists
    # (2k chunks), so the third has nowhere to go.
    assert find_placement([2, 2, 2], 3, 2, _ulysses_sizes(ctx)) is None
    with pytest.raises(InfeasibleError, match=r"^zeppelin: no placement of the batch \[2, 2, 2\][^\n]*$"):
        ZeppelinPlanner().plan([2, 2, 2], ctx)
    # 511 tokens on 8 ranks of 64: no two zigzag rings of 212 and 299 tokens fit
    # (with Ulysses groups of 8, whose contiguous shards are more even, they would).
    assert find_placement([212, 299], 64, 8) is None
    # What the oracle finds is a valid Plan: 7 | 7 and 5 as a ring of 2 (shards 3 and 2) ...
    assert as_plan([7, 7, 5], 10, 2, 2, find_placement([7, 7, 5], 10, 2)).validate()
    # ... and every sequence of the 16-rank example under its cap.
    lens, nodes, gpn, cap, _ = FULL_16_RANKS
    found = as_plan(lens, cap, nodes * gpn, gpn, find_placement(lens, cap, nodes * gpn, _ulysses_sizes(ctx)))
    assert max(found.validate().attention_tokens_per_rank()) <= cap


def test_the_collector_pauses_on_the_main_thread_only_and_is_left_as_found():
    """The collector is the interpreter's: a plan built on the trainer's
    planning thread must not stop it for the training thread, nor re-enable one
    the training thread disabled (Megatron's --manual-gc)."""
    seen = []

    def build():
        with gc_paused():
            seen.append(gc.isenabled())

    assert gc.isenabled()
    build()
    planner_thread = threading.Thread(target=build)
    planner_thread.start()
    planner_thread.join()
    gc.disable()
    try:
        build()
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, True, False] and gc.isenabled()
