"""The Zeppelin GPT layer spec: Megatron-Core's layer with ``ZeppelinAttention``.

Usable from Megatron-LM as ``--spec megatron_zeppelin.megatron.spec
get_zeppelin_layer_spec`` (every argument has a default).  Built on Megatron-Core's
TransformerEngine spec where TE is importable, on its local spec otherwise (CPU).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.megatron.attention import ZeppelinAttention
from megatron_zeppelin.megatron.moe import ZeppelinTopKRouter

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def get_zeppelin_layer_spec(qk_layernorm: bool = False, remap: bool = False,
                            use_te: bool | None = None, num_experts: int | None = None) -> ModuleSpec:
    """GPT layer spec (RMSNorm where local) with ``ZeppelinAttention`` as core attention.

    ``remap``: wrap the MLP in ``ZeppelinRemap`` so it runs on the token-balanced
    linear layout (attention layout -> linear layout -> MLP -> back).
    ``use_te``: TransformerEngine spec (default: when TE is installed).
    ``num_experts``: Megatron-Core's MoE layer in place of the MLP (remap wraps it
    the same way: routing and experts run on the linear layout).
    """
    use_te = HAVE_TE if use_te is None else use_te
    if use_te and not HAVE_TE:
        raise ConfigError("use_te=True but transformer_engine is not installed; install it or "
                          "pass use_te=False for Megatron-Core's local modules")
    base = (get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm)
            if use_te else get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                                    normalization="RMSNorm"))
    spec = copy.deepcopy(base)
    spec.submodules.self_attention.submodules.core_attention = ZeppelinAttention
    if num_experts and not use_te:  # Megatron-Core's router moves its gate to CUDA
        spec.submodules.mlp = with_router(spec.submodules.mlp, ZeppelinTopKRouter)
    if remap:
        spec.submodules.mlp = remap_mlp_spec(spec.submodules.mlp)
    return spec


def with_router(moe: ModuleSpec | functools.partial, router: type) -> ModuleSpec | functools.partial:
    """The MoE spec with ``router`` as its router: Megatron-Core 0.16.1 gives a
    ``ModuleSpec`` whose submodules name the router; 0.19 gives
    ``partial(MoELayer, submodules=MoESubmodules(...))``."""
    if isinstance(moe, functools.partial):
        submodules = dataclasses.replace(moe.keywords["submodules"], router=router)
        return functools.partial(moe.func, *moe.args, **{**moe.keywords, "submodules": submodules})
    moe.submodules.router = router
    return moe


def remap_mlp_spec(mlp: ModuleSpec) -> ModuleSpec:
    """The MLP spec wrapped by the remapping layer (``megatron_zeppelin.remap``)."""
    try:
        from megatron_zeppelin.remap import remap_module_spec
    except ImportError as exc:
        raise ConfigError(f"the remapping layer is not available ({exc}); run with remap off") from None
    return remap_module_spec(mlp)
