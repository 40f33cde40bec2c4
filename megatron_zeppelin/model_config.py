"""Model shape presets (``configs/models/*.yaml``) and the work they imply per token.

Field names follow Megatron-Core's ``TransformerConfig`` so a preset maps onto
it directly.  FLOP counts are for the forward pass; the cost model applies the
backward multipliers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.presets import build_dataclass, load_yaml, resolve_preset


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a LLaMA-style decoder (RMSNorm, rotary, SwiGLU, optional GQA)."""

    name: str
    """Preset name (file stem)."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (== num_attention_heads without GQA)."""
    ffn_hidden_size: int
    """SwiGLU inner width."""
    vocab_size: int
    """Vocabulary size (output projection cost)."""
    dtype_bytes: int = 2
    """Bytes per activation element on the wire and in memory (bf16)."""
    num_experts: int = 0
    """MoE: experts per layer in place of the dense MLP (0: dense)."""
    moe_router_topk: int = 2
    """MoE: experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """MoE: SwiGLU inner width of one expert (None: ``ffn_hidden_size``)."""
    expert_parallel_size: int = 1
    """MoE: ranks the experts are spread over (the router's all-to-all crosses them)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "dtype_bytes", "moe_router_topk", "expert_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {self.name}: {name} must be >= 1")
        if self.num_experts < 0:
            raise ConfigError(f"model {self.name}: num_experts must be >= 0 (0: dense MLP)")
        if self.moe_enabled and self.moe_router_topk > self.num_experts:
            raise ConfigError(f"model {self.name}: moe_router_topk {self.moe_router_topk} must be at most "
                              f"num_experts {self.num_experts}")
        if self.num_experts % self.expert_parallel_size:
            raise ConfigError(f"model {self.name}: {self.num_experts} experts do not divide over "
                              f"expert_parallel_size {self.expert_parallel_size}; pick a divisor")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model {self.name}: {self.num_attention_heads} heads do not divide "
                              f"hidden size {self.hidden_size}; pick a head count that divides it")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"model {self.name}: {self.num_query_groups} KV heads do not divide "
                              f"{self.num_attention_heads} query heads; pick a divisor")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of K (or V) per token: KV heads x head dim."""
        return self.num_query_groups * self.head_dim

    @property
    def moe_enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_summary(self) -> str:
        """``dense MLP`` or ``MoE 8 experts top-2 over 8 ranks`` (what the cost model prices)."""
        if not self.moe_enabled:
            return "dense MLP"
        return (f"MoE {self.num_experts} experts top-{self.moe_router_topk} over "
                f"{self.expert_parallel_size} rank{'s' if self.expert_parallel_size > 1 else ''}")

    @property
    def linear_flops_per_token(self) -> float:
        """Forward FLOPs of all token-linear work per token: QKV, out-proj, SwiGLU MLP
        (MoE: the router and ``topk`` experts) over every layer plus the output
        projection (2 FLOPs per multiply-add)."""
        h = self.hidden_size
        mlp = 3 * h * self.ffn_hidden_size
        if self.moe_enabled:
            mlp = h * self.num_experts + self.moe_router_topk * 3 * h * (self.moe_ffn_hidden_size or self.ffn_hidden_size)
        per_layer = h * (h + 2 * self.kv_size) + h * h + mlp
        return 2.0 * (self.num_layers * per_layer + h * self.vocab_size)

    @property
    def num_parameters(self) -> int:
        """Weights: per layer QKV, out-proj, SwiGLU MLP and two RMSNorms; untied
        input embedding and output projection (LLaMA); the final norm."""
        h = self.hidden_size
        per_layer = h * (h + 2 * self.kv_size) + h * h + 3 * h * self.ffn_hidden_size + 2 * h
        return self.num_layers * per_layer + 2 * h * self.vocab_size + h

    @property
    def attn_flops_per_pair(self) -> float:
        """Forward FLOPs per (query, key) pair over all layers: QK^T and PV, each
        2 FLOPs per multiply-add over h = heads x head_dim."""
        return 4.0 * self.hidden_size * self.num_layers

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of K and V of one token in one layer (what a ring step sends)."""
        return 2.0 * self.kv_size * self.dtype_bytes

    @property
    def hidden_bytes_per_token(self) -> float:
        """Bytes of one token's hidden state in one layer (what a remap moves)."""
        return float(self.hidden_size * self.dtype_bytes)

    @property
    def activation_bytes_per_token(self) -> float:
        """Activation memory kept for backward per token over all layers, with a
        flash-style attention (no s^2 term): ~34 h bytes per layer in 16-bit
        (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 1)."""
        return 34.0 * self.hidden_size * self.num_layers * self.dtype_bytes / 2


def load_model(name_or_path: str | os.PathLike) -> ModelConfig:
    """Load a model preset by name (``configs/models/``) or YAML path."""
    path = resolve_preset("models", name_or_path)
    data = load_yaml(path)
    data.setdefault("name", path.stem)
    return build_dataclass(ModelConfig, data, str(path))
