"""Remapping layer: attention layout <-> token-balanced linear layout (all-to-all-v)."""

from megatron_zeppelin.remap.exchange import RemapExchange, build_exchange
from megatron_zeppelin.remap.remap import (RemapMLPMixin, ZeppelinRemap, pad_rows, remap_module_spec,
                                           remap_tokens, with_remap)
from megatron_zeppelin.step_context import RemapCounters

__all__ = ["RemapCounters", "RemapExchange", "RemapMLPMixin", "ZeppelinRemap", "build_exchange",
           "pad_rows", "remap_module_spec", "remap_tokens", "with_remap"]
