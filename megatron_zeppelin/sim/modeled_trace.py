"""Modeled traces and the replay of executed ones (``sim --trace``, ``sim replay``, ``sim --plan``).

A modeled trace is the whole step schedule of a Plan (every layer, forward and
backward; ``schedule/step.py``) replayed op by op; an executed trace
(``train --dump-trace``) holds the same ops with the times the engine measured,
and :func:`replay_trace` re-times them with the cost model.  The engine settings
a plan ran with -- dtypes, routing threshold, local packing -- travel with it
(the ``engine`` key of a dumped Plan, ``otherData`` of a trace) so that both
sides build the very same ops.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.schedule.attention import AttnShape, Transport
from megatron_zeppelin.schedule.ops import Schedule
from megatron_zeppelin.schedule.step import StepShape, remap_messages, step_schedule
from megatron_zeppelin.schedule.trace import write_trace
from megatron_zeppelin.sim.replay import OpTiming, replay_schedule
from megatron_zeppelin.sim.timeline import step_shape, sync_tail, transport_of
from megatron_zeppelin.topology import Topology


def engine_settings(attn: AttnShape, transport: Transport) -> dict[str, Any]:
    """What a plan or trace records of the engine that ran it."""
    topo = transport.topology
    return {"nodes": topo.nodes, "gpus_per_node": topo.gpus_per_node, "nics_per_node": topo.nics_per_node,
            "nic_affinity": list(topo.nic_affinity), "q_heads": attn.q_heads, "kv_heads": attn.kv_heads, "head_dim": attn.head_dim,
            "itemsize": attn.itemsize, "acc_itemsize": attn.acc_itemsize,
            "local_pack_tokens": attn.local_pack_tokens,
            "min_routed_bytes": None if math.isinf(transport.min_routed_bytes) else transport.min_routed_bytes}


def with_recorded_topology(cost: CostModel, settings: Mapping[str, Any] | None,
                           nodes: int | None = None) -> CostModel:
    """``cost`` on the topology a run recorded (the trainer may override the
    preset's GPUs and NICs per node); link speeds and GPU stay the cluster's.
    ``nodes`` (a user's ``--nodes``) must agree with the recording."""
    if not settings or "gpus_per_node" not in settings:
        return cost
    if nodes is not None and nodes != settings.get("nodes"):
        world = settings.get("nodes", 0) * settings.get("gpus_per_node", 0)
        raise ConfigError(f"it ran on {settings.get('nodes')} nodes ({world} ranks) but --nodes says {nodes}; "
                          "drop --nodes or pass the one it ran on")
    try:
        topo = Topology(nodes=int(settings["nodes"]), gpus_per_node=int(settings["gpus_per_node"]),
                        nics_per_node=int(settings["nics_per_node"]),
                        nic_affinity=tuple(int(x) for x in settings.get("nic_affinity", ())))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the recorded topology is malformed ({exc!r}); dump it again") from None
    return dataclasses.replace(cost, cluster=dataclasses.replace(cost.cluster, topology=topo))


def from_settings(settings: Mapping[str, Any] | None, cost: CostModel) -> tuple[AttnShape, Transport]:
    """The attention shape and transport of recorded ``settings`` (else ``cost``'s)."""
    shape = step_shape(cost, True).attn
    transport = transport_of(cost)
    if not settings:
        return shape, transport
    try:
        attn = AttnShape(int(settings["q_heads"]), int(settings["kv_heads"]), int(settings["head_dim"]),
                         int(settings["itemsize"]), int(settings["acc_itemsize"]),
                         int(settings["local_pack_tokens"]))
        threshold = settings["min_routed_bytes"]
        routed = Transport(cost.cluster.topology, math.inf if threshold is None else float(threshold))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the recorded engine settings are malformed ({exc!r}); dump the plan again") from None
    return attn, routed


def check_fits(world_size: int, cost: CostModel, what: str) -> None:
    world = cost.cluster.topology.world_size
    if world_size != world:
        raise ConfigError(f"{what} spans {world_size} ranks but the cluster has {world} GPUs "
                          f"({cost.cluster.topology.nodes} nodes x {cost.cluster.topology.gpus_per_node}); "
                          "pass the --cluster and --nodes it ran on")


def modeled_step(plan: Plan, cost: CostModel, attn: AttnShape, transport: Transport) -> tuple[Schedule, list[OpTiming]]:
    """The whole step schedule of ``plan`` replayed op by op (no layer skipped)."""
    shape = StepShape(cost.model.num_layers, attn, cost.model.hidden_size, remap=bool(remap_messages(plan)))
    schedule = step_schedule(plan, shape, transport).schedule
    return schedule, replay_schedule(schedule, cost).timings[0]


def write_modeled_trace(path, plan: Plan, cost: CostModel, attn: AttnShape, transport: Transport) -> float:
    """Write the modeled trace of one step of ``plan``; returns its step time."""
    schedule, timings = modeled_step(plan, cost, attn, transport)
    write_trace(path, schedule, {t: (x.start_s * 1e6, x.end_s * 1e6) for t, x in enumerate(timings)},
                {"source": "model", "strategy": plan.strategy, "cluster": cost.cluster.name,
                 "model": cost.model.name, "num_layers": cost.model.num_layers,
                 "engine": engine_settings(attn, transport)})
    return max(x.end_s for x in timings) if timings else 0.0


def replay_trace(schedule: Schedule, meta: Mapping[str, Any], cost: CostModel, path: str) -> float:
    """Re-time an executed (or modeled) trace's ops and dependencies with ``cost``;
    the step ends with the gradient sync, as :func:`step_timeline`'s does."""
    check_fits(schedule.world_size, cost, f"trace {path!r}")
    layers = meta.get("num_layers")
    if layers is not None and layers != cost.model.num_layers:
        raise ConfigError(f"trace {path!r} ran a {layers}-layer model but --model {cost.model.name} has "
                          f"{cost.model.num_layers} layers; pass the model it ran")
    replay = replay_schedule(schedule, cost)
    return replay.step_s + sync_tail(cost, replay.busy_s, replay.finish_s).exposed_s
