"""What each Megatron-LM iteration under ``--zeppelin`` did, reported after it ran.

Megatron's own tokens/s and TFLOP/s assume ``--seq-length`` tokens per sample and
full ``seq_length**2`` attention; a Zeppelin batch holds whole documents of any
length.  This module reports an iteration once it is over -- when the next
training batch is handed out -- from the step's real tokens, its exact causal
pairs (from the Plan) and the bytes its remapping layers put on the communicator
(summed over every rank with one all-reduce), printed on rank 0 every
``--zeppelin-log-interval`` iterations and written through Megatron's
TensorBoard / W&B writers where they exist.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.plan.shards import causal_pairs
from megatron_zeppelin.step_context import StepContext

#: Model FLOPs of a training step over forward FLOPs: forward + backward (2x), the
#: convention of Megatron's own TFLOP/s (activation recompute not counted).
TRAIN_FLOPS_FACTOR = 3.0


class StepClock:
    """Wall time of each training iteration: from its batch hand-off to the next
    training hand-off, or to the first evaluation hand-off in between (evaluation
    runs after an iteration, so it is not counted)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self._start: float | None = None
        self._end: float | None = None

    def training_batch(self) -> float | None:
        """A training batch is handed out: the seconds of the previous iteration (None at first)."""
        now = self._now()
        seconds = None if self._start is None else (self._end if self._end is not None else now) - self._start
        self._start, self._end = now, None
        return seconds

    def other_batch(self) -> None:
        """An evaluation batch is handed out: the running iteration ended before it."""
        if self._start is not None and self._end is None:
            self._end = self._now()


@dataclass(frozen=True)
class IterationReport:
    """One finished iteration, summed over every rank."""

    iteration: int
    """Megatron's iteration number after this step (batch index + 1)."""
    tokens: int
    """Tokens of the global batch (real document tokens, no padding)."""
    causal_pairs: int
    """Causal (query, key) pairs of the global batch's attention, per layer and head group."""
    remap_bytes: int
    """Bytes the remapping layers moved (forward and backward), counted by the
    communicator on every rank and summed."""
    seconds: float | None
    """Wall time of the iteration (None for the first one handed out after a start)."""
    world_size: int
    """GPUs that shared the work."""
    model_flops: float
    """Model FLOPs of the step (forward + backward, linear and attention)."""

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None

    @property
    def tflops_per_gpu(self) -> float | None:
        return self.model_flops / self.seconds / self.world_size / 1e12 if self.seconds else None


def batch_causal_pairs(plan: Plan) -> int:
    """Exact causal pairs of the whole batch (each sequence's ``L (L + 1) / 2``)."""
    return sum(causal_pairs(0, n) for n in plan.seq_lens)


def step_model_flops(model: ModelConfig, tokens: int, pairs: int) -> float:
    """Training FLOPs of one step (whole model, all ranks): every token through the
    linear layers, every causal pair through attention, times 3 for the backward."""
    return TRAIN_FLOPS_FACTOR * (tokens * model.linear_flops_per_token + pairs * model.attn_flops_per_pair)


def sum_over_ranks(values: list[int], device: torch.device) -> list[int]:
    """All-reduce (SUM) a few int64 values over the default process group (collective)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return [int(x) for x in t.tolist()]


def report_iteration(plan: Plan, num_tokens: int, batch_index: int, context: StepContext,
                     seconds: float | None, model: ModelConfig,
                     reduce_sum: Callable[[list[int]], list[int]]) -> IterationReport:
    """The finished iteration's report.  ``reduce_sum`` sums over every rank (GPUs =
    ranks counted by summing 1), so every rank calls it for the same batch."""
    remap_bytes, world_size = reduce_sum([context.remap_counters.total, 1])
    pairs = batch_causal_pairs(plan)
    return IterationReport(iteration=batch_index + 1, tokens=num_tokens, causal_pairs=pairs,
                           remap_bytes=remap_bytes, seconds=seconds, world_size=world_size,
                           model_flops=step_model_flops(model, num_tokens, pairs))


def format_report(r: IterationReport) -> str:
    """The measured part of a ``--zeppelin-log-interval`` line."""
    rate = (f"{r.tokens_per_s:.1f} tokens/s, {r.tflops_per_gpu:.3g} TFLOP/s/GPU" if r.seconds
            else "tokens/s and TFLOP/s from the next iteration on")
    return f"remap_bytes={r.remap_bytes} {rate}"


def write_report(r: IterationReport, writers: tuple[Any, Any]) -> None:
    """Megatron's TensorBoard and W&B writers (each None where this rank has none)."""
    tensorboard, wandb = writers
    scalars = {"zeppelin/remap-bytes": r.remap_bytes, "zeppelin/tokens": r.tokens,
               "zeppelin/causal-pairs": r.causal_pairs}
    if r.seconds:
        scalars.update({"zeppelin/tokens-per-sec": r.tokens_per_s, "zeppelin/tflops-per-gpu": r.tflops_per_gpu,
                        "zeppelin/iteration-time": r.seconds})
    if tensorboard is not None:
        for name, value in scalars.items():
            tensorboard.add_scalar(name, value, r.iteration)
    if wandb is not None:
        wandb.log(scalars, r.iteration)


def megatron_writers() -> tuple[Any, Any]:
    """Megatron's (TensorBoard, W&B) writers of this rank, or Nones outside Megatron-LM."""
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return None, None
    return get_tensorboard_writer(), get_wandb_writer()
