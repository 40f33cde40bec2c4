"""The replay's communication lanes are the engine's (``comm/lanes.py`` on NCCL):
per rank one lane per link class, posting a wave's transfers as one batch once
every send of it has its data; a batch's received bytes land when the whole
batch is done, and the lane's next batch waits for it; a port carries its
transfers back to back, as NCCL's grouped sends and receives share it.
Hand-built schedules on two nodes of two GPUs (ranks 0, 1 on node 0; 2, 3 on
node 1), the all-to-alls on two nodes of four."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.schedule.ops import COMM, COMPUTE, ScheduleBuilder
from megatron_zeppelin.sim.replay import CompiledSegment, SegmentSet, replay_schedule
from megatron_zeppelin.topology import Topology, load_cluster


def _cost(gpus_per_node: int = 2) -> CostModel:
    cluster = load_cluster("h100-8x400g")
    topo = Topology(nodes=2, gpus_per_node=gpus_per_node, nics_per_node=2)
    return CostModel(dataclasses.replace(cluster, topology=topo), load_model("llama-7b"))


def _timed(build):
    """Build a schedule with ``build(add)`` and replay it; returns the timings by handle."""
    b = ScheduleBuilder(4)
    handles = {}

    def add(name, deps=(), *, rank, peer=None, mib=0, pairs=0):
        fields = (dict(kind=COMM, tier="inter" if rank // 2 != peer // 2 else "intra", peer=peer,
                       nbytes=mib << 20, nic=rank % 2 if rank // 2 != peer // 2 else None, name=name)
                  if peer is not None else
                  dict(kind=COMPUTE, tier="local", pairs=pairs, block=4096, lengths=(), name=name))
        handles[name] = b.add((len(handles),), [handles[d] for d in deps], rank=rank, **fields)

    build(add)
    schedule = b.build()
    timings = replay_schedule(schedule, _cost()).timings[0]
    order = b.sorted_handles()
    return {name: timings[order.index(h)] for name, h in handles.items()}


def test_a_batch_is_posted_once_all_its_sends_have_their_data():
    """Two sends of one wave on one lane: the one whose kernel is short waits for the
    other's long kernel."""
    t = _timed(lambda add: (add("quick", rank=0, pairs=1),
                            add("work", rank=0, pairs=1 << 26),
                            add("ready", ["quick"], rank=0, peer=1, mib=1),
                            add("late", ["work"], rank=0, peer=1, mib=1)))
    assert t["ready"].start_s == t["work"].end_s > 0
    assert t["late"].start_s == t["ready"].end_s           # one NVLink port: one after the other


def test_lanes_of_two_link_classes_do_not_wait_for_each_other():
    """An intra-node send leaves at once while the inter-node one of its wave, first
    in the global order, waits for its data."""
    t = _timed(lambda add: (add("work", rank=0, pairs=1 << 26),
                            add("inter", ["work"], rank=0, peer=2, mib=1),
                            add("intra", rank=0, peer=1, mib=1)))
    assert t["intra"].start_s == 0 and t["inter"].start_s == t["work"].end_s > 0


def test_received_bytes_land_with_the_whole_batch():
    """Rank 1 receives a small and a large transfer in one wave: what waits for the
    small one starts when the large one is done too, and the next wave too."""
    t = _timed(lambda add: (add("small", rank=0, peer=1, mib=1),
                            add("large", rank=0, peer=1, mib=64),
                            add("use", ["small"], rank=1, pairs=1 << 20),
                            add("next", ["small"], rank=1, peer=0, mib=1)))
    assert t["small"].end_s < t["large"].end_s
    assert t["use"].start_s == t["large"].end_s
    assert t["next"].start_s == t["large"].end_s


def test_a_lane_posts_its_next_batch_after_the_previous_is_done():
    """Rank 1's inter-node lane: its wave-1 receive waits for its wave-0 batch (a long
    send), though the wave-1 sender is ready long before."""
    t = _timed(lambda add: (add("long", rank=1, peer=3, mib=64),
                            add("first", rank=3, peer=2, mib=1),
                            add("second", ["first"], rank=2, peer=1, mib=1)))
    assert t["first"].end_s < t["long"].end_s == t["second"].start_s


