"""Tensor parallelism seen from the planner: a TP group acts as one wider rank.

Megatron's TP (with sequence parallelism) splits every GEMM and the attention
heads over ``t`` GPUs of one node, and the activations too.  For a planner
that places sequences on ranks, a TP group is then one rank with ``t`` times
the compute, the HBM, the NVLink ports and the NICs of its GPUs (each GPU
moves the K/V of its own heads over its own links), holding ``t`` times the
tokens.  :func:`tp_view` builds that cluster; the cost model's ``tp_size``
adds what the grouping costs: the TP collectives of every layer.
"""

from __future__ import annotations

import dataclasses

from megatron_zeppelin.cost.model import CostModel
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.topology import ClusterConfig, LinkSpec, Topology


def tp_problem(cluster: ClusterConfig, heads: int, kv_heads: int, tp: int) -> str | None:
    """Why ``tp`` cannot be used on this cluster and model, or None."""
    g = cluster.topology.gpus_per_node
    if tp < 1 or g % tp:
        return f"TP={tp} does not divide the {g} GPUs of a node (TP stays inside NVLink)"
    if heads % tp or kv_heads % tp:
        return f"TP={tp} does not divide {heads} heads / {kv_heads} KV heads"
    return None


def tp_cluster(cluster: ClusterConfig, tp: int) -> ClusterConfig:
    """The cluster whose ranks are TP groups of ``tp`` consecutive GPUs."""
    if tp == 1:
        return cluster
    topo = cluster.topology
    gpn = topo.gpus_per_node // tp
    nics = min(topo.nics_per_node, gpn)
    # A group's GPUs reach tp * NICs / GPUs distinct NICs (at least one shared one).
    nic_scale = topo.nics_per_node / nics
    gpu = dataclasses.replace(cluster.gpu, peak_tflops=cluster.gpu.peak_tflops * tp,
                              memory_gib=cluster.gpu.memory_gib * tp, hbm_GBps=cluster.gpu.hbm_GBps * tp)
    return dataclasses.replace(
        cluster, name=f"{cluster.name}/tp{tp}",
        topology=Topology(nodes=topo.nodes, gpus_per_node=gpn, nics_per_node=nics),
        gpu=gpu,
        nvlink=LinkSpec(bandwidth_GBps=cluster.nvlink.bandwidth_GBps * tp,
                        latency_us=cluster.nvlink.latency_us),
        nic=LinkSpec(bandwidth_GBps=cluster.nic.bandwidth_GBps * nic_scale,
                     latency_us=cluster.nic.latency_us))


def tp_view(cost: CostModel, tp: int) -> CostModel:
    """``cost`` on TP groups of ``tp`` GPUs (``tp_size`` prices the collectives).
    A TP size the cluster or model cannot use is a :class:`ConfigError`."""
    if cost.tp_size != 1:
        raise ConfigError("tp_view of a cost model that already has TP; start from the TP=1 model")
    m = cost.model
    problem = tp_problem(cost.cluster, m.num_attention_heads, m.num_query_groups, tp)
    if problem:
        raise ConfigError(f"{problem}; pick a TP size that divides both")
    return dataclasses.replace(cost, cluster=tp_cluster(cost.cluster, tp), tp_size=tp)
