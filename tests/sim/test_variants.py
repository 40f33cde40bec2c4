"""Zeppelin's ablation variants in the simulator, and the ablation benchmark's core."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Mode, Plan, Span, placement
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.sampler import batch_budget
from megatron_zeppelin.sim.simulate import (STATIC, BASELINE, STRATEGY_NAMES, VARIANTS, build_strategies,
                                            sample_batches, simulate, te_cp_size, uses_routing)
from megatron_zeppelin.topology import LinkSpec, Topology, load_cluster

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ablation", REPO / "benchmarks" / "ablation.py")
ablation = importlib.util.module_from_spec(_spec)
sys.modules["ablation"] = ablation   # dataclasses look their module up by name
_spec.loader.exec_module(ablation)

CAP = 4096
#: (routing layer, remap layer) each variant must run with: the spec of the ablation.
EXPECTED = {"zeppelin_base": (False, False), "zeppelin_norouting": (False, True),
            "zeppelin_noremap": (True, False), "zeppelin_nodecide": (True, True), "zeppelin": (True, True)}


def tiny_cost(nodes: int = 4) -> CostModel:
    """8 GPUs (4 nodes x 2) with 2 NICs each, the tiny model."""
    return CostModel(load_cluster("cpu-sim", nodes=nodes), load_model("tiny"))


# A batch with a 16K sequence (a ring over 4 ranks at 4K/GPU) and uneven short ones:
# the attention layout's token counts differ per rank, so remap has work to do.
BATCH = [16384, 3000, 2500, 2000, 1500, 1200, 900, 700, 600, 500, 300, 200]


@pytest.fixture(scope="module")
def plans() -> dict:
    cost = tiny_cost()
    out = {}
    for s in build_strategies(list(VARIANTS), cost):
        ctx = PlanContext(cost=s.cost, tokens_per_gpu=CAP, remap_enabled=s.remap_enabled)
        out[s.name] = s.planner.plan(BATCH, ctx).validate()
    return out


def test_variant_flags_and_names():
    strategies = build_strategies(list(STRATEGY_NAMES), tiny_cost(), cp_size=4)
    flags = {s.name: (s.cost.routing, s.remap_enabled) for s in strategies}
    for name, expected in EXPECTED.items():
        assert flags[name] == expected, name
        assert type(next(s for s in strategies if s.name == name).planner).__name__ == "DecidingZeppelinPlanner"
    # No baseline has the routing layer; only the static baselines get the fixed group size.
    for s in strategies:
        assert uses_routing(s.name) is s.cost.routing, s.name
        if s.name not in VARIANTS:
            assert not s.cost.routing, s.name
        assert s.cp_size == (4 if s.name in STATIC else None), s.name
    assert STRATEGY_NAMES[0] == BASELINE and STRATEGY_NAMES[-len(EXPECTED):] == tuple(EXPECTED)
    assert len(set(STRATEGY_NAMES)) == len(STRATEGY_NAMES) == 12


def test_unknown_variant_is_a_config_error():
    with pytest.raises(ConfigError, match="zeppelin_noremap"):
        build_strategies(["zeppelin_nomap"], tiny_cost())


def test_simulate_hands_each_variant_its_flags():
    """A stand-in planner records the context simulate() plans each variant with."""
    seen: dict[str, tuple[bool, bool]] = {}
    real = build_strategies(list(VARIANTS), tiny_cost())

    class Recorder:
        name = "zeppelin"

        def __init__(self, strategy: str, inner):
            self.strategy, self.inner = strategy, inner

        def plan(self, lens, ctx):
            seen[self.strategy] = (ctx.cost.routing, ctx.remap_enabled)
            return self.inner.plan(lens, ctx)

    wrapped = [dataclasses.replace(s, planner=Recorder(s.name, s.planner)) for s in real]
    simulate([BATCH], wrapped, tokens_per_gpu=CAP)
    assert seen == EXPECTED


def test_remap_off_means_empty_schedule(plans):
    for name in ("zeppelin_base", "zeppelin_noremap"):
        plan = plans[name]
        assert plan.remap_schedule() == []
        assert plan.linear == same_layout_linear(plan.world_size, plan.attention)
    # With remap on, the planner either remaps to a token-balanced layout or keeps
    # the attention layout (its choice per batch); nothing in between.
    for name in ("zeppelin_norouting", "zeppelin"):
        plan = plans[name]
        tokens = plan.linear_tokens_per_rank()
        assert sum(tokens) == sum(BATCH)
        if plan.remap_schedule():
            assert max(tokens) - min(tokens) <= 1, name
        else:
            assert plan.linear == same_layout_linear(plan.world_size, plan.attention), name


def test_simulated_remap_time_is_zero_without_remap():
    cost = tiny_cost()
    moves = {}
    result = simulate([BATCH], build_strategies(list(VARIANTS), cost), tokens_per_gpu=CAP,
                      on_plan=lambda step, name, plan: moves.setdefault(name, bool(plan.remap_schedule())))
    for name, (routing, remap) in EXPECTED.items():
        tl = result.strategies[name].timeline
        # Each rank spends its own time in the switches (no world-wide round).
        assert any(r.remap_s > 0 for r in tl.ranks) == moves[name], name
        if not remap:
            assert all(r.remap_s == 0.0 for r in tl.ranks), name


# ------------------------------------------------------------------- bytes
@settings(max_examples=30, deadline=None)
@given(length=st.integers(64, 20000), k=st.integers(2, 8), mode=st.sampled_from([Mode.RING, Mode.ULYSSES]))
def test_attention_bytes_match_the_cost_model(length, k, mode):
    """ring_bytes / ulysses_bytes = what CostModel.ring_cost / ulysses_cost send,
    summed over the group's ranks (on a 1 GB/s zero-latency link their transfer
    seconds are GB per rank).  The other mode's bytes are zero."""
    cost = tiny_cost()
    attention = (placement(0, length, mode, range(k)), placement(1, 10, Mode.LOCAL, [7]))
    plan = Plan("hand", 8, 2, (length, 10), attention, same_layout_linear(8, attention))
    link = LinkSpec(bandwidth_GBps=1.0, latency_us=0.0)
    if mode is Mode.RING:
        per_rank, other = cost.ring_cost([length], k, link).transfer_s, ablation.ulysses_bytes(plan, cost)
        mine = ablation.ring_bytes(plan, cost)
    else:
        per_rank, other = cost.ulysses_cost([length], k, link).transfer_s, ablation.ring_bytes(plan, cost)
        mine = ablation.ulysses_bytes(plan, cost)
    assert mine == pytest.approx(k * per_rank * 1e9, rel=1e-9) and other == 0


