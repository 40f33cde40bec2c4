"""Megatron-LM ``pretrain_gpt.py`` glue: flags, data path, plan hand-off, resume.

The patches under ``patches/`` call only the names below.  Flag handling is
import-light (no torch); the hand-off (``hooks``) is imported on first use so
``python -m megatron_zeppelin.launch`` works without torch or Megatron.
"""

import importlib
from typing import Any

from megatron_zeppelin.integration.args import (
    SPEC,
    add_zeppelin_args,
    chain_args_providers,
    check_args,
    check_args_before_launch,
    check_run_before_launch,
    print_help_if_asked,
    validate_zeppelin_args,
)

#: Names served by megatron_zeppelin.integration.hooks (imports torch and megatron.core).
_HOOKS = ("build_train_valid_test_loaders", "get_batch", "get_batch_by_keys", "gpt_builder",
          "gpt_model_config_cls", "zeppelin_layer_spec")

__all__ = ["SPEC", "add_zeppelin_args", "chain_args_providers", "check_args", "check_args_before_launch",
           "check_run_before_launch", "print_help_if_asked",
           "validate_zeppelin_args",
           *_HOOKS]


def __getattr__(name: str) -> Any:
    if name in _HOOKS:
        return getattr(importlib.import_module("megatron_zeppelin.integration.hooks"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
