"""Megatron-Core glue: core attention, layer spec, packed parameters, GPT model."""

from megatron_zeppelin.megatron.attention import ZeppelinAttention, packed_causal_attention
from megatron_zeppelin.megatron.model import ZeppelinGPTModel, build_gpt_model, transformer_config
from megatron_zeppelin.megatron.packed import ZeppelinPackedSeqParams, build_packed_seq_params
from megatron_zeppelin.megatron.rotary import rotary_freqs
from megatron_zeppelin.megatron.spec import get_zeppelin_layer_spec

__all__ = ["ZeppelinAttention", "ZeppelinGPTModel", "ZeppelinPackedSeqParams", "build_gpt_model",
           "build_packed_seq_params", "get_zeppelin_layer_spec", "packed_causal_attention",
           "rotary_freqs", "transformer_config"]
