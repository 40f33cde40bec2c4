"""The decision's clock: the surrogate stays near the replay, and the decision follows it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.integration.args import DEFAULTS
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Mode, Plan, placement
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.surrogate import StepSurrogate
from megatron_zeppelin.planner.zeppelin_decide import DecidingZeppelinPlanner, decision_candidates
from megatron_zeppelin.sampler import batch_budget
from megatron_zeppelin.sampler.lengths import load_lengths, resolve_lengths
from megatron_zeppelin.sim.simulate import VARIANTS, build_strategies, sample_batches
from megatron_zeppelin.sim.strategy import plan_context
from megatron_zeppelin.sim.timeline import step_timeline
from megatron_zeppelin.topology import load_cluster

#: (cluster, GPUs, model, lengths, max length): every tier between them --
#: local and Ulysses (books at 32K), intra-node rings (the uniform layouts),
#: Ulysses groups (16 GPUs, 256K), routed and direct inter-node rings (a
#: 196,608-token book on 16 GPUs of 16K tokens: no node holds it).
CASES = [("h100-8x400g", 8, "llama-7b", "synthetic-books", 32768),
         ("h100-8x400g", 16, "llama-3b", "synthetic-longtail", 262144),
         ("a800-4x200g", 16, "llama-7b", "synthetic-web", 65536),
         ("h200-8x400g", 16, "llama-13b", "synthetic-longtail", 32768),
         ("a800-4x200g", 16, "llama-7b", "synthetic-books", 196608)]
#: Bound per candidate plan: the surrogate's target p95 (issue 19).  Against the
#: replay of the engine's lanes (two per rank, one NCCL batch per wave, ports
#: carrying their transfers back to back) these plans' largest error is 1.55 %
#: (a800 16 GPUs books 196K); the one-send-lane surrogate was up to 10 % off it.
BOUND = 0.02


def candidates(cluster: str, world: int, model: str, lengths: str, max_len: int):
    c = load_cluster(cluster)
    cost = CostModel(c.with_nodes(world // c.topology.gpus_per_node), load_model(model), routing=True)
    cap = 32768 if model == "llama-3b" else 16384
    lens = sample_batches(load_lengths(resolve_lengths(lengths)), max_seq_len=max_len,
                          tokens_per_batch=batch_budget(cap, world, max_len), steps=1, seed=1)[0]
    ctx = PlanContext(cost=cost, tokens_per_gpu=cap, remap_enabled=True, remap_decided=True)
    return cost, lens, ctx, decision_candidates(lens, ctx)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}")
def test_the_surrogate_stays_near_the_replay(case):
    cost, _, _, plans = candidates(*case)
    clock = StepSurrogate(cost)
    errors = [clock.step_s(p) / step_timeline(p, cost).step_s - 1 for p in plans]
    assert len(plans) >= 4
    assert max(map(abs, errors)) <= BOUND, errors


def test_a_routed_ring_is_paced_by_the_ulysses_members_relaying_its_pieces():
    """An inter-node ring on ranks 4-11 beside a Ulysses group on 0-3 and 12-15
    (16 H100s, a NIC per GPU): its routed crossings (7 -> 8, 11 -> 4) take
    pieces through the proxies on NICs 0-3, the group's members, which post
    them in their own lanes' batches -- after their inputs' all-to-all, and
    from the outputs' wave on after their Ulysses kernel.  The surrogate that
    paced relayed pieces only by other rings was 10.7 % too fast here (0.3616
    s against the replay's 0.4050 s)."""
    c = load_cluster("h100-8x400g")
    cost = CostModel(c.with_nodes(2), dataclasses.replace(load_model("llama-3b"), num_layers=2), routing=True)
    lens = (65536, 131072)
    attention = (placement(0, lens[0], Mode.RING, range(4, 12)),
                 placement(1, lens[1], Mode.ULYSSES, (0, 1, 2, 3, 12, 13, 14, 15)))
    plan = Plan("zeppelin", 16, 8, lens, attention, (), None, True)
    plan = dataclasses.replace(plan, linear=tuple(tuple(plan.attention_spans(r)) for r in range(16))).validate()
    replayed = step_timeline(plan, cost).step_s
    direct = step_timeline(dataclasses.replace(plan, routed=False), cost).step_s
    assert replayed != direct                  # the crossings are routed: their pieces are relayed
    assert abs(StepSurrogate(cost).step_s(plan) / replayed - 1) <= BOUND


def test_every_tier_is_covered_by_the_cases():
    tiers = {"local": 0, "intra": 0, "inter": 0, "ulysses": 0}
    routed = set()
    for case in CASES:
        for p in candidates(*case)[3]:
            for name in tiers:
                tiers[name] += getattr(p.tier_counts(), name)
            routed.add(p.routed)
    assert all(tiers.values()), tiers
    assert routed == {True, False}


def test_the_decision_runs_the_surrogates_fastest_candidate():
    cost, lens, ctx, plans = candidates(*CASES[1])
    clock = StepSurrogate(cost)
    times = [clock.step_s(p) for p in plans]
    assert min(times) < times[0]          # the run's own first plan is not the answer here
    decided = DecidingZeppelinPlanner().plan(lens, dataclasses.replace(ctx, step_model=clock.step_s))
    assert decided == plans[int(np.argmin(times))]


def test_the_decision_is_on_by_default():
    assert DEFAULTS["zeppelin_decide"] == "on"                   # pretrain_gpt.py --zeppelin
    assert VARIANTS["zeppelin"].decide and not VARIANTS["zeppelin_nodecide"].decide
    cost, lens, _, plans = candidates(*CASES[0])
    zeppelin, nodecide = build_strategies(["zeppelin", "zeppelin_nodecide"], cost)
    ctx = plan_context(zeppelin, 16384, 1.0)
    assert plan_context(nodecide, 16384, 1.0).step_model is None
    assert [ctx.step_model(p) for p in plans] == [StepSurrogate(cost).step_s(p) for p in plans]


def test_the_surrogate_follows_local_work_beside_ulysses_groups():
    """Ranks 0 and 1 hold local sequences beside their Ulysses groups, ranks 4..7
    others: the ranks enter every layer's groups at different times (their
    linear work differs), and a local kernel call that started before a group's
    inputs landed runs on (the compute lane is not preempted).  The surrogate
    follows both, as the replay does, to the bit here; when it started a group
    once its last member entered and ran kernels as their data landed it was
    1.04 % fast."""
    cluster = load_cluster("h100-8x400g")
    cost = CostModel(cluster, load_model("llama-3b"))
    spec = [(16384, (0, 1, 2, 3)), (8192, (2, 3, 4, 5)), (6000, (0,)), (3000, (1,)), (700, (4,)), (300, (4,)),
            (9000, (6,)), (9000, (7,))]
    lens = tuple(n for n, _ in spec)
    attention = tuple(placement(i, n, Mode.ULYSSES if len(r) > 1 else Mode.LOCAL, r) for i, (n, r) in enumerate(spec))
    plan = Plan("zeppelin", 8, 8, lens, attention, (), 1 << 20, False)
    plan = dataclasses.replace(plan, linear=tuple(tuple(plan.attention_spans(r)) for r in range(8))).validate()
    replayed = step_timeline(plan, cost, reuse=False).step_s
    assert StepSurrogate(cost).step_s(plan) == pytest.approx(replayed, rel=1e-9, abs=0)


def _shared_rank_plan(spec: list[tuple[int, Mode, tuple[int, ...]]]) -> Plan:
    lens = tuple(n for n, _, _ in spec)
    attention = tuple(placement(i, n, mode, ranks) for i, (n, mode, ranks) in enumerate(spec))
    plan = Plan("zeppelin", 16, 4, lens, attention, (), None, False)
    return dataclasses.replace(plan, linear=tuple(tuple(plan.attention_spans(r)) for r in range(16))).validate()


@pytest.mark.parametrize("small_ring", [(8192, (3, 11)), (20480, (0, 1, 2, 3, 4))], ids=["dkv-batch", "late-arrival"])
def test_rings_sharing_a_rank_share_its_lanes(small_ring):
    """A direct 8-rank ring on ranks 4-11 (16 A800s, nodes of 4) beside a small
    ring sharing one of its ranks, whose other ranks sit in a Ulysses group on
    0-3 and 12-15.  ``dkv-batch``: the 2-rank ring (3, 11)'s last dK/dV rides in
    rank 3's outputs' batch (after the group's kernel), and rank 11 posts its
    NIC lane's next batch -- the big ring's transfers -- only once that batch
    is done; the surrogate that paced each ring alone was 7.6 % fast (1.4870 s
    against the replay's 1.6094 s).  ``late-arrival``: the 5-rank ring's data of
    its last step waits for the group's outputs; the rank it shares (4) ran the
    big ring's kernels meanwhile, and a surrogate that ended a rank at its
    latest arrival plus every ring's kernels from that step on was 2.5 % slow
    (2.5867 s against 2.5236 s).  Ordering each rank's kernels by their data's
    arrival and pacing a rank's lanes by every ring's batches, the surrogate is
    1.3 % and 0.6 % slow."""
    cost = CostModel(load_cluster("a800-4x200g").with_nodes(4),
                     dataclasses.replace(load_model("llama-3b"), num_layers=2), routing=True)
    n, ranks = small_ring
    plan = _shared_rank_plan([(131072, Mode.RING, tuple(range(4, 12))), (n, Mode.RING, ranks),
                              (262144 if len(ranks) > 2 else 196608, Mode.ULYSSES, (0, 1, 2, 3, 12, 13, 14, 15))])
    replayed = step_timeline(plan, cost, reuse=False).step_s
    assert abs(StepSurrogate(cost).step_s(plan) / replayed - 1) <= BOUND


def _ring_plan(nodes: int, model: str, lens: tuple[int, ...]) -> tuple[CostModel, Plan]:
    """``lens`` each as a ring over every GPU of ``nodes`` A800 nodes (4 NICs of
    8 GPUs: routed crossings), 2 layers, routing on."""
    c = load_cluster("a800-4x200g").with_nodes(nodes)
    cost = CostModel(c, dataclasses.replace(load_model(model), num_layers=2), routing=True)
    w = c.topology.world_size
    attention = tuple(placement(i, n, Mode.RING, range(w)) for i, n in enumerate(lens))
    plan = Plan("zeppelin", w, 8, lens, attention, (), None, True)
    return cost, dataclasses.replace(plan, linear=tuple(tuple(plan.attention_spans(r)) for r in range(w))).validate()


@pytest.mark.parametrize("nodes,model,lens", [(4, "llama-13b", (262144,)),
                                              (4, "llama-30b", (126339, 50203, 20000, 5000, 1000))],
                         ids=["one-ring", "five-rings"])
def test_routed_rings_follow_the_lanes_batch_by_batch(nodes, model, lens):
    """Rings over 32 A800s whose node crossings are routed (dispatch, NIC,
    combine: a wave each).  Backward, a K/V leaves in the batch of the wave
    after the one it came in, beside the dK/dV sent then (not the dK/dV of its
    own step), and lands with the receiver's batch, once that batch's dK/dV
    moved too; forward, a proxy's NIC lane carries one wave's pieces of every
    ring at a time, so the crossings of successive steps queue behind each
    other.  The surrogate that summed a step's K/V and dK/dV on a port and
    left the relays' lanes unpaced was +2.34 % (one ring: its backward 4 % slow)
    and +1.28 % off the replay (five rings: forward 14 % fast, backward 9 %
    slow); now within 0.02 % of it."""
    cost, plan = _ring_plan(nodes, model, lens)
    replayed = step_timeline(plan, cost, reuse=False).step_s
    assert step_timeline(dataclasses.replace(plan, routed=False), cost, reuse=False).step_s != replayed
    assert abs(StepSurrogate(cost).step_s(plan) / replayed - 1) <= 0.002


def test_a_ring_member_starts_once_the_members_it_waits_for_entered():
    """One inter-node ring of 16 A800s (nodes of 4) over a 248,621-token
    sequence, 4 layers: a position's exit depends on when it got each step's
    data, so from the second layer on the members enter at different times,
    and a transfer waits only for its own two ends.  The surrogate that
    started the ring once its last member entered was 0.31 % slow here
    (2.8570 s against the replay's 2.8481 s); following each member's exit
    from every member's entry (``surrogate_rings._entry_leave``) it is within 1e-5."""
    cost = CostModel(load_cluster("a800-4x200g").with_nodes(4),
                     dataclasses.replace(load_model("llama-7b"), num_layers=4), routing=True)
    plan = _shared_rank_plan([(248621, Mode.RING, tuple(range(16)))])
    replayed = step_timeline(plan, cost, reuse=False).step_s
    assert abs(StepSurrogate(cost).step_s(plan) / replayed - 1) <= 1e-5
