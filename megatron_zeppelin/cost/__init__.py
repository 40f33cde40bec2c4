"""Analytic cost model (pure Python)."""

from megatron_zeppelin.cost.model import CostModel, RingCost

__all__ = ["CostModel", "RingCost"]
