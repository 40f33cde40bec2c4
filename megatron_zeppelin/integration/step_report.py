"""What each Megatron-LM iteration under ``--zeppelin`` did, reported after it ran.

Megatron's own tokens/s and TFLOP/s assume ``--seq-length`` tokens per sample and
full ``seq_length**2`` attention; a Zeppelin batch holds whole documents of any
length.  This module reports an iteration once it is over -- when the next
training batch is handed out -- from the step's real tokens, its exact causal
pairs (from the Plan) and the bytes its remapping layers put on the communicator
(summed over every rank with one all-reduce; under pipeline parallelism once the
step's schedule is over), printed on rank 0 every
``--zeppelin-log-interval`` iterations and written through Megatron's
TensorBoard / W&B writers where they exist.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

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


def report_iteration(plans: Sequence[Plan], num_tokens: int, batch_index: int, remap_bytes: int, world_size: int,
                     seconds: float | None, model: ModelConfig) -> IterationReport:
    """The finished iteration's report: ``plans`` of its micro-batches, ``remap_bytes``
    and ``world_size`` summed over every rank."""
    pairs = sum(batch_causal_pairs(plan) for plan in plans)
    return IterationReport(iteration=batch_index + 1, tokens=num_tokens, causal_pairs=pairs,
                           remap_bytes=remap_bytes, seconds=seconds, world_size=world_size,
                           model_flops=step_model_flops(model, num_tokens, pairs))


class IterationReports:
    """Reports every ``every``-th training iteration once it is over, from all its
    micro-batches (``emit`` gets them and the report).

    The remap bytes (and the ranks, counted by summing 1) are summed over every rank
    by ``reduce_sum``, a collective.  Without pipeline parallelism every rank hands
    out the next iteration's first micro-batch in step, so the sum is taken there.
    Under pipeline parallelism the hand-offs happen inside Megatron's 1F1B schedule,
    where a collective spanning stages waits on a stage that waits for this one (the
    run hung): the sum is taken by :meth:`after_schedule`, which runs on every rank
    once the step's schedule is over (``integration.hooks.run_after_each_schedule``)."""

    def __init__(self, every: int, model: ModelConfig, clock: StepClock,
                 reduce_sum: Callable[[list[int]], list[int]], *, pipelined: bool,
                 emit: Callable[[Sequence[Any], IterationReport], None],
                 note: Callable[[str], None] = lambda line: None) -> None:
        self.every, self.model, self.clock, self.reduce_sum = every, model, clock, reduce_sum
        self.pipelined, self.emit, self.note = pipelined, emit, note
        self._running: list[tuple[Any, StepContext]] = []
        """The running iteration's micro-batches handed out so far, each with its step context."""
        self._sums: dict[int, list[int]] = {}
        """Batch index -> [remap bytes, ranks] summed after its schedule (pipeline parallelism)."""

    def _due(self, items: Sequence[tuple[Any, StepContext]]) -> bool:
        return bool(self.every and items) and items[0][0].batch.index % self.every == 0

    def _sum(self, items: Sequence[tuple[Any, StepContext]]) -> list[int]:
        return self.reduce_sum([sum(context.remap_counters.total for _, context in items), 1])

    def training_batch(self, prepared: Any, context: StepContext) -> None:
        """A training micro-batch is handed out; the first one of a new global batch
        ends the running iteration, reported when due."""
        if self._running and self._running[0][0].batch.index == prepared.batch.index:
            self._running.append((prepared, context))
            return
        seconds = self.clock.training_batch()
        finished, self._running = self._running, [(prepared, context)]
        if not self._due(finished):
            return
        index = finished[0][0].batch.index
        sums = self._sums.pop(index, None) if self.pipelined else self._sum(finished)
        if sums is None:
            self.note(f"zeppelin: no report for iteration {index + 1}: its remap bytes are summed after the "
                      "step's pipeline schedule, and Megatron-LM ran none (finalize_model_grads was not called)")
            return
        report = report_iteration([p.plan for p, _ in finished], sum(p.batch.num_tokens for p, _ in finished),
                                  index, sums[0], sums[1], seconds, self.model)
        self.emit([p for p, _ in finished], report)

    def after_schedule(self) -> None:
        """The step's schedule is over on this rank: sum the running iteration's remap
        bytes over every rank when it is due (a collective: every rank calls it once
        per training iteration)."""
        if self.pipelined and self._due(self._running):
            self._sums[self._running[0][0].batch.index] = self._sum(self._running)


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