def test_a_whole_step_schedule_replays_as_the_chain_of_its_engine_calls():
    """A step's schedule in one piece (what traces hold) replays call by call, each
    call's waves on their own as the engine posts them: the same finish as the
    chain of segments ``sim --plan`` replays.  (As one schedule its waves would
    run on across calls and a later call's transfers wait for the receiver's
    previous call: it would not even finish.)  The 8-GPU golden Zeppelin plan:
    rings, Ulysses groups, local work and remap, 2 layers."""
    import json
    from pathlib import Path

    from megatron_zeppelin.plan import Plan
    from megatron_zeppelin.schedule.step import StepShape, remap_messages, step_schedule
    from megatron_zeppelin.sim.replay import replay_step
    from megatron_zeppelin.sim.timeline import step_parts, step_shape, transport_of

    golden = Path(__file__).parent / "golden"
    case = json.loads((golden / "replay_steps.json").read_text())["cases"][0]
    cost = CostModel(load_cluster(golden / "clusters" / f"{case['cluster']}.yaml", nodes=case["nodes"]),
                     load_model(case["model"]), routing=case["routing"])
    plan = Plan.from_dict(case["plan"])
    layers, remap = 2, bool(remap_messages(plan))
    shape = StepShape(layers, step_shape(cost, remap).attn, cost.model.hidden_size, remap=remap)
    whole = step_schedule(plan, shape, transport_of(cost)).schedule
    assert remap and len(set(whole.calls)) == 2 * layers * 4
    chain = replay_step(step_parts(plan, cost), layers, cost, plan.world_size, exact=True)
    assert replay_schedule(whole, cost).finish_s == pytest.approx(chain.finish_s, rel=1e-12)


def _all_to_alls(groups, tokens) -> tuple[float, float]:
    """Replay one wave of all-to-alls among ``groups`` (2 nodes of 4 GPUs, 2 NICs
    each), ``tokens(src, dst)`` tokens of 8 KiB from ``src`` to ``dst``; returns
    (when the last rank is done, the busiest port's seconds of transfers)."""
    cost = _cost(gpus_per_node=4)
    b = ScheduleBuilder(8)
    for group in groups:
        for src in group:
            for dst in group:
                if src != dst:
                    inter = src // 4 != dst // 4
                    b.add((len(b.sorted_handles()),), [], rank=src, kind=COMM, peer=dst, name="a2a",
                          tier="inter" if inter else "intra", nbytes=tokens(src, dst) << 13, nic=None)
    schedule = b.build()
    segment = CompiledSegment(schedule, cost)
    laid = SegmentSet([segment])
    load = np.zeros(laid.n_ports)
    for ports in (laid.port_out, laid.port_in):
        np.add.at(load, ports[segment.is_comm], segment.seconds[segment.is_comm])
    return max(replay_schedule(schedule, cost).finish_s), float(load.max())


def test_an_all_to_all_ends_when_its_busiest_port_has_moved_its_bytes():
    """NCCL runs a batch's sends and receives together, each port carrying its
    transfers' bytes back to back: overlapping all-to-alls (Ulysses groups sharing
    ranks) whose messages differ by one token take as long as equal ones, plus
    that token -- not the 1.1-1.7x that booking each transfer into a window
    where both its ports are exclusively free gave (its windows fragment: 1.087x here)."""
    everyone = list(range(8))
    groups = [[0, 2, 3, 7], [0, 1, 3, 7], everyone, [0, 3], everyone, [0, 1, 4, 5]]
    equal, equal_load = _all_to_alls(groups, lambda src, dst: 1000)
    uneven, uneven_load = _all_to_alls(groups, lambda src, dst: 1000 + (src + 2 * dst) % 3 // 2)
    assert equal == pytest.approx(equal_load, rel=1e-12)
    assert uneven == pytest.approx(uneven_load, rel=1e-12)
    assert 1 < uneven / equal < 1.001
