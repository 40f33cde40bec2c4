"""The compiled replay (``sim/event_loop.py``) against recorded step times
(``golden/replay_steps.json``, recorded at the commit it names): every plan --
Zeppelin with routing and remap on and off, a TP view, TE CP, Ulysses, hybrid
CP, FlexSP and packed DP, on H100 and A800 clusters of 8 to 32 GPUs -- replays
bit for bit as recorded: the step, every rank's finish, every (rank, tier)
busy sum in its order, every part's time, an exact 3-layer replay, and one
schedule's op timings.  The 15 plans that move bytes were re-recorded when the
replay took the engine's two communication lanes and wave batches (before:
one send lane per rank, from the interpreted loop at fe1c6b5), and the 10 of
them whose ports carry more than one transfer at a time again when a port
came to carry its transfers back to back instead of booking each into a
window where both its ports were free (0 to 3.6 % faster); packed DP's,
which moves none, is the original recording.  The cluster constants are the
ones the goldens were recorded with (``golden/clusters/``, pinned copies of the
presets), so retuning ``configs/clusters/`` leaves the goldens alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.tp import tp_view
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.sim import event_loop
from megatron_zeppelin.sim.replay import (CompiledSegment, SegmentSet, replay_chain, replay_chains, replay_schedule,
                                          replay_step)
from megatron_zeppelin.sim.timeline import PACKED_STRATEGIES, step_parts, step_timeline
from megatron_zeppelin.topology import load_cluster

GOLDEN = Path(__file__).parent / "golden"
CASES = json.loads((GOLDEN / "replay_steps.json").read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['plan']['strategy']}-{c['cluster']}-{c['plan']['world_size']}"
                                             f"-r{int(c['routing'])}-tp{c['tp']}" for c in CASES])
def test_replay_equals_the_recorded_one(case):
    cluster = load_cluster(GOLDEN / "clusters" / f"{case['cluster']}.yaml", nodes=case["nodes"])
    # Recorded when the engine sent dK/dV only in fp32: the goldens pin that setting.
    cost = CostModel(cluster, load_model(case["model"]), routing=case["routing"], ring_grad_dtype="fp32")
    cost = tp_view(cost, case["tp"]) if case["tp"] > 1 else cost
    plan = Plan.from_dict(case["plan"])
    parts = step_parts(plan, cost, pack=plan.strategy in PACKED_STRATEGIES)
    step = replay_step(parts, cost.model.num_layers, cost, plan.world_size)
    assert step.finish_s == case["finish_s"]
    assert [[r, tier, s] for (r, tier), s in step.busy_s.items()] == case["busy_s"]
    assert step.segment_s == case["segment_s"]
    assert replay_step(parts, 3, cost, plan.world_size, exact=True).finish_s == case["exact3_finish_s"]
    assert step_timeline(plan, cost, reuse=False).step_s == case["step_s"]
    if "attn_fwd_timings" in case:
        timed = replay_schedule(parts[0][1], cost).timings[0]
        assert [[t.start_s, t.end_s] for t in timed] == case["attn_fwd_timings"]


@pytest.mark.parametrize("strategy", ["zeppelin", "megatron_hybrid_cp"])
def test_chains_that_begin_alike_replay_as_each_alone(strategy):
    """``replay_chains`` replays the 3- and 4-layer chains' first three forward
    layers once and carries that state into the other: each chain's every op
    timing, finish, busy sum and time in each instance equal its own replay,
    and the shared run did pause inside the chain (after time 0, before the end)."""
    case = next(c for c in CASES if c["plan"]["strategy"] == strategy)
    cluster = load_cluster(GOLDEN / "clusters" / f"{case['cluster']}.yaml", nodes=case["nodes"])
    cost = CostModel(cluster, load_model(case["model"]), routing=case["routing"])
    plan = Plan.from_dict(case["plan"])
    parts = step_parts(plan, cost, pack=plan.strategy in PACKED_STRATEGIES)
    fwd = [CompiledSegment(f, cost, name) for name, f, _ in parts]
    bwd = [CompiledSegment(b, cost, name) for name, _, b in parts]
    chains = [fwd * layers + bwd[::-1] * layers for layers in (3, 4)]
    segments = SegmentSet(fwd + bwd)
    together = replay_chains(chains, plan.world_size, record=True, segments=segments)
    for chain, shared in zip(chains, together):
        alone = replay_chain(chain, plan.world_size, record=True, segments=segments)
        assert shared.finish_s == alone.finish_s
        assert list(shared.busy_s.items()) == list(alone.busy_s.items())
        assert shared.inside_s.tolist() == alone.inside_s.tolist()
        assert shared.timings == alone.timings
    first = np.array([segments.index[id(seg)] for seg in chains[0]], np.int64)
    state = event_loop._start(plan.world_size, first, *segments.arrays, False)
    assert event_loop._run(state, plan.world_size, first, *segments.arrays, False, 3 * len(parts))
    assert 0 < state[-2][0] < min(together[0].finish_s)          # its clock
