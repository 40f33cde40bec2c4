"""Cluster description: nodes x GPUs per node x NICs per node, links, GPU->NIC affinity.

Ranks are numbered node-major, as torchrun/srun number them:
``rank = node * gpus_per_node + local``.  ``ClusterConfig`` is the data of a
preset (``configs/clusters/*.yaml``); ``Topology`` is the part every layer needs
at run time (which rank is on which node, which NIC a GPU sits next to).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.presets import build_dataclass, load_yaml, resolve_preset


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Compute characteristics of one GPU (what the cost model needs)."""

    name: str
    """Marketing name, for reports."""
    peak_tflops: float
    """Dense bf16 peak, TFLOP/s."""
    attn_efficiency: float
    """Fraction of peak an attention kernel reaches on long blocks (0..1]."""
    attn_half_block: int
    """Block length (tokens) at which attention reaches half of ``attn_efficiency``;
    models the falling kernel efficiency of short blocks."""
    linear_efficiency: float
    """Fraction of peak reached by the GEMMs of projections and MLP (0..1]."""
    memory_gib: float
    """HBM capacity, GiB (the static baselines' TP x CP search checks weights,
    gradients, optimizer states and activations against it)."""
    hbm_GBps: float
    """HBM bandwidth, GB/s: the optimizer step is a memory-bound sweep over the
    parameters, gradients and Adam states."""

    def __post_init__(self) -> None:
        for name in ("attn_efficiency", "linear_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"gpu.{name} must be in (0, 1], got {value}")
        if self.peak_tflops <= 0 or self.attn_half_block < 0:
            raise ConfigError("gpu.peak_tflops must be > 0 and gpu.attn_half_block >= 0")
        if self.memory_gib <= 0 or self.hbm_GBps <= 0:
            raise ConfigError("gpu.memory_gib and gpu.hbm_GBps must be > 0")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One link class: bandwidth per direction and per-message latency."""

    bandwidth_GBps: float
    """Bandwidth per direction, GB/s (1e9 bytes per second)."""
    latency_us: float
    """Fixed cost per message, microseconds."""

    def __post_init__(self) -> None:
        if self.bandwidth_GBps <= 0 or self.latency_us < 0:
            raise ConfigError(f"link bandwidth must be > 0 and latency >= 0, got {self}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` as one message over this link."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_GBps * 1e9)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Which rank lives on which node and which NIC each GPU uses."""

    nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """GPUs (ranks) per node."""
    nics_per_node: int
    """Inter-node NICs per node; each GPU is bound to one of them."""
    nic_affinity: tuple[int, ...] = ()
    """``nic_affinity[local_gpu]`` = NIC index of that GPU; empty means the
    usual PCIe layout: GPUs split evenly, ``local * nics // gpus``."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.nics_per_node < 1:
            raise ConfigError(f"nodes, gpus_per_node and nics_per_node must be >= 1, got "
                              f"{self.nodes}x{self.gpus_per_node} GPUs, {self.nics_per_node} NICs")
        if self.gpus_per_node % self.nics_per_node:
            raise ConfigError(f"{self.nics_per_node} NICs per node do not divide {self.gpus_per_node} "
                              "GPUs per node; use a NIC count that divides the GPU count")
        if not self.nic_affinity:
            object.__setattr__(self, "nic_affinity", tuple(
                g * self.nics_per_node // self.gpus_per_node for g in range(self.gpus_per_node)))
        affinity = tuple(self.nic_affinity)
        object.__setattr__(self, "nic_affinity", affinity)
        if len(affinity) != self.gpus_per_node:
            raise ConfigError(f"nic_affinity lists {len(affinity)} GPUs but a node has "
                              f"{self.gpus_per_node}; give one NIC index per GPU")
        bad = [n for n in affinity if not 0 <= n < self.nics_per_node]
        if bad:
            raise ConfigError(f"nic_affinity names NIC {bad[0]} but a node has NICs "
                              f"0..{self.nics_per_node - 1}; fix the affinity map")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def rank_of(self, node: int, local: int) -> int:
        return node * self.gpus_per_node + local

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node))

    def nic_of(self, rank: int) -> int:
        """NIC index (within its node) that ``rank``'s GPU sends through."""
        return self.nic_affinity[self.local_of(rank)]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def check_world_size(self, world_size: int) -> None:
        """Raise a clear error when the launched world does not match this topology."""
        if world_size != self.world_size:
            raise ConfigError(f"world size {world_size} does not match the topology "
                              f"{self.nodes} nodes x {self.gpus_per_node} GPUs per node = "
                              f"{self.world_size}; fix --nodes/--gpus-per-node or the launch")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """A cluster preset: topology plus the performance numbers of its parts."""

    name: str
    """Preset name (file stem)."""
    topology: Topology
    """Nodes, GPUs, NICs and affinity."""
    gpu: GpuSpec
    """The GPU model."""
    nvlink: LinkSpec
    """Intra-node GPU<->GPU link, per GPU per direction."""
    nic: LinkSpec
    """One inter-node NIC, per direction."""

    def with_nodes(self, nodes: int) -> "ClusterConfig":
        """The same cluster with another node count (``--nodes``)."""
        return dataclasses.replace(self, topology=dataclasses.replace(self.topology, nodes=nodes))


def load_cluster(name_or_path: str | os.PathLike, nodes: int | None = None) -> ClusterConfig:
    """Load a cluster preset by name (``configs/clusters/``) or YAML path."""
    path = resolve_preset("clusters", name_or_path)
    data = load_yaml(path)
    src = str(path)
    parts = {}
    for key, cls in (("gpu", GpuSpec), ("nvlink", LinkSpec), ("nic", LinkSpec)):
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"{src}: missing or malformed section {key!r}; see configs/clusters/")
        parts[key] = build_dataclass(cls, data.pop(key), f"{src} [{key}]")
    topo_keys = {f.name for f in dataclasses.fields(Topology)}
    topo_data = {k: data.pop(k) for k in list(data) if k in topo_keys}
    if "nic_affinity" in topo_data:
        topo_data["nic_affinity"] = tuple(topo_data["nic_affinity"])
    topology = build_dataclass(Topology, topo_data, src)
    cfg = build_dataclass(ClusterConfig, {"name": data.pop("name", path.stem), **data,
                                          "topology": topology, **parts}, src)
    if nodes is not None:
        cfg = cfg.with_nodes(nodes)
    return cfg


