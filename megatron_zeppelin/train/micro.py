"""Gradient accumulation: a global batch as ``--micro-batches`` planned micro-batches.

The sampler draws a global batch of ``micro-batches x`` the tokens one Plan holds;
:func:`~megatron_zeppelin.planner.micro_batches.split_micro_batches` splits it into
micro-batches of equal modeled work, and each is planned under the per-GPU token
cap.  The trainer runs forward and backward per micro-batch and all-reduces and
steps once, with every token loss divided by the *global* batch's label count, so
the gradient is that of the whole global batch at once.

:func:`iter_micro_batches` draws, splits and plans; the trainer runs it through a
:class:`~megatron_zeppelin.prefetch.Prefetcher`, so micro-batch ``i + 1`` is
planned while micro-batch ``i`` computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.micro_batches import Split, micro_batch_split
from megatron_zeppelin.sampler import GlobalBatch, Piece, ZeppelinBatchSampler
from megatron_zeppelin.sampler.deferral import DeferringSampler
from megatron_zeppelin.topology import ClusterConfig
from megatron_zeppelin.train.cli import TrainConfig
from megatron_zeppelin.train.pipeline_layout import data_parallel_stage_view
from megatron_zeppelin.train.passes import Pass


@dataclass(frozen=True)
class MicroBatch:
    """One planned micro-batch of a global batch."""

    batch: GlobalBatch
    """The whole global batch (its label count is every micro-batch's loss denominator)."""
    index: int
    """Position in the global batch (0 .. count - 1)."""
    count: int
    """Micro-batches of the global batch."""
    pieces: tuple[Piece, ...]
    """This micro-batch's pieces; sequence ``i`` of ``plan`` is ``pieces[i]``."""
    plan: Plan
    """Validated Plan of the micro-batch."""
    sampler_state: dict
    """Sampler state right after drawing ``batch`` (what a checkpoint after it holds)."""


def make_sampler(cfg: TrainConfig, doc_lengths: Any) -> DeferringSampler:
    """The run's token-budget sampler; a piece no plan can hold waits for the next step."""
    return DeferringSampler(ZeppelinBatchSampler(doc_lengths, max_seq_len=cfg.max_seq_len,
                                                 tokens_per_batch=cfg.tokens_per_batch, seed=cfg.seed))


def make_split(cfg: TrainConfig, cluster: ClusterConfig) -> Split:
    """The run's ``--micro-batches`` split, priced as the ranks plan: on the
    data-parallel ranks' view of ``cluster`` (of one pipeline stage), with the run's routing and experts
    (the check before start-up and the ranks must split alike)."""
    cost = CostModel(data_parallel_stage_view(cluster, cfg.world_size, cfg.tp, cfg.pp, tp_rank=0),
                     cfg.model_config(), routing=cfg.routing, ring_grad_dtype=cfg.engine_ring_grad_dtype)
    return micro_batch_split(cfg.micro_batches, tokens_per_gpu=cfg.tokens_per_gpu,
                             data_parallel_size=cfg.data_parallel_size, max_seq_len=cfg.max_seq_len,
                             batch_fill=cfg.batch_fill, cost=cost)


def iter_micro_batches(sampler: DeferringSampler, split: Split, make_plan: Callable[[Sequence[int]], list[Pass]],
                       note: Callable[[str], None]) -> Iterator[MicroBatch]:
    """Every micro-batch of every global batch, in order, planned: the
    ``--micro-batches`` split, each part run as the passes its strategy needs
    (``train/passes.py``).  A global batch whose micro-batches cannot all be
    planned defers a piece to the next step (``note`` hears of it) rather than
    fail the run."""
    def plan_all(seq_lens: Sequence[int]) -> tuple[list[list[int]], list[Plan]]:
        groups, plans = [], []
        for g in split(seq_lens):
            for p in make_plan([seq_lens[i] for i in g]):
                groups.append([g[s] for s in p.seqs])
                plans.append(p.plan)
        return groups, plans

    while True:
        batch, (groups, plans) = sampler.next_planned(plan_all, note)
        state = sampler.state_dict()
        for i, (group, plan) in enumerate(zip(groups, plans)):
            yield MicroBatch(batch, i, len(groups), tuple(batch.pieces[j] for j in group), plan, state)


def check_micro_batches(cfg: TrainConfig, cluster: ClusterConfig, doc_lengths: Any,
                        sampler_state: dict | None) -> None:
    """Split every global batch the run will train on before any process starts:
    a count that leaves a micro-batch empty (or that no split fits) is a
    :class:`ConfigError` naming the batch.  Sampling and splitting are pure and
    cheap; planning is left to the ranks."""
    sampler = make_sampler(cfg, doc_lengths).sampler
    if sampler_state is not None:
        sampler.load_state_dict({k: v for k, v in sampler_state.items() if k != "carried"})
    split = make_split(cfg, cluster)
    batches = iter(sampler)
    for _ in range(cfg.steps - int(sampler.state_dict()["index"])):
        batch = next(batches)
        try:
            split(batch.seq_lens)
        except InfeasibleError as exc:
            raise ConfigError(f"--micro-batches {cfg.micro_batches}, global batch {batch.index}: {exc}") from None
