"""The end of a step: gradient sync over data parallelism and the optimizer.

Both are the same for every rank of a plan and sit after the slowest rank's
backward, so the simulator adds them to the step once.  Every rank of a plan
is a data-parallel replica of the weights (Zeppelin's ranks; Megatron reduces
over its DP x CP group, which is the same set), a tensor-parallel group when
the cost model is a TP view (:mod:`megatron_zeppelin.cost.tp`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO, LINEAR_BWD_RATIO, CostModel
from megatron_zeppelin.topology import LinkSpec

#: Bytes per gradient element on the wire: Megatron accumulates and all-reduces
#: bf16 models' gradients in fp32 (``--accumulate-allreduce-grads-in-fp32`` is
#: forced on with ``--bf16``, megatron/training/arguments.py).
GRAD_BYTES = 4
#: Megatron long-context recipes run ``--use-distributed-optimizer``: the
#: gradient all-reduce becomes a reduce-scatter (fp32) plus an all-gather of the
#: updated bf16 weights, together the bytes of one all-reduce.
#: Parameters per gradient bucket: ``max(40_000_000, 1_000_000 * dp)``, the
#: default of ``DistributedDataParallel`` (megatron/core/distributed/
#: distributed_data_parallel.py) when ``--overlap-grad-reduce`` is on.
BUCKET_MIN_PARAMS = 40_000_000
BUCKET_PARAMS_PER_RANK = 1_000_000
#: HBM bytes the fused Adam step moves per parameter: reads fp32 main weight,
#: fp32 gradient, m and v (16 B); writes main weight, m, v (12 B) and the bf16
#: model weight (2 B) (Megatron's distributed optimizer, apex FusedAdam).
ADAM_BYTES_PER_PARAM = 30
#: Fraction of HBM bandwidth a multi-tensor fused Adam kernel reaches
#: (estimate: streaming kernels on A100/H100 reach ~80 % of the datasheet).
OPTIMIZER_HBM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class StepSync:
    """Seconds after the last rank's compute."""

    grad_reduce_s: float
    """Whole reduce-scatter of the gradients (all buckets)."""
    param_gather_s: float
    """Whole all-gather of the updated bf16 weights (all buckets)."""
    grad_exposed_s: float
    """What backward (for the reduce-scatter) and the next forward (for the
    all-gather) could not hide: at least the last bucket of each."""
    optimizer_s: float
    """Adam over this rank's shard of the states (distributed optimizer)."""

    @property
    def exposed_s(self) -> float:
        return self.grad_exposed_s + self.optimizer_s


def forward_backward_split(attn_s: float, linear_s: float) -> tuple[float, float]:
    """(forward, backward) seconds inside ``attn_s + linear_s`` of fwd+bwd work."""
    bwd = (attn_s * ATTN_BWD_RATIO / (1 + ATTN_BWD_RATIO)
           + linear_s * LINEAR_BWD_RATIO / (1 + LINEAR_BWD_RATIO))
    return attn_s + linear_s - bwd, bwd


def collective_link(cost: CostModel) -> LinkSpec:
    """Per-GPU bus bandwidth of a ring collective over every rank.

    Inside one node that is NVLink.  Across nodes NCCL runs one ring per
    channel, each crossing a node boundary through a different NIC, so only
    the crossings share the network: the bus bandwidth is the node's total NIC
    bandwidth (capped by NVLink), not one GPU's NIC share.  FlexSP's cluster
    measured 44.7 GB/s all-reduce bus bandwidth over 2 nodes x 8 A100 with
    400 Gb/s per node (Hetu-Galvatron, flexsp branch, hardware_configs)."""
    topo, nvl, nic = cost.cluster.topology, cost.cluster.nvlink, cost.cluster.nic
    if topo.nodes == 1:
        return nvl
    return LinkSpec(bandwidth_GBps=min(nvl.bandwidth_GBps, nic.bandwidth_GBps * topo.nics_per_node),
                    latency_us=nic.latency_us)


def grad_sync_s(cost: CostModel) -> tuple[float, float, int]:
    """(reduce-scatter seconds, all-gather seconds, buckets) of the distributed
    optimizer over all ranks of the plan: a ring collective sends ``(n-1)/n`` of
    the data per rank in ``n-1`` steps per bucket, fp32 gradients in, bf16
    weights out, at :func:`collective_link`'s bus bandwidth."""
    n = cost.cluster.topology.world_size
    if n <= 1:
        return 0.0, 0.0, 0
    params = cost.model.num_parameters
    buckets = max(1, math.ceil(params / max(BUCKET_MIN_PARAMS, BUCKET_PARAMS_PER_RANK * n)))
    link = collective_link(cost)
    latency = buckets * (n - 1) * link.latency_us * 1e-6
    share = (n - 1) / n * params / (link.bandwidth_GBps * 1e9)
    return share * GRAD_BYTES + latency, share * cost.model.dtype_bytes + latency, buckets


def optimizer_s(cost: CostModel) -> float:
    """Adam over ``params / ranks`` (the distributed optimizer shards the states
    over data parallelism), bound by HBM bandwidth."""
    g = cost.cluster.gpu
    shard = cost.model.num_parameters / cost.cluster.topology.world_size
    return shard * ADAM_BYTES_PER_PARAM / (g.hbm_GBps * 1e9 * OPTIMIZER_HBM_EFFICIENCY)


def overlapped_exposed_s(total_s: float, buckets: int, hiding_s: float) -> float:
    """What is left of ``total_s`` of collectives in ``buckets`` that become
    ready evenly during ``hiding_s`` of compute and run one after another: the
    last finishes ``max(A/nb, A - B + B/nb)`` after the compute ends."""
    if not buckets:
        return 0.0
    return max(total_s / buckets, total_s - hiding_s + hiding_s / buckets)


def step_sync(cost: CostModel, forward_s: float, backward_s: float) -> StepSync:
    """The distributed optimizer's gradient reduce-scatter overlapped with the
    slowest rank's ``backward_s`` (``--overlap-grad-reduce``), its weight
    all-gather overlapped with the next step's forward (``--overlap-param-gather``,
    ``forward_s``), and the optimizer step between them."""
    rs, ag, buckets = grad_sync_s(cost)
    exposed = overlapped_exposed_s(rs, buckets, backward_s) + overlapped_exposed_s(ag, buckets, forward_s)
    return StepSync(grad_reduce_s=rs, param_gather_s=ag, grad_exposed_s=exposed, optimizer_s=optimizer_s(cost))