def test_remap_bytes_by_hand():
    # Ranks 0,1 on node 0; ranks 2,3 on node 1.  Seq 0 (8 tokens) is local on rank 0;
    # the linear layout gives 2 tokens to rank 1 (NVLink) and 3 to rank 2 (NIC).
    cost = dataclasses.replace(tiny_cost(), cluster=dataclasses.replace(
        load_cluster("cpu-sim"), topology=Topology(nodes=2, gpus_per_node=2, nics_per_node=2)))
    attention = (placement(0, 8, Mode.LOCAL, [0]),)
    linear = ((Span(0, 0, 3),), (Span(0, 3, 5),), (Span(0, 5, 8),), ())
    plan = Plan("hand", 4, 2, (8,), attention, linear).validate()
    per_token = cost.model.hidden_bytes_per_token * 4 * cost.model.num_layers
    assert ablation.remap_bytes(plan, cost) == (5 * per_token, 3 * per_token)


# -------------------------------------------------------------------- cell
def test_ablation_cell_on_a_tiny_config():
    rng = np.random.default_rng(3)
    docs = np.concatenate([rng.integers(64, 2048, 200), rng.integers(4096, 30000, 10)])
    cost = tiny_cost()
    docs = rng.permutation(docs)
    cell = ablation.ablation_cell(cost, docs, max_seq_len=16384, tokens_per_gpu=CAP, steps=2)
    assert cell.cp_size == te_cp_size(16384, CAP) == 4
    assert list(cell.step_ms) == list(ablation.RUNGS) and not cell.errors
    assert cell.speedup[BASELINE] == pytest.approx(1.0)
    for n in ablation.RUNGS:
        assert cell.speedup[n] == pytest.approx(cell.step_ms[BASELINE] / cell.step_ms[n])
    # The same batches through the simulator directly give the same step times.
    batches = sample_batches(docs, max_seq_len=16384, steps=2, seed=0,
                             tokens_per_batch=batch_budget(CAP, 8, 16384))
    direct = simulate(batches, build_strategies(list(ablation.RUNGS), cost, cp_size=4), tokens_per_gpu=CAP)
    assert cell.step_ms == pytest.approx({n: r.step_time_s * 1e3 for n, r in direct.strategies.items()})
    assert all(v >= 1.0 for v in cell.linear_imbalance.values())
    assert (cell.remap_gb > 0) == (cell.remap_ms > 0)
    assert 0 <= cell.remap_inter_gb <= cell.remap_gb
    assert cell.remap_share == pytest.approx(cell.remap_gb / (cell.ring_gb + cell.ulysses_gb))
    assert cell.critical_linear > 0 and cell.critical_saving_ms is not None
    text = ablation.report([(("tiny", "cpu-sim", "rand"), cell)],
                           ablation.argparse.Namespace(clusters=["cpu-sim"], nodes=4, max_seq_len=16384,
                                                       tokens_per_gpu=CAP, steps=2), 1.0, "python x")
    assert "Command: `python x`" in text and "| tiny | cpu-sim | rand |" in text


