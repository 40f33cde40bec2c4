"""Tensor (and sequence) parallelism in the trainer: who plans for whom, and gradients.

Ranks are numbered tensor-parallel-fastest (``rank = dp_rank * tp + tp_rank``,
Megatron's default order), so a TP group is ``tp`` adjacent GPUs of one node.
Plans place sequences over the ``world / tp`` data-parallel ranks: every GPU of a
TP group holds the same tokens and ``1/tp`` of each layer's heads and MLP, and
its engine and remap talk to the GPUs of the same TP rank in the other
data-parallel ranks (:func:`~megatron_zeppelin.megatron.groups.data_parallel_comm_groups`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_zeppelin.topology import ClusterConfig, plan_topology


def data_parallel_view(cluster: ClusterConfig, world_size: int, tp: int, tp_rank: int) -> ClusterConfig:
    """The cluster as the data-parallel ranks of TP rank ``tp_rank`` see it
    (``gpus_per_node / tp`` ranks per node, each with its GPU's NIC)."""
    return dataclasses.replace(cluster, topology=plan_topology(cluster.topology, world_size, tp, tp_rank))


def physical_nics(cluster: ClusterConfig, tp: int, tp_rank: int) -> list[int]:
    """NIC of the node behind each NIC number of :func:`data_parallel_view` (which
    renumbers the NICs that TP rank's GPUs use from 0)."""
    topo = cluster.topology
    return sorted({topo.nic_affinity[local * tp + tp_rank] for local in range(topo.gpus_per_node // tp)})


def sequence_parallel_group(enabled: bool) -> dist.ProcessGroup | None:
    """Megatron's TP group when sequence parallelism splits rows over it, else None."""
    if not enabled:
        return None
    from megatron.core import parallel_state as mpu
    return mpu.get_tensor_model_parallel_group()


def allreduce_gradients(model: torch.nn.Module, sequence_parallel: bool) -> float:
    """Sum gradients over the ranks holding the same parameter: the data-parallel
    group, or for experts under expert parallelism (Megatron marks them
    ``allreduce = False``) the expert-data-parallel group; with sequence
    parallelism, also the norm weights' partial gradients over the TP group (each
    TP rank saw ``1/tp`` of the tokens).  Returns the global gradient L2 norm:
    each parameter counted once, TP-sharded ones on every TP rank, experts on
    every rank of their expert TP x EP group, each pipeline stage's own layers."""
    from megatron.core import parallel_state as mpu

    params = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    tp_group = mpu.get_tensor_model_parallel_group()
    first_tp_rank = mpu.get_tensor_model_parallel_rank() == 0
    dense_square = _sum_gradients(dense, mpu.get_data_parallel_group(), tp_group if sequence_parallel else None,
                                  first_tp_rank)
    dist.all_reduce(dense_square, group=tp_group)
    if mpu.get_pipeline_model_parallel_world_size() > 1:   # each stage holds its own layers
        dist.all_reduce(dense_square, group=mpu.get_pipeline_model_parallel_group())
    if not experts:
        return float(dense_square.sqrt())
    expert_square = _sum_gradients(experts, mpu.get_expert_data_parallel_group(), None,
                                   mpu.get_expert_tensor_parallel_rank() == 0)
    dist.all_reduce(expert_square, group=mpu.get_expert_tensor_and_model_parallel_group())
    return float((dense_square + expert_square).sqrt())


def _sum_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup,
                   sequence_parallel_group: dist.ProcessGroup | None, counts_replicated: bool) -> torch.Tensor:
    """All-reduce ``params``' gradients over ``group`` in one flat buffer (and the
    sequence-parallel ones over ``sequence_parallel_group``); returns the squared
    norm of those this rank counts: the TP-sharded ones, and the replicated ones
    where ``counts_replicated``."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    square = torch.zeros((), dtype=torch.float64, device=flat.device)  # NCCL reduces device tensors only
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        grad = flat[offset:offset + n].view_as(p)
        if sequence_parallel_group is not None and getattr(p, "sequence_parallel", False):
            dist.all_reduce(grad, group=sequence_parallel_group)
        if counts_replicated or getattr(p, "tensor_model_parallel", False):
            square += grad.double().pow(2).sum()
        p.grad = grad.to(p.dtype)
        offset += n
    return square
