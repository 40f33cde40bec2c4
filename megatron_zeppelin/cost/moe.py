"""MoE pricing: the router's all-to-all over the expert-parallel ranks.

The experts' FLOPs are in ``ModelConfig.linear_flops_per_token`` (router plus
``topk`` experts per token).  With experts spread over ``expert_parallel_size``
ranks, each token's hidden state also travels to its ``topk`` experts and back
(dispatch and combine), forward and backward: four all-to-alls per layer, each
rank sending ``(ep - 1) / ep`` of ``tokens x topk`` hidden states.  Expert
groups are consecutive ranks, so they stay inside a node when ``ep`` fits one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_zeppelin.cost.model import CostModel

#: All-to-alls per MoE layer and step: dispatch and combine, forward and backward.
ALLTOALLS_PER_LAYER = 4


def moe_dispatch_s(cost: "CostModel", tokens: float) -> float:
    """Seconds of the router's all-to-alls for ``tokens`` tokens of one rank (0 for
    a dense model or experts on every rank)."""
    m = cost.model
    ep = m.expert_parallel_size
    if not m.moe_enabled or ep == 1:
        return 0.0
    link = cost.alltoall_link(list(range(min(ep, cost.cluster.topology.world_size))))
    per_rank = tokens * m.moe_router_topk * m.hidden_bytes_per_token
    return ALLTOALLS_PER_LAYER * m.num_layers * cost.alltoall_s(per_rank, ep, link)
