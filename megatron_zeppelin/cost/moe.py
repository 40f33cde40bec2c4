"""MoE traffic: the router's all-to-all over the expert-parallel ranks.

The experts' FLOPs are in ``ModelConfig.linear_flops_per_token`` (router plus
``topk`` experts per token).  With experts spread over ``expert_parallel_size``
ranks, each token's hidden state also travels to its ``topk`` experts and back
(dispatch and combine), forward and backward: four all-to-alls per layer, each
rank sending ``(ep - 1) / ep`` of ``tokens x topk`` hidden states.  Expert
groups are consecutive ranks, so they stay inside a node when ``ep`` fits one.
``CostModel.moe_dispatch_s`` prices it (this module knows the model, not the
cluster, so the cost model imports it and never the other way).
"""

from __future__ import annotations

from megatron_zeppelin.model_config import ModelConfig

#: All-to-alls per MoE layer and step: dispatch and combine, forward and backward.
ALLTOALLS_PER_LAYER = 4


def moe_alltoall_group(model: ModelConfig, world_size: int) -> list[int] | None:
    """The ranks of one expert-parallel group, or None where there is no router
    all-to-all (a dense model, or experts on every rank)."""
    ep = model.expert_parallel_size
    if not model.moe_enabled or ep == 1:
        return None
    return list(range(min(ep, world_size)))


def moe_alltoall_bytes(model: ModelConfig, tokens: float) -> float:
    """Bytes of hidden states one rank's ``tokens`` send to their experts in one all-to-all."""
    return tokens * model.moe_router_topk * model.hidden_bytes_per_token
