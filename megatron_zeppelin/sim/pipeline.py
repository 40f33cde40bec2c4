"""Pipeline parallelism in the simulator: Megatron-Core's 1F1B replayed per micro-batch.

With ``--pp P`` every pipeline stage holds ``num_layers / P`` layers and runs
the micro-batch's plan on its own data-parallel ranks (the trainer's
``train/pipeline.py``).  A micro-batch's plan is timed as the simulator times
any plan (all layers, the slowest rank); a stage does ``1 / P`` of that work,
and the last stage also the output layer.  Non-interleaved 1F1B then runs, on
stage ``s``, ``min(P - s - 1, M)`` forwards, alternating forward/backward
pairs, and the remaining backwards; a forward waits for the previous stage's
forward of the same micro-batch and its activations' transfer, a backward for
the next stage's backward and its gradients' transfer.  :func:`replay_1f1b`
replays that order with each micro-batch's own times.

With equal micro-batches the idle fraction of every stage is the textbook
``(P - 1) / (M + P - 1)``; micro-batches of different modeled time usually
make it larger, by how much depends on their order (:func:`pipeline_order`):
:class:`PipelineStep` reports it against the same total work cut in equal
micro-batches.  Memory per stage (:func:`stage_memory`): weights, fp32
gradients, the distributed optimizer's share of fp32 master weights and Adam
moments, and the activations of the micro-batches 1F1B keeps in flight there
(``min(P - s, M)``; with full recomputation their layer inputs).  Pure python
and numpy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.step_sync import StepSync, forward_backward_split, step_sync
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.sim.rounds import TimedBatch
from megatron_zeppelin.sim.timeline import StepTimeline
from megatron_zeppelin.topology import LinkSpec

#: Bytes per parameter of the fp32 gradient buffer (Megatron accumulates bf16
#: models' gradients in fp32) and of the distributed optimizer's fp32 master
#: weight plus Adam's two moments, which it shards over data parallelism.
GRAD_BYTES_PER_PARAM = 4
OPTIMIZER_BYTES_PER_PARAM = 12
GIB = 2 ** 30


@dataclass(frozen=True)
class Replay:
    """One 1F1B run of a global batch's micro-batches over the stages."""

    makespan_s: float
    """First forward's start to the last backward's end."""
    busy_s: tuple[float, ...]
    """Compute seconds of each stage."""

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the stages over the makespan (rounding kept
        from showing one stage's zero as -0.0 %)."""
        return max(0.0, 1.0 - float(np.mean(self.busy_s)) / self.makespan_s) if self.makespan_s > 0 else 0.0


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Megatron-Core's non-interleaved 1F1B order on ``stage``: ``("F", m)`` and
    ``("B", m)`` (``forward_backward_pipelining_without_interleaving``)."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", m) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
    return order


