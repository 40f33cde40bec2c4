"""Pipeline parallelism in the trainer: which ranks plan together, and what it refuses.

Megatron numbers ranks tensor-parallel fastest and pipeline-parallel slowest
(``rank = stage * dp * tp + dp_rank * tp + tp_rank``), so a pipeline stage is
``world / pp`` consecutive ranks: whole nodes, or a slice of one node.  Every
stage of a data-parallel rank processes the same micro-batch, so one Plan, made
over one stage's data-parallel ranks, serves every stage; each stage's engine
runs it on that stage's ranks.  Pure: no torch (the checks run before any
process starts).
"""

from __future__ import annotations

import dataclasses

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.topology import ClusterConfig, Topology, plan_topology


def stage_topology(topology: Topology, world_size: int, pp: int) -> Topology:
    """The GPUs of one pipeline stage as a cluster of their own: ``nodes / pp``
    whole nodes (each with its NICs), or ``world / pp`` GPUs of one node (no
    inter-node link inside the stage, so one NIC stands for the node's)."""
    if pp == 1:
        return topology
    per_stage, g = world_size // pp, topology.gpus_per_node
    if per_stage % g == 0:
        return Topology(nodes=per_stage // g, gpus_per_node=g, nics_per_node=topology.nics_per_node,
                        nic_affinity=topology.nic_affinity)
    return Topology(nodes=1, gpus_per_node=per_stage, nics_per_node=1)


def data_parallel_stage_view(cluster: ClusterConfig, world_size: int, tp: int, pp: int,
                             tp_rank: int) -> ClusterConfig:
    """The cluster as the data-parallel ranks of TP rank ``tp_rank`` of one
    pipeline stage see it: the planners' and the communicator's cluster."""
    stage = stage_topology(cluster.topology, world_size, pp)
    return dataclasses.replace(cluster, topology=plan_topology(stage, world_size // pp, tp, tp_rank))


def stage_of(rank: int, world_size: int, pp: int) -> int:
    """The pipeline stage of global rank ``rank``."""
    return rank // (world_size // pp)


def check_pipeline(pp: int, *, model: ModelConfig, world_size: int, gpus_per_node: int, tp: int,
                   micro_batches: int, expert_parallel_size: int, dump_trace: bool) -> None:
    """``--pp`` combinations the trainer cannot run, each one line naming the fix."""
    if pp == 1:
        return
    if world_size % (pp * tp):
        raise ConfigError(f"--pp {pp} x --tp {tp} does not divide the {world_size} ranks (nodes x GPUs per "
                          "node); pick sizes whose product divides them")
    per_stage = world_size // pp
    if per_stage % gpus_per_node and gpus_per_node % per_stage:
        raise ConfigError(f"--pp {pp} gives stages of {per_stage} ranks, neither whole nodes of {gpus_per_node} "
                          "GPUs nor a slice of one node; pick a --pp that divides the nodes or a node's GPUs")
    if model.num_layers % pp:
        raise ConfigError(f"--pp {pp} does not divide model {model.name}'s {model.num_layers} layers (every "
                          "stage holds the same number); pick a --pp that divides them")
    if micro_batches < pp:
        raise ConfigError(f"--micro-batches {micro_batches} is fewer than the {pp} pipeline stages (1F1B keeps "
                          f"every stage busy only with at least one micro-batch per stage); pass --micro-batches "
                          f"{pp} or more")
    if model.moe_enabled or expert_parallel_size > 1:
        raise ConfigError(f"--pp {pp} with MoE model {model.name} is not tested in the trainer; run MoE "
                          "models with --pp 1")
    if dump_trace:
        raise ConfigError(f"--dump-trace lays one Plan's ranks onto one trace, and under --pp {pp} every stage "
                          "runs that Plan at other times: run it with --pp 1")
