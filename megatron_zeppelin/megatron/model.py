"""A Megatron-Core ``GPTModel`` whose RoPE follows each token's own position.

``GPTModel._preprocess`` builds rotary angles for the contiguous range
``0..max_seqlen`` (and moves them to CUDA).  ``ZeppelinGPTModel`` overrides that
step when the batch carries :class:`ZeppelinPackedSeqParams`: the angles are built
from ``packed_seq_params.position_ids`` (one per token), and Megatron's own THD
RoPE applies them token by token.  Its ``forward`` binds the batch's step context
to the Zeppelin modules first.  Everything else -- embedding, layers, output
layer, loss -- is Megatron's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.megatron.experts import expert_parallel_weights, one_rank_expert_groups
from megatron_zeppelin.megatron.norm import sequence_parallel_block_spec
from megatron_zeppelin.megatron.packed import ZeppelinPackedSeqParams
from megatron_zeppelin.megatron.rotary import rotary_freqs
from megatron_zeppelin.megatron.spec import get_zeppelin_layer_spec
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.step_context import bind_step_context, step_context_of


class ZeppelinGPTModel(GPTModel):
    """``GPTModel`` with per-token rotary positions for Zeppelin's packed buffers,
    which hands the step's context to every Zeppelin module."""

    def forward(self, *args: Any, packed_seq_params: Any = None, **kwargs: Any) -> Any:
        # The one channel: the batch's context reaches the attention and remap
        # modules here, before any layer runs.  A batch without one unbinds the
        # previous step's, so those modules refuse to run instead of reusing it.
        bind_step_context(self, step_context_of(packed_seq_params))
        return super().forward(*args, packed_seq_params=packed_seq_params, **kwargs)

    def _preprocess(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    decoder_input: torch.Tensor | None = None, inference_context: Any = None,
                    packed_seq_params: Any = None, **kwargs: Any) -> tuple:
        if not isinstance(packed_seq_params, ZeppelinPackedSeqParams):
            return super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                       inference_context=inference_context,
                                       packed_seq_params=packed_seq_params, **kwargs)
        if inference_context is not None:
            raise ConfigError("ZeppelinGPTModel's packed path is for training; run inference "
                              "without ZeppelinPackedSeqParams")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_pos_emb = rotary_freqs(self.rotary_pos_emb, packed_seq_params.position_ids)
        # (decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
        #  sequence_len_offset, padding_mask) -- GPTModel.forward's unpacking.
        return decoder_input, rotary_pos_emb, None, None, None, kwargs.get("padding_mask")


def transformer_config(model: ModelConfig, *, dtype: torch.dtype = torch.float32,
                       cpu_init: bool = True, tp: int = 1, sequence_parallel: bool = False,
                       pp: int = 1) -> TransformerConfig:
    """LLaMA-style ``TransformerConfig`` (RMSNorm, SwiGLU, no biases, no dropout).

    ``pp > 1``: Megatron-Core's pipeline schedules pass each micro-batch's own
    activation shape between stages (``variable_seq_lengths``: a rank's token
    count follows its plan), and the loss function's value is used as it is
    (``calculate_per_token_loss``: the trainer already divides by the global
    batch's label count, so the schedule must not divide by the micro-batch count).

    MoE models route each token to ``topk`` experts with no load-balancing loss and
    no capacity limit: a token's output then depends on that token alone, not on
    which tokens share its rank, so every layout computes the same thing (an
    auxiliary loss or token dropping would be decided per rank's buffer)."""
    moe = {} if not model.moe_enabled else dict(
        num_moe_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        # All-gather with EP 1; all-to-all spreads the experts (on CPU through megatron/cpu_compat.py).
        moe_token_dispatcher_type="allgather" if model.expert_parallel_size == 1 else "alltoall",
        expert_model_parallel_size=model.expert_parallel_size)
    pipeline = {} if pp == 1 else dict(
        pipeline_model_parallel_size=pp, pipeline_dtype=dtype, variable_seq_lengths=True,
        calculate_per_token_loss=True,
        # Megatron refuses variable lengths beside its default (all-gather) MoE dispatcher,
        # also for a dense model: all-to-all, also for an MoE model at EP 1.  (The trainer's
        # --pp refuses MoE, train/pipeline_layout.py; the Megatron-LM e2e builds it.)
        moe_token_dispatcher_type="alltoall")
    return TransformerConfig(**{**moe, **pipeline},
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=cpu_init,
        # Fusions need CUDA kernels; fused RoPE would also ignore per-token positions.
        apply_rope_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        # Megatron's default "full" is deprecated (and warns on every rank); [] means the same.
        cuda_graph_scope=[])


def build_gpt_model(model: ModelConfig, *, max_seq_len: int, dtype: torch.dtype = torch.float32,
                    remap: bool = False, use_te: bool | None = None, tp: int = 1,
                    sequence_parallel: bool = False, pp: int = 1) -> ZeppelinGPTModel:
    """A ``ZeppelinGPTModel`` with the Zeppelin layer spec, initialised on the CPU from
    torch's default generator (also on GPU machines: seeding that generator
    identically on every rank gives identical replicas; move it with ``.to``).
    ``tp``: each rank builds its tensor-parallel shard of the same master weights
    (Megatron's parallel state must be initialised with this TP size).
    ``model.expert_parallel_size > 1``: each rank holds its EP rank's experts of
    the weights the EP 1 model draws (:mod:`megatron_zeppelin.megatron.experts`)."""
    # Megatron logs "Unknown MLP type" for the remap wrapper around the MLP (it
    # checks the exact class); the wrapped MLP still gets Megatron's default groups.
    layer_log = logging.getLogger("megatron.core.transformer.transformer_layer")
    level = layer_log.level
    layer_log.setLevel(logging.ERROR)

    def build(shape: ModelConfig, remap: bool, pg_collection: Any = None) -> ZeppelinGPTModel:
        spec = get_zeppelin_layer_spec(remap=remap, use_te=use_te, num_experts=shape.num_experts or None)
        if sequence_parallel:
            spec = sequence_parallel_block_spec(spec, shape.num_layers // pp)   # this stage's layers
        config = transformer_config(shape, dtype=dtype, cpu_init=True, tp=tp, sequence_parallel=sequence_parallel,
                                    pp=pp)
        stage = {}
        if pp > 1:
            from megatron.core import parallel_state as mpu
            stage = dict(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
        return ZeppelinGPTModel(**stage,
            config=config, transformer_layer_spec=spec,
            vocab_size=shape.vocab_size, max_sequence_length=max_seq_len,
            position_embedding_type="rope", share_embeddings_and_output_weights=False,
            pg_collection=pg_collection)
    try:
        ep = model.expert_parallel_size
        if not model.moe_enabled or ep == 1:
            return build(model, remap)
        from megatron.core import parallel_state as mpu
        # The EP 1 model is built without the remapping layer, which holds no weights:
        # Megatron hands its own process groups to the MoE layer only when the spec
        # names MoELayer itself.
        return expert_parallel_weights(
            lambda: build(model, remap),
            lambda: build(dataclasses.replace(model, expert_parallel_size=1), False, one_rank_expert_groups()),
            ep_rank=mpu.get_expert_model_parallel_rank(), num_local=model.num_experts // ep)
    finally:
        layer_log.setLevel(level)