def replay_1f1b(forward_s: np.ndarray, backward_s: np.ndarray, transfer_s: Sequence[float]) -> Replay:
    """Replay 1F1B: ``forward_s[s, m]`` / ``backward_s[s, m]`` are stage ``s``'s
    seconds for micro-batch ``m``; ``transfer_s[m]`` the time its activations
    (and, backward, their gradients) take across one stage boundary."""
    stages, micro = forward_s.shape
    orders = [one_f_one_b_order(s, stages, micro) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else done.get(("F", s - 1, m))
                    ready = ready if ready is None or s == 0 else ready + transfer_s[m]
                    seconds = forward_s[s, m]
                else:
                    ready = done.get(("F", s, m)) if s == stages - 1 else done.get(("B", s + 1, m))
                    ready = ready if ready is None or s == stages - 1 else ready + transfer_s[m]
                    seconds = backward_s[s, m]
                if ready is None:
                    break          # waits for another stage
                clock[s] = max(clock[s], ready) + float(seconds)
                done[kind, s, m] = clock[s]
                position[s] += 1
                progressed = True
        if not progressed:   # 1F1B's order never deadlocks; a bug here must not hang
            raise RuntimeError("1F1B replay made no progress")
    busy = tuple(float(forward_s[s].sum() + backward_s[s].sum()) for s in range(stages))
    return Replay(makespan_s=max(clock), busy_s=busy)


def ends_light_order(seconds: Sequence[float]) -> list[int]:
    """Micro-batches of ``seconds`` lightest at both ends, heaviest in the middle
    (ranked lightest first, every other one to the front, the rest to the back
    in reverse).  The first forward and the last backward cross every stage
    alone (warm-up and cool-down), so a heavy micro-batch there stalls all
    stages; in the steady state its stall overlaps the neighbours' work.  Ties
    keep their index order."""
    ranked = sorted(range(len(seconds)), key=lambda i: (seconds[i], i))
    return ranked[0::2] + ranked[1::2][::-1]


def pipeline_order(seconds: Sequence[float], stages: int) -> list[int]:
    """The order to run micro-batches of ``seconds`` (each its whole forward +
    backward) in through 1F1B over ``stages``: :func:`ends_light_order` where its
    replay (each stage ``1 / stages`` of a micro-batch, backward twice the
    forward, free transfers) is shorter than the given order's, else the given
    order (lightest-at-the-ends loses where the given order already starts and
    ends light).  Pure and deterministic: every rank computes the same order
    from the same plans."""
    t = np.asarray(seconds, dtype=float)[None, :] / stages
    forward, backward = np.repeat(t / 3, stages, axis=0), np.repeat(2 * t / 3, stages, axis=0)
    given, light = list(range(len(seconds))), ends_light_order(seconds)
    free = [0.0] * len(seconds)
    if replay_1f1b(forward[:, light], backward[:, light], free).makespan_s < \
            replay_1f1b(forward, backward, free).makespan_s:
        return light
    return given


def ideal_bubble(stages: int, micro_batches: int) -> float:
    """Idle fraction of 1F1B with equal micro-batches and free transfers."""
    return (stages - 1) / (micro_batches + stages - 1)


def boundary_link(cost: CostModel) -> LinkSpec:
    """Per-GPU link of a stage boundary: stages are whole nodes, so every GPU of
    a stage sends to its peer in the next stage's nodes at once, each getting
    ``NICs / GPUs`` of its node's NIC bandwidth (``cost`` may be a TP view,
    whose nodes count TP groups)."""
    topo, nic = cost.cluster.topology, cost.cluster.nic
    gpus = topo.gpus_per_node * cost.tp_size
    return LinkSpec(bandwidth_GBps=nic.bandwidth_GBps * topo.nics_per_node / gpus, latency_us=nic.latency_us)


def output_layer_share(model: ModelConfig) -> float:
    """Fraction of the linear FLOPs that is the output layer (on the last stage)."""
    return 2.0 * model.hidden_size * model.vocab_size / model.linear_flops_per_token


@dataclass(frozen=True)
class MicroBatchWork:
    """One pipeline micro-batch (a planned pass) as every stage runs it."""

    forward_s: tuple[float, ...]
    """Seconds of each stage's forward."""
    backward_s: tuple[float, ...]
    """Seconds of each stage's backward."""
    boundary_bytes: float
    """Activation bytes a GPU of the busiest rank sends across a stage boundary
    (its gradients come back with the same size); under TP each GPU sends its
    sequence-parallel ``1 / tp`` of the rank's tokens."""
    linear_tokens: tuple[int, ...]
    """Tokens each rank holds in the linear layout (what activations scale with)."""


def micro_batch_work(plan: Plan, timeline: StepTimeline, cost: CostModel, stages: int,
                     recompute: bool = False) -> MicroBatchWork:
    """Stage times of ``plan`` from its timeline (without the gradient sync):
    ``1 / stages`` of the slowest rank's work per stage, the output layer's
    share of its linear time on the last stage; forward and backward split as
    the step's sync model splits them.  ``recompute`` (Megatron's
    ``--recompute-granularity full``): the backward runs each layer's forward
    again first (the output layer is not recomputed)."""
    slowest = timeline.ranks[timeline.slowest_rank]
    output = slowest.linear_s * output_layer_share(cost.model)
    layers = timeline.compute_s - output
    f, b = forward_backward_split(slowest.attn_compute_s, slowest.linear_s)
    forward_share = f / (f + b) if f + b > 0 else 1 / 3
    per_stage = [layers / stages + (output if s == stages - 1 else 0.0) for s in range(stages)]
    tokens = plan.attention_tokens_per_rank()
    boundary = max(tokens) * cost.model.hidden_bytes_per_token / cost.tp_size
    again = [layers / stages * forward_share if recompute else 0.0] * stages
    return MicroBatchWork(forward_s=tuple(t * forward_share for t in per_stage),
                          backward_s=tuple(t * (1 - forward_share) + r for t, r in zip(per_stage, again)),
                          boundary_bytes=boundary, linear_tokens=tuple(plan.linear_tokens_per_rank()))


@dataclass(frozen=True)
class PipelineStep:
    """One global batch of one strategy through the pipeline."""

    replay: Replay
    """1F1B with each micro-batch's own times, in :func:`pipeline_order` (the
    trainer's order: the split's, or lightest at the ends where that is shorter)."""
    as_split: Replay
    """The same micro-batches in the order the split made them."""
    equal: Replay
    """1F1B with the same work per stage cut in equal micro-batches."""
    transfer_s: float
    """Seconds one stage boundary spends on transfers: every micro-batch's
    activations forward and their gradients backward."""
    transfer_bytes: float
    """Bytes a GPU of the busiest rank sends over all micro-batches, both ways."""
    sync: StepSync
    """Gradient sync and optimizer of the largest stage after the pipeline."""
    micro_batches: int

    @property
    def step_s(self) -> float:
        return self.replay.makespan_s + self.sync.exposed_s


def pipeline_step(works: Sequence[MicroBatchWork], cost: CostModel, stages: int) -> PipelineStep:
    """Replay ``works`` through 1F1B, in :func:`pipeline_order` and as given, and
    add the largest stage's sync."""
    ordered = [works[i] for i in pipeline_order([sum(w.forward_s) + sum(w.backward_s) for w in works], stages)]
    forward = np.array([w.forward_s for w in works]).T
    backward = np.array([w.backward_s for w in works]).T
    link = boundary_link(cost)
    transfer = [link.transfer_s(w.boundary_bytes) for w in works]
    equal = replay_1f1b(np.repeat(forward.mean(axis=1, keepdims=True), len(works), axis=1),
                        np.repeat(backward.mean(axis=1, keepdims=True), len(works), axis=1),
                        [float(np.mean(transfer))] * len(works))
    largest = dataclasses.replace(cost, model=stage_model(cost.model, stages))
    sync = step_sync(largest, float(forward[-1].sum()), float(backward[-1].sum()))
    return PipelineStep(replay=_replay(ordered, cost), as_split=_replay(works, cost), equal=equal,
                        transfer_s=2 * sum(transfer) if stages > 1 else 0.0,
                        transfer_bytes=2 * sum(w.boundary_bytes for w in works) if stages > 1 else 0.0, sync=sync,
                        micro_batches=len(works))


def _replay(works: Sequence[MicroBatchWork], cost: CostModel) -> Replay:
    link = boundary_link(cost)
    return replay_1f1b(np.array([w.forward_s for w in works]).T, np.array([w.backward_s for w in works]).T,
                       [link.transfer_s(w.boundary_bytes) for w in works])


def stage_model(model: ModelConfig, stages: int) -> ModelConfig:
    """A model whose ``num_parameters`` are the largest stage's: ``num_layers /
    stages`` layers and one ``hidden x vocab`` matrix (the first stage's
    embedding or the last stage's output layer; half the vocabulary stands for
    the two matrices ``ModelConfig`` counts); one stage is the whole model."""
    if stages == 1:
        return model
    return dataclasses.replace(model, num_layers=model.num_layers // stages, vocab_size=max(model.vocab_size // 2, 1))


@dataclass(frozen=True)
class StageMemory:
    """Bytes one GPU of a pipeline stage holds at its peak."""

    stage: int
    weights: float
    """Model weights of the stage's layers (``dtype_bytes`` each)."""
    gradients: float
    """fp32 gradient buffer."""
    optimizer: float
    """This GPU's share of fp32 master weights and Adam moments."""
    in_flight: int
    """Micro-batches whose activations 1F1B keeps here at once."""
    activations: float
    """Activations of the heaviest ``in_flight`` consecutive micro-batches on the
    busiest rank (with recompute: their layer inputs and one layer's activations)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def stage_parameters(model: ModelConfig, stage: int, stages: int) -> float:
    """Parameters of ``stage``: its layers, the embedding on the first, the final
    norm and output layer on the last."""
    per_layer = (model.num_parameters - 2 * model.hidden_size * model.vocab_size - model.hidden_size) / model.num_layers
    params = per_layer * model.num_layers / stages
    if stage == 0:
        params += model.hidden_size * model.vocab_size
    if stage == stages - 1:
        params += model.hidden_size * model.vocab_size + model.hidden_size
    return params


def stage_memory(works: Sequence[MicroBatchWork], cost: CostModel, stages: int,
                 recompute: bool = False) -> list[StageMemory]:
    """Peak memory per GPU of each stage for one global batch's micro-batches
    (``cost``: the stage's ranks; under TP a rank is ``tp_size`` GPUs that split
    weights and, with sequence parallelism, activations).  ``recompute`` (full,
    every layer): a micro-batch in flight keeps each layer's input (``hidden``
    values per token), and the one in backward also one layer's full activations."""
    m, tp = cost.model, cost.tp_size
    dp = cost.cluster.topology.world_size
    tokens = np.array([w.linear_tokens for w in works], dtype=float)     # [micro-batch, rank]
    per_token = m.activation_bytes_per_token / stages / tp
    if recompute:
        per_token = m.hidden_bytes_per_token * m.num_layers / stages / tp
    one_layer = m.activation_bytes_per_token / m.num_layers / tp if recompute else 0.0
    out = []
    for s in range(stages):
        params = stage_parameters(m, s, stages) / tp
        k = min(stages - s, len(works))
        window = max(tokens[i:i + k].sum(axis=0).max() for i in range(len(works) - k + 1))
        out.append(StageMemory(stage=s, weights=params * m.dtype_bytes, gradients=params * GRAD_BYTES_PER_PARAM,
                               optimizer=params * OPTIMIZER_BYTES_PER_PARAM / dp, in_flight=k,
                               activations=float(window) * per_token + float(tokens.max()) * one_layer))
    return out


def batch_works(timed: TimedBatch, cost: CostModel, stages: int, recompute: bool = False) -> list[MicroBatchWork]:
    """Stage work of a planned and timed batch, one :class:`MicroBatchWork` per round it runs as."""
    return [micro_batch_work(plan, part, cost, stages, recompute) for plan, part in zip(timed.rounds, timed.parts)]


def fits_memory(stages: int, micro_batches: int, recompute: bool = False):
    """The layout search's memory check under pipeline parallelism
    (``sim/static_layout.py: FitsMemory``): the trial micro-batch, planned and
    timed on a layout's ranks, standing for each of the step's ``micro_batches``,
    keeps every stage's peak within one GPU's memory."""
    def fits(view: CostModel, timed: TimedBatch) -> bool:
        works = batch_works(timed, view, stages, recompute)
        works = (works * micro_batches)[:max(micro_batches, len(works))]
        peak = max(m.total for m in stage_memory(works, view, stages, recompute))
        return peak <= view.cluster.gpu.memory_gib / view.tp_size * GIB   # a TP view's GPU is the TP group
    return fits
