"""The schedule builder yields the same ops, op for op, as the builder it
replaced (``golden/schedule_digests.json``: a SHA-256 of every op's repr and the
message table, recorded before the builder was rewritten for speed).

Plans: the 16 of ``tests/sim/golden/replay_steps.json`` (Zeppelin with routing
and remap on and off, a TP view, TE CP, Ulysses, hybrid CP, FlexSP and packed
DP on H100 and A800 clusters of 8 to 32 GPUs), each replayed segment as the
simulator builds it (``step_parts``, packed and unpacked) and a whole 2-layer
step as the engine runs it (``step_schedule``, with each segment's entry
dependencies); and four 64-GPU plans (Zeppelin with and without its decision,
hybrid CP, and 78 CP=8 rings built unpacked: uniform CP)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.tp import tp_view
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.schedule.ops import Schedule
from megatron_zeppelin.schedule.step import step_schedule
from megatron_zeppelin.sim.timeline import step_parts, step_shape, transport_of
from megatron_zeppelin.topology import load_cluster

HERE = Path(__file__).parent
SIM_CASES = json.loads((HERE.parent / "sim" / "golden" / "replay_steps.json").read_text())["cases"]
FIXTURE = HERE / "golden" / "schedule_digests.json"


def digest(schedule: Schedule) -> str:
    h = hashlib.sha256(f"{schedule.world_size}|{schedule.messages!r}".encode())
    for op in schedule.ops:
        h.update(repr(op).encode())
    return h.hexdigest()


def _cases() -> dict[str, dict]:
    cases = {f"sim{i}-{c['plan']['strategy']}": c for i, c in enumerate(SIM_CASES)}
    cases.update(json.loads(FIXTURE.read_text())["plans"])
    return cases


def _cost(case: dict) -> CostModel:
    # Recorded when the engine sent dK/dV only in fp32: the digests pin that setting.
    cost = CostModel(load_cluster(case["cluster"], nodes=case["nodes"]), load_model(case["model"]),
                     routing=case["routing"], ring_grad_dtype="fp32")
    return tp_view(cost, case["tp"]) if case["tp"] > 1 else cost


def digests_of(case: dict) -> dict[str, list[str]]:
    """Every schedule of ``case`` the test compares, by what built it."""
    cost, plan = _cost(case), Plan.from_dict(case["plan"])
    out = {f"parts_pack{int(pack)}": [digest(s) for _, *pair in step_parts(plan, cost, pack=pack) for s in pair]
           for pack in (False, True)}
    if plan.world_size <= 32:
        shape = dataclasses.replace(step_shape(cost, True), num_layers=2)
        out["step2"] = [digest(step_schedule(plan, shape, transport_of(cost)).schedule)]
    return out


@pytest.mark.parametrize("name", sorted(_cases()))
def test_builder_yields_the_recorded_ops(name):
    assert digests_of(_cases()[name]) == json.loads(FIXTURE.read_text())["digests"][name]


if __name__ == "__main__":      # re-record (only from a builder known to be right)
    doc = json.loads(FIXTURE.read_text())
    doc["digests"] = {name: digests_of(case) for name, case in sorted(_cases().items())}
    FIXTURE.write_text(json.dumps(doc, indent=1) + "\n")
