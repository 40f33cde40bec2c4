"""Remapping layer: attention layout <-> token-balanced linear layout (all-to-all-v)."""

from megatron_zeppelin.remap.exchange import RemapExchange, build_exchange, exchange_for
from megatron_zeppelin.remap.remap import (RemapContext, RemapCounters, RemapMLPMixin, ZeppelinRemap,
                                           pad_rows, remap_module_spec, remap_tokens,
                                           set_remap_context, with_remap)

__all__ = ["RemapContext", "RemapCounters", "RemapExchange", "RemapMLPMixin", "ZeppelinRemap",
           "build_exchange", "exchange_for", "pad_rows", "remap_module_spec", "remap_tokens",
           "set_remap_context", "with_remap"]