def plan_topology(topology: Topology, world_size: int, tp: int, tp_rank: int) -> Topology:
    """The data-parallel ranks of one tensor-parallel rank as a cluster of their own.

    Megatron numbers ranks tensor-parallel-fastest (``rank = dp_rank * tp + tp_rank``
    with pipeline and context parallel size 1), so a node holds ``gpus_per_node / tp``
    data-parallel ranks; each keeps the NIC of its GPU.  With TP every per-rank cost
    (attention, linear, ring bytes) shrinks by the same factor ``tp``, so the planner's
    choices, which weigh these costs against each other, are those of the DP view.
    """
    g = topology.gpus_per_node
    if world_size % g:
        raise ConfigError(f"world size {world_size} is not a multiple of the cluster's {g} GPUs per node; "
                          "pick a --zeppelin-cluster preset matching the nodes you launched")
    if g % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the cluster's {g} GPUs per "
                          "node; a TP group must stay inside one node")
    nics = [topology.nic_affinity[local * tp + tp_rank] for local in range(g // tp)]
    renumber = {nic: i for i, nic in enumerate(sorted(set(nics)))}
    return Topology(nodes=world_size // g, gpus_per_node=g // tp, nics_per_node=len(renumber),
                    nic_affinity=tuple(renumber[n] for n in nics))