def test_ablation_cell_rejects_a_cp_size_that_does_not_divide():
    with pytest.raises(ConfigError, match="does not divide"):
        ablation.ablation_cell(tiny_cost(nodes=3), np.array([1000] * 50), max_seq_len=16384,
                               tokens_per_gpu=CAP, steps=1)


def test_zeppelin_is_never_modeled_slower_than_its_variants():
    """Its per-batch decision holds every variant's choice (remap on/off, planned and
    run routed or direct), timed the way the simulation reports them (the tiny
    model's 2 layers replay whole at either depth)."""
    cost = tiny_cost()
    docs = np.random.default_rng(3).integers(100, 9000, 400)
    batches = sample_batches(docs, max_seq_len=16384, tokens_per_batch=batch_budget(CAP, 8, 16384), steps=3)
    result = simulate(batches, build_strategies(list(VARIANTS), cost), tokens_per_gpu=CAP)
    zep = result.strategies["zeppelin"].step_s
    for name in VARIANTS:
        assert all(z <= v * (1 + 1e-12) for z, v in zip(zep, result.strategies[name].step_s)), name


def test_a_plan_for_direct_crossings_runs_direct():
    """Candidates planned for direct crossings carry Plan.routed = False, and the
    decision keeps one when the step model prefers it."""
    from megatron_zeppelin.planner.zeppelin_decide import DecidingZeppelinPlanner
    from megatron_zeppelin.sim.timeline import step_timeline
    seen = []

    def prefers_direct(plan):
        seen.append(plan.routed)
        return 0.0 if not plan.routed else 1.0

    ctx = PlanContext(cost=tiny_cost().routed(True), tokens_per_gpu=CAP, step_model=prefers_direct)
    decided = DecidingZeppelinPlanner().plan(BATCH, ctx)
    assert not decided.routed and True in seen and False in seen
    assert Plan.from_json(decided.to_json()) == decided
    # Run direct, the plan's transfers are what the direct cost model times.
    direct = step_timeline(dataclasses.replace(decided, routed=True), tiny_cost().routed(False)).step_s
    assert step_timeline(decided, tiny_cost().routed(True)).step_s == pytest.approx(direct, rel=1e-12)
