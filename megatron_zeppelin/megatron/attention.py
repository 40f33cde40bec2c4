"""``ZeppelinAttention``: a Megatron-Core core attention that runs the step's Plan.

Megatron-Core's ``SelfAttention`` projects QKV, applies RoPE and calls
``core_attention(query, key, value, attention_mask, attn_mask_type=...,
attention_bias=..., packed_seq_params=...)``.  In the THD format the tensors are
``[t, heads, head_dim]`` for this rank's tokens in the attention layout
(``Plan.attention_spans(rank)`` order); the result must be reshapeable to
``[t, 1, heads * head_dim]``.  Heads are already split by tensor parallelism.

The Plan, communicator and backend arrive in the step's
:class:`~megatron_zeppelin.step_context.StepContext` (bound by
``ZeppelinGPTModel.forward`` from the packed parameters); the engine
(``megatron_zeppelin.attention.engine.plan_attention``) runs its inter-node,
intra-node and local queues.  Without a plan the module is plain packed causal
attention over ``cu_seqlens`` -- the data-parallel reference.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_zeppelin.attention.engine import plan_attention
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.megatron.packed import ZeppelinPackedSeqParams
from megatron_zeppelin.step_context import UsesStepContext


class ZeppelinAttention(UsesStepContext, MegatronModule):
    """Core attention over a Zeppelin Plan (causal, THD, GQA, no dropout)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Any = None, model_comm_pgs: Any = None, **kwargs: Any):
        # cp_comm_type, pg_collection / model_comm_pgs (0.16-0.19 names) and any
        # later keyword are accepted: Zeppelin replaces context parallelism and
        # needs no process group of Megatron's here (rings use the communicator).
        super().__init__(config=config)
        if attention_type != "self":
            raise ConfigError(f"ZeppelinAttention supports self-attention only, got {attention_type!r}")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ConfigError(f"ZeppelinAttention computes causal attention; the layer asks for "
                              f"{attn_mask_type.name}; use a causal GPT layer spec")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ConfigError(f"attention dropout {dropout} is not supported by ZeppelinAttention "
                              "(ring and local shards would draw different masks); set it to 0")
        if config.context_parallel_size != 1:
            raise ConfigError("ZeppelinAttention replaces context parallelism; run with "
                              "--context-parallel-size 1 (the Plan decides which sequences are split)")
        if config.apply_rope_fusion:
            raise ConfigError("fused RoPE applies each THD span's positions from 0; Zeppelin needs "
                              "per-token positions: disable it (--no-rope-fusion / apply_rope_fusion=False)")
        self.layer_number = layer_number
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[ZeppelinPackedSeqParams] = None) -> torch.Tensor:
        """q: ``[t, hq, d]``, k/v: ``[t, hk, d]`` -> ``[t, hq * d]``."""
        if not isinstance(packed_seq_params, ZeppelinPackedSeqParams):
            raise ConfigError("ZeppelinAttention needs packed THD input with ZeppelinPackedSeqParams "
                              "(build them with megatron_zeppelin.megatron.build_packed_seq_params)")
        if attention_bias is not None:
            raise ConfigError("ZeppelinAttention does not support an attention bias")
        p, c = packed_seq_params, self.require_step_context()
        if c.plan is None:
            out = packed_causal_attention(query, key, value, p.cu_seqlens_q, self.softmax_scale)
            spans = len(p.cu_seqlens_q) - (1 if p.pad_tokens else 0)  # padding is no sequence
            c.attention_counter.forward_pairs += _packed_pairs(p.cu_seqlens_q[:spans])
        else:
            n = query.shape[0] - p.pad_tokens  # padding rows are not the plan's
            out = plan_attention(query[:n], key[:n], value[:n], plan=c.plan, rank=c.rank,
                                 comm=c.communicator, backend=c.backend, softmax_scale=self.softmax_scale,
                                 counter=c.attention_counter, cache=c.cache, ring_grad_dtype=c.ring_grad_dtype)
            if p.pad_tokens:
                out = torch.cat([out, out.new_zeros((p.pad_tokens, *out.shape[1:]))])
        return out.reshape(out.shape[0], -1)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Plain causal attention inside each span of a packed buffer (no communication).

    q: ``[t, hq, d]``, k/v: ``[t, hk, d]`` with ``hq % hk == 0`` -> ``[t, hq, d]``.
    """
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        # [L, h, d] -> [h, L, d]; KV heads repeated for their query group (GQA).
        qs = q[s:e].transpose(0, 1)
        ks = k[s:e].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[s:e].repeat_interleave(group, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                   scale=softmax_scale).transpose(0, 1))
    return torch.cat(outs) if outs else torch.zeros_like(q)


def _packed_pairs(cu_seqlens: torch.Tensor) -> int:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return sum(n * (n + 1) // 2 for n in lengths)
