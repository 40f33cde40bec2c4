"""RMSNorm for Megatron-Core's local (non-TransformerEngine) layers under sequence parallelism.

Megatron-Core's local norm (``WrappedTorchNorm``) refuses ``sequence_parallel``;
TransformerEngine's norm accepts it and marks its weight ``sequence_parallel``
so that the partial gradients of the TP ranks (each saw ``1/tp`` of the tokens)
are summed over the TP group.  :class:`SequenceParallelRMSNorm` does the same
with ``torch.nn.RMSNorm``, which is all the CPU path needs.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built like Megatron's norms; its weight is marked
    ``sequence_parallel`` when the config splits rows over the TP ranks."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def sequence_parallel_block_spec(layer_spec: ModuleSpec, num_layers: int) -> ModuleSpec | TransformerBlockSubmodules:
    """The block of ``num_layers`` layers of ``layer_spec`` with every local torch
    norm (both per-layer norms and the final one) a :class:`SequenceParallelRMSNorm`;
    a spec without local norms (TransformerEngine's) is returned as it is."""
    if layer_spec.submodules.input_layernorm is not WrappedTorchNorm:
        return layer_spec
    spec = copy.deepcopy(layer_spec)
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SequenceParallelRMSNorm)
