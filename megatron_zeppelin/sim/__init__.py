"""Step-time simulator: modeled timelines of Plans and strategy comparisons (pure Python)."""

from megatron_zeppelin.sim.simulate import (STRATEGY_NAMES, SimResult, Strategy, StrategyResult,
                                            build_strategies, simulate, te_cp_size)
from megatron_zeppelin.sim.timeline import RankTimeline, Segment, StepTimeline, step_timeline

__all__ = ["STRATEGY_NAMES", "SimResult", "Strategy", "StrategyResult", "build_strategies", "simulate",
           "te_cp_size", "RankTimeline", "Segment", "StepTimeline", "step_timeline"]
