"""The trainer: ``python -m megatron_zeppelin.train`` (CPU spawn/gloo or torchrun/NCCL)."""

from megatron_zeppelin.train.cli import STRATEGIES, TrainConfig, parse_args
from megatron_zeppelin.train.log import StepRecord

__all__ = ["STRATEGIES", "StepRecord", "TrainConfig", "parse_args"]
