"""One rank's training loop: sample, plan, build the buffer, run the GPT, all-reduce.

Every rank runs the sampler and the planner itself (both are deterministic) and
the ranks prove they agree by all-reducing the Plan's fingerprint.  The loss is
the per-token mean over the whole global batch: each rank backpropagates
``sum(its token losses) / global label count`` for every micro-batch of the
global batch (``--micro-batches``: gradients accumulate) and gradients are summed
over the data-parallel ranks once (``--tp``: ``train/parallel.py``), so every
strategy computes the same gradient as plain data parallelism on the whole
global batch.
"""

from __future__ import annotations

import dataclasses
import math
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.attention.backends import AttentionBackend, get_backend
from megatron_zeppelin.attention.engine import AttentionCounter
from megatron_zeppelin.attention.ring import ring_grad_wire_dtype
from megatron_zeppelin.comm.base import ByteCounters, Communicator
from megatron_zeppelin.comm.collectives import torch_all_reduce_max
from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.comm.deadline import Deadline
from megatron_zeppelin.errors import ConfigError, PlanError, brief
from megatron_zeppelin.megatron.groups import data_parallel_comm_groups
from megatron_zeppelin.megatron import build_gpt_model, build_packed_seq_params
from megatron_zeppelin.megatron.cpu_compat import apply_cpu_compat
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.plan import Plan, TierCounts
from megatron_zeppelin.plan.agreement import check_same_plan
from megatron_zeppelin.comm.lanes import StepRecorder
from megatron_zeppelin.step_context import RemapCounters, StepContext
from megatron_zeppelin.schedule.attention import AttnShape
from megatron_zeppelin.sim.modeled_trace import engine_settings
from megatron_zeppelin.train.trace_dump import rank_record, write_step_trace
from megatron_zeppelin.planner.base import PlanContext, get_planner
from megatron_zeppelin.prefetch import Prefetcher
from megatron_zeppelin.sampler import ZeppelinBatchSampler
from megatron_zeppelin.sim.static_layout import static_size
from megatron_zeppelin.sim.pipeline import pipeline_order
from megatron_zeppelin.sim.rounds import rounds_clock
from megatron_zeppelin.planner.surrogate import surrogate_clock
from megatron_zeppelin.sim.timeline import decision_step_s, replay_clock
from megatron_zeppelin.topology import ClusterConfig, Topology, load_cluster
from megatron_zeppelin.train.batch import (TokenSource, build_rank_batch, make_token_source,
                                           num_label_tokens)
from megatron_zeppelin.train.checkpoint import load_state, save_state
from megatron_zeppelin.train.cli import TrainConfig
from megatron_zeppelin.train.divergence import check_finite
from megatron_zeppelin.train.log import StepLogger, StepRecord
from megatron_zeppelin.train.micro import MicroBatch, iter_micro_batches, make_sampler, make_split
from megatron_zeppelin.train.passes import Pass, planned_passes
from megatron_zeppelin.train.parallel import allreduce_gradients, physical_nics, sequence_parallel_group
from megatron_zeppelin.train.pipeline import pipeline_forward_backward
from megatron_zeppelin.train.pipeline_layout import data_parallel_stage_view
from megatron_zeppelin.train.reference import STRATEGY as REFERENCE, reference_plan


def resolve_cluster(cfg: TrainConfig) -> ClusterConfig:
    """The ``--cluster`` preset reshaped to ``--nodes x --gpus-per-node`` (and NICs)."""
    cluster = load_cluster(cfg.cluster, nodes=cfg.nodes)
    topo = cluster.topology
    nics = cfg.nics_per_node or math.gcd(topo.nics_per_node, cfg.gpus_per_node)
    if (cfg.gpus_per_node, nics) != (topo.gpus_per_node, topo.nics_per_node):
        # A reshaped node keeps no per-GPU affinity map: GPUs split evenly over NICs.
        topo = Topology(nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node, nics_per_node=nics)
    return dataclasses.replace(cluster, topology=topo)


@dataclass
class Run:
    """Everything one rank builds once and reuses every step."""

    cfg: TrainConfig
    rank: int
    world_size: int
    dp_rank: int
    """This rank's data-parallel rank: the Plans' rank (``rank // tp`` in its pipeline stage)."""
    device: torch.device
    cluster: ClusterConfig
    model_cfg: ModelConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: ZeppelinBatchSampler
    make_plan: Callable[[Sequence[int]], list[Pass]]
    split: Callable[[Sequence[int]], list[list[int]]]
    """Global batch lengths -> sequence indices of each micro-batch."""
    comm: Communicator | None
    counters: ByteCounters
    remap_counters: RemapCounters
    """Bytes the layout switches sent (also inside ``counters``: same communicator)."""
    backend: AttentionBackend
    source: TokenSource
    remap: bool
    """The MLPs run on the plan's linear layout (``--remap on``, Zeppelin only)."""
    step: int = 0
    sampler_state: dict | None = None
    """Sampler state after the last global batch trained on (the sampler itself
    runs ahead: the next micro-batch is planned while this one computes)."""
    saved: str | None = None
    """Name of the last checkpoint this run wrote (the next save replaces it; rank 0)."""
    modeled_s: Callable[[Plan], float] | None = None
    """``--pp``: a plan's modeled step on the data-parallel cluster (orders each
    global batch's micro-batches for 1F1B, ``sim.pipeline.pipeline_order``)."""

    @property
    def topology(self) -> Topology:
        return self.cluster.topology


def build_run(cfg: TrainConfig, rank: int, world_size: int, device: torch.device) -> Run:
    """Model (identical on every rank), optimizer, sampler, planner, communicator."""
    cluster = resolve_cluster(cfg)
    cluster.topology.check_world_size(world_size)
    plan_cluster = data_parallel_stage_view(cluster, world_size, cfg.tp, cfg.pp, tp_rank=0)
    model_cfg = cfg.model_config()
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    remap = remap_on(cfg)
    torch.manual_seed(cfg.seed)  # Megatron's CPU init draws from torch's default generator
    model = build_gpt_model(model_cfg, max_seq_len=cfg.max_seq_len, dtype=dtype, remap=remap, tp=cfg.tp,
                            sequence_parallel=cfg.sequence_parallel, pp=cfg.pp).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    source, doc_lengths = make_token_source(cfg.lengths, cfg.data, cfg.seed, model_cfg.vocab_size)
    sampler = make_sampler(cfg, doc_lengths)
    counters = ByteCounters()
    comm = None if cfg.strategy == REFERENCE else make_communicator(
        cfg, data_parallel_stage_view(cluster, world_size, cfg.tp, cfg.pp, rank % cfg.tp), model_cfg, counters, dtype,
        device)
    dp_rank = rank % (world_size // cfg.pp) // cfg.tp   # in its pipeline stage
    run = Run(cfg=cfg, rank=rank, world_size=world_size, dp_rank=dp_rank, device=device, cluster=cluster,
              model_cfg=model_cfg, model=model, optimizer=optimizer, sampler=sampler,
              make_plan=make_planner(cfg, plan_cluster, model_cfg, remap),
              split=make_split(cfg, cluster), comm=comm,
              counters=counters,
              remap_counters=RemapCounters(),
              backend=get_backend(cfg.backend), source=source, remap=remap)
    if cfg.pp > 1:
        cost = pipeline_cost(cfg, cluster)
        run.modeled_s = lambda plan: decision_step_s(plan, cost)
    if cfg.load:
        load_checkpoint(run, Path(cfg.load))
    return run


def pipeline_cost(cfg: TrainConfig, cluster: ClusterConfig) -> CostModel:
    """The cost model that orders a global batch's micro-batches under ``--pp``:
    one stage's data-parallel ranks, the run's routing."""
    return CostModel(data_parallel_stage_view(cluster, cfg.world_size, cfg.tp, cfg.pp, tp_rank=0), cfg.model_config(),
                     routing=routing_on(cfg), ring_grad_dtype=cfg.engine_ring_grad_dtype)


def make_communicator(cfg: TrainConfig, cluster: ClusterConfig, model_cfg: ModelConfig,
                      counters: ByteCounters, dtype: torch.dtype, device: torch.device) -> Communicator:
    """Direct point-to-point, or routed over every NIC (``--routing on``), over
    the data-parallel ranks of this TP rank and pipeline stage (``cluster`` is their view).  The
    communicator gets a group of its own so its transfers never interleave with
    the gradient all-reduce."""
    deadline = Deadline(cfg.timeout_s)
    groups = data_parallel_comm_groups(cfg.tp, cluster.topology.world_size, timeout=deadline.timedelta, pp=cfg.pp)
    if routing_on(cfg):
        from megatron_zeppelin.comm.routing import RoutedCommunicator, min_routed_bytes
        threshold = cfg.min_routed_bytes
        if threshold is None:
            threshold = 0.0 if device.type == "cpu" else min_routed_bytes(CostModel(cluster, model_cfg))
        return RoutedCommunicator(groups.intra, cluster.topology, counters, threshold, dtype=dtype, device=device,
                                  timeout=deadline.timedelta, inter_group=groups.inter)
    from megatron_zeppelin.comm.direct import DirectCommunicator
    return DirectCommunicator(groups.intra, topology=cluster.topology, counters=counters, timeout=deadline.timedelta,
                              inter_group=groups.inter)


def routing_on(cfg: TrainConfig) -> bool:
    """``--routing`` applies to Zeppelin only: the baselines send through NCCL
    p2p, each GPU over its own NIC, as their users run them."""
    return cfg.routing and cfg.strategy == "zeppelin"


def remap_on(cfg: TrainConfig) -> bool:
    """``--remap`` applies to Zeppelin only: the reference's and the baselines'
    linear layout is their attention layout (their users have no remapping layer)."""
    return cfg.remap and cfg.strategy == "zeppelin"


def make_planner(cfg: TrainConfig, cluster: ClusterConfig, model_cfg: ModelConfig,
                 remap: bool) -> Callable[[Sequence[int]], list[Pass]]:
    """``seq_lens -> validated Plans`` of the passes the run's strategy runs them as."""
    if cfg.strategy == REFERENCE:
        return make_reference_planner(cfg, cluster, model_cfg)
    planner = get_planner(cfg.strategy)
    # Without the remapping layer the linear modules see the attention layout.
    cost = CostModel(cluster, model_cfg, routing=routing_on(cfg), ring_grad_dtype=cfg.engine_ring_grad_dtype)
    # --remap on means remap every batch; Zeppelin still picks, by the model, the
    # plan for routed or direct crossings.
    ctx = PlanContext(cost=cost, tokens_per_gpu=cfg.tokens_per_gpu, tp_size=cfg.tp, remap_enabled=remap,
                      remap_decided=False,
                      cp_size=static_size(cfg.strategy, cost, cfg.max_seq_len, cfg.tokens_per_gpu),
                      step_model=surrogate_clock(cost), settle_model=replay_clock(cost),
                      rounds_model=rounds_clock(cost))

    def make_plan(seq_lens: Sequence[int]) -> list[Pass]:
        passes = planned_passes(planner, seq_lens, ctx)
        try:
            for p in passes:
                p.plan.validate()
        except PlanError as exc:
            raise PlanError(f"strategy {cfg.strategy} produced an invalid plan: {exc}") from None
        return passes
    return make_plan


def make_reference_planner(cfg: TrainConfig, cluster: ClusterConfig,
                           model_cfg: ModelConfig) -> Callable[[Sequence[int]], list[Pass]]:
    """The reference's one pass; with ``--batches-of S`` each batch is planned by
    S first, whose :class:`InfeasibleError` makes the sampler defer the piece S
    defers, so the reference trains S's batches."""
    topo = cluster.topology
    follow = None
    if cfg.batches_of is not None:
        other = dataclasses.replace(cfg, strategy=cfg.batches_of, batches_of=None)
        follow = make_planner(other, cluster, model_cfg, remap_on(other))

    def make_plan(seq_lens: Sequence[int]) -> list[Pass]:
        if follow is not None:
            follow(seq_lens)
        return [Pass(tuple(range(len(seq_lens))), reference_plan(seq_lens, topo.world_size, topo.gpus_per_node))]
    return make_plan


def train_step(run: Run, micro_batches: Iterator[MicroBatch]) -> StepRecord:
    """Forward and backward of every micro-batch of one global batch, then one
    all-reduce and, when the loss and the gradient norm are finite, the optimizer update."""
    t0 = time.perf_counter()
    run.counters.reset()
    run.remap_counters.reset()
    pairs = AttentionCounter()
    loss_sum, plans = 0.0, []
    if run.cfg.pp > 1:
        loss_sum, plans, micro = pipelined_global_batch(run, micro_batches, pairs)
    else:
        while True:
            micro = next(micro_batches)
            plans.append(micro.plan)
            loss_sum += forward_backward(run, micro, pairs)
            if micro.index == micro.count - 1:
                break
    with _collective(run, "gradient all-reduce"):
        grad_norm = allreduce_grads(run.model, run.cfg.sequence_parallel)
    # The GPUs of a TP group hold the same tokens: their loss is counted once (the
    # last pipeline stage's; the others have none).
    first_tp_rank = run.rank % run.cfg.tp == 0
    layers_here = run.model_cfg.num_layers // run.cfg.pp
    stats = torch.tensor([loss_sum if first_tp_rank else 0.0, pairs.forward_pairs // layers_here,
                          run.counters.intra_node, *bytes_per_physical_nic(run),
                          run.remap_counters.remap_intra_node, run.remap_counters.remap_inter_node],
                         dtype=torch.float64, device=run.device)
    gathered = [torch.empty_like(stats) for _ in range(run.world_size)]
    with _collective(run, "step statistics all-gather"):
        dist.all_gather(gathered, stats)
    rows = torch.stack(gathered).cpu()
    # Every rank sees every rank's loss and the same norm: all stop here, before the update.
    check_finite(run.step, rows[:, 0].tolist(), grad_norm, run.cfg.lr)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=False)
    run.step += 1
    run.sampler_state = micro.sampler_state
    return _record(run, plans, micro, rows, grad_norm, time.perf_counter() - t0)


def pipelined_global_batch(run: Run, micro_batches: Iterator[MicroBatch],
                           pairs: AttentionCounter) -> tuple[float, list[Plan], MicroBatch]:
    """The whole next global batch through Megatron-Core's 1F1B schedule: (this
    rank's summed token loss, the plans in split order, the last micro-batch)."""
    micros = [next(micro_batches)]
    while micros[-1].index < micros[-1].count - 1:
        micros.append(next(micro_batches))
    for micro in micros:
        agree_on_plan(run, micro)
    # Lightest at the ends where that shortens 1F1B (a heavy first forward or last
    # backward stalls every stage).  The order is the same on every rank (pure,
    # from the agreed plans); it changes only the gradient summation order.
    ordered = [micros[i] for i in pipeline_order([run.modeled_s(m.plan) for m in micros], run.cfg.pp)]
    loss_sum = pipeline_forward_backward(run, ordered, lambda plan: step_context(run, plan, pairs))
    return loss_sum, [m.plan for m in micros], micros[-1]


def engine_attn_shape(run: Run) -> AttnShape:
    """The attention shape this run's engine executes (heads, dtypes as sent)."""
    m = run.model_cfg
    dtype = next(run.model.parameters()).dtype
    return AttnShape(m.num_attention_heads, m.num_query_groups, m.head_dim, dtype.itemsize,
                     ring_grad_wire_dtype(dtype, run.cfg.engine_ring_grad_dtype).itemsize)


def dump_step_trace(run: Run, plan: Plan, recorder: StepRecorder, suffix: str) -> None:
    """Gather every rank's executed op times; rank 0 writes ``step{k}{suffix}.json``
    (one file per micro-batch: each runs its own Plan)."""
    records = [None] * run.world_size if run.rank == 0 else None
    dist.gather_object(rank_record(recorder), records, dst=0)
    if run.rank != 0:
        return
    m = run.model_cfg
    attn = engine_attn_shape(run)
    out = Path(run.cfg.dump_trace)
    out.mkdir(parents=True, exist_ok=True)
    write_step_trace(out / f"step{run.step}{suffix}.json", plan, m.num_layers, m.hidden_size, attn, run.comm.transport,
                     records, {"cluster": run.cluster.name, "model": m.name, "step": run.step})


def agree_on_plan(run: Run, micro: MicroBatch) -> None:
    """Every rank (every pipeline stage) holds the micro-batch's Plan; rank 0 writes
    it under ``--dump-plans``."""
    plan = micro.plan
    with _collective(run, "plan agreement all-reduce"):
        check_same_plan(plan, micro.batch.index, torch_all_reduce_max(run.device))
    if run.cfg.dump_plans and run.rank == 0:
        out = Path(run.cfg.dump_plans)
        out.mkdir(parents=True, exist_ok=True)
        suffix = f"_mb{micro.index}" if micro.count > 1 else ""
        doc = plan.to_dict()
        if run.comm is not None:      # how the engine runs it: sim --plan builds the same ops
            doc["engine"] = engine_settings(engine_attn_shape(run), run.comm.transport)
        (out / f"plan_{run.step:06d}{suffix}.json").write_text(json.dumps(doc))


def step_context(run: Run, plan: Plan, pairs: AttentionCounter) -> StepContext:
    """What the Zeppelin modules of this rank need to run ``plan``."""
    return StepContext(plan=None if plan.strategy == REFERENCE else plan, rank=run.dp_rank,
                       communicator=run.comm, backend=run.backend, attention_counter=pairs,
                       ring_grad_dtype=run.cfg.engine_ring_grad_dtype,
                       remap_counters=run.remap_counters, tp_size=run.cfg.tp, tp_rank=run.rank % run.cfg.tp,
                       sequence_parallel_group=sequence_parallel_group(run.cfg.sequence_parallel))


def forward_backward(run: Run, micro: MicroBatch, pairs: AttentionCounter) -> float:
    """One micro-batch: gradients of ``sum(token losses) / global label count``
    added to ``.grad``; returns this rank's summed token loss."""
    plan = micro.plan
    agree_on_plan(run, micro)
    spans = plan.attention_spans(run.dp_rank)
    data = build_rank_batch(spans, micro.pieces, run.source, run.device,
                            multiple_of=run.cfg.tp if run.cfg.sequence_parallel else 1)
    context = step_context(run, plan, pairs)
    packed = build_packed_seq_params(spans, context=context, device=run.device, pad_tokens=data.pad_tokens)
    recorder = StepRecorder() if run.cfg.dump_trace else None
    if run.comm is not None:
        run.comm.recorder = recorder
    token_loss = run.model(data.tokens[None], packed.position_ids[None], None,
                           labels=data.labels[None], packed_seq_params=packed)  # [1, t]
    loss_sum = (token_loss[0].float() * data.loss_mask).sum()
    if recorder is not None:
        recorder.mark("backward_begin")
    (loss_sum / num_label_tokens(micro.batch.seq_lens)).backward()
    if recorder is not None:
        recorder.mark("step_end")
        run.comm.recorder = None
        dump_step_trace(run, plan, recorder, f"_mb{micro.index}" if micro.count > 1 else "")
    return loss_sum.item()


def bytes_per_physical_nic(run: Run) -> list[int]:
    """Inter-node bytes this rank's communicator sent through each NIC of its node
    (its topology is the data-parallel view, whose NICs are renumbered under TP)."""
    out = [0] * run.topology.nics_per_node
    for view_nic, nic in enumerate(physical_nics(run.cluster, run.cfg.tp, run.rank % run.cfg.tp)):
        out[nic] += run.counters.inter_node_per_nic.get(view_nic, 0)
    return out


def _record(run: Run, plans: list[Plan], last: MicroBatch, rows: torch.Tensor, grad_norm: float,
            seconds: float) -> StepRecord:
    """Sums over the micro-batches (per rank where the field is per rank)."""
    topo = run.topology
    batch = last.batch
    per_rank = lambda f: [sum(col) for col in zip(*(f(p) for p in plans))]  # noqa: E731
    tiers = [p.tier_counts() for p in plans]
    inter = [[0] * topo.nics_per_node for _ in range(topo.nodes)]
    for r in range(run.world_size):
        for nic in range(topo.nics_per_node):
            inter[topo.node_of(r)][nic] += int(rows[r, 3 + nic])
    return StepRecord(
        step=run.step - 1, loss=float(rows[:, 0].sum()) / num_label_tokens(batch.seq_lens),
        grad_norm=grad_norm, num_tokens=batch.num_tokens,
        plan=TierCounts(**{k: sum(getattr(t, k) for t in tiers) for k in ("local", "intra", "inter", "ulysses")}),
        # per data-parallel rank (the first stage's ranks: every stage runs the same plan)
        attn_pairs_per_rank=[int(x) for x in rows[:run.world_size // run.cfg.pp:run.cfg.tp, 1]],
        linear_tokens_per_rank=per_rank(Plan.linear_tokens_per_rank),
        attention_tokens_per_rank=per_rank(Plan.attention_tokens_per_rank),
        micro_batch_tokens=[sum(p.seq_lens) for p in plans],
        intra_node_bytes=int(rows[:, 2].sum()), inter_node_per_nic=inter,
        remap_intra_node_bytes=int(rows[:, -2].sum()), remap_inter_node_bytes=int(rows[:, -1].sum()),
        step_time_s=seconds)


allreduce_grads = allreduce_gradients  # tests wrap it to capture the summed gradients


def _collective(run: Run, what: str):
    """A collective on the default group (its timeout is ``--timeout``): a dead
    or stalled peer becomes one line naming this rank and the operation."""
    return Deadline(run.cfg.timeout_s).collective(f"rank {run.rank}: {what} of step {run.step}")


def save_checkpoint(run: Run, directory: Path) -> None:
    """Model, optimizer, sampler and step: enough for an exact resume.  Every
    model-parallel shard (TP rank x EP rank) goes to rank 0, which writes them
    in one file atomically; nobody waits for the write (a barrier would turn a
    slow but complete save into a timeout), the launcher waits for rank 0 to
    exit.  The sampler state is the one of the last batch trained, not of the
    one planned ahead."""
    from megatron.core import parallel_state as mpu

    # The first rank of each expert-data-parallel group holds a shard no other
    # writer holds (with no experts, that group is the data-parallel group).
    mine = None
    if mpu.get_expert_data_parallel_rank() == 0:
        mine = (shard_name(), {"model": _on_cpu(run.model.state_dict()),
                               "optimizer": _on_cpu(run.optimizer.state_dict())})
    shards = [None] * run.world_size if run.rank == 0 else None
    with _collective(run, "checkpoint shard gather"):
        dist.gather_object(mine, shards, dst=0)
    if run.rank == 0:
        path = save_state(directory, {"step": run.step, "shards": dict(s for s in shards if s is not None),
                                      "layout": model_parallel_layout(run.cfg),
                                      "sampler": run.sampler_state or run.sampler.state_dict(),
                                      "strategy": run.cfg.strategy, "model_preset": run.model_cfg.name,
                                      "shape": run_shape(run.cfg)}, replaces=run.saved)
        run.saved = path.name


def run_shape(cfg: TrainConfig) -> dict[str, object]:
    """The flags that decide which global batches a run trains and how they are
    planned (a resume that changed one would train other batches than the run
    it continues)."""
    return {"--nodes x --gpus-per-node": cfg.world_size, "--tokens-per-gpu": cfg.tokens_per_gpu,
            "--micro-batches": cfg.micro_batches, "--strategy": cfg.strategy, "--batch-fill": cfg.batch_fill,
            "--batches-of": cfg.batches_of}


def shard_name() -> str:
    """This rank's model-parallel shard in a checkpoint (its pipeline stage first under PP)."""
    from megatron.core import parallel_state as mpu
    stage = (f"pp{mpu.get_pipeline_model_parallel_rank()}-"
             if mpu.get_pipeline_model_parallel_world_size() > 1 else "")
    return f"{stage}tp{mpu.get_tensor_model_parallel_rank()}-ep{mpu.get_expert_model_parallel_rank()}"


def model_parallel_layout(cfg: TrainConfig) -> dict[str, int]:
    """The TP and EP sizes (and the PP size, above 1) a checkpoint's shards are cut at."""
    pipeline = {"pp": cfg.pp} if cfg.pp > 1 else {}
    return {"tp": cfg.tp, "ep": cfg.expert_parallel_size, **pipeline}


def _on_cpu(state):
    """``state`` with its tensors on the CPU (rank 0 unpickles every shard)."""
    if torch.is_tensor(state):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_cpu(v) for v in state)
    return state


def check_resume(cfg: TrainConfig, model_name: str, path: Path, state: dict) -> int:
    """``state`` (loaded from ``path``) continues this run: same model, layout
    and shape, and steps left to train; returns its step.  One line if not."""
    if state["model_preset"] != model_name:
        raise ConfigError(f"{path} is of model {state['model_preset']!r}, this run builds "
                          f"{model_name!r}; pass the same --model")
    layout = model_parallel_layout(cfg)
    if state["layout"] != layout:
        saved = state["layout"] if isinstance(state["layout"], dict) else {}
        pipeline = saved.get("pp", 1) != 1 or layout.get("pp", 1) != 1   # name --pp where it differs from 1
        raise ConfigError(f"{path} holds shards of --tp {saved.get('tp')} --ep {saved.get('ep')}"
                          + (f" --pp {saved.get('pp', 1)}" if pipeline else "")
                          + f", this run is --tp {layout['tp']} --ep {layout['ep']}"
                          + (f" --pp {layout.get('pp', 1)}" if pipeline else "")
                          + "; resume with the layout it was saved at")
    saved, now = state["shape"] if isinstance(state["shape"], dict) else {}, run_shape(cfg)
    changed = [f"{flag} {saved.get(flag)} -> {value}" for flag, value in now.items() if saved.get(flag) != value]
    if changed:
        raise ConfigError(f"{path} was saved by a run of another shape ({'; '.join(changed)}): resumed so, it "
                          "would train other batches than the run it continues; resume with the saved values")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"{path}: its step is {str(step)[:40]!r}, not a whole number >= 0; the checkpoint is "
                          "damaged -- load another --save directory or start without --load")
    if step >= cfg.steps:
        raise ConfigError(f"{path} is at step {step} and --steps {cfg.steps} counts from the start: "
                          f"nothing left to train; pass --steps greater than {step}")
    return step


def load_checkpoint(run: Run, directory: Path) -> None:
    path, state = load_state(directory, run.device)
    step = check_resume(run.cfg, run.model_cfg.name, path, state)
    try:
        shard = state["shards"][shard_name()]
        run.model.load_state_dict(shard["model"])
        run.optimizer.load_state_dict(shard["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} does not fit this model or optimizer ({brief(exc, 240)}); load a "
                          "checkpoint of the same --model") from None
    run.sampler.load_state_dict(state["sampler"])
    run.sampler_state = state["sampler"]
    run.step = step


def _ignore(_message: str) -> None:
    """Other ranks defer the same pieces; rank 0 says so."""


def describe(run: Run) -> str:
    """One line saying what this run does."""
    cfg, topo, m = run.cfg, run.cluster.topology, run.model_cfg
    on = {True: "on", False: "off"}
    features = ("plain attention, no communication" + (f", the batches of {cfg.batches_of}" if cfg.batches_of else "")
                if cfg.strategy == REFERENCE else
                f"{type(run.backend).__name__} kernels, routing {on[routing_on(cfg)]}, remap {on[run.remap]}, "
                f"dK/dV ring messages in {cfg.engine_ring_grad_dtype}")
    if cfg.tp > 1:
        features += f", TP {cfg.tp}" + (" with sequence parallelism" if cfg.sequence_parallel else "")
    if cfg.pp > 1:
        features += f", PP {cfg.pp} (Megatron-Core's 1F1B schedule)"
    if m.moe_enabled:
        features += f", {m.num_experts} experts over EP {m.expert_parallel_size}"
    return (f"{cfg.strategy} on {topo.nodes} nodes x {topo.gpus_per_node} GPUs ({topo.nics_per_node} NICs "
            f"per node, {'gloo on CPU' if run.device.type == 'cpu' else 'NCCL'}); model {m.name} "
            f"({m.num_layers} layers, hidden {m.hidden_size}); {features}; {cfg.steps} steps of at most "
            f"{cfg.tokens_per_batch} tokens"
            + (f" in {cfg.micro_batches} micro-batches" if cfg.micro_batches > 1 else "")
            + f", cap {cfg.tokens_per_gpu} per GPU")


def run_start_record(cfg: TrainConfig) -> dict[str, object]:
    """What an appended log's ``run_start`` line says about the run."""
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": cfg.steps, "seed": cfg.seed,
            "load": cfg.load, **run_shape(cfg)}


def run_rank(cfg: TrainConfig, rank: int, world_size: int, device: torch.device) -> None:
    """Train ``cfg.steps`` steps in total (a ``--load`` run continues up to it)."""
    from megatron.core import parallel_state, tensor_parallel
    # Megatron's groups (data-parallel: the gradient all-reduce; TP; experts) get the
    # --timeout deadline too: with its default of 30 minutes, a run whose live ranks
    # all waited in the gradient all-reduce on a stalled peer hung that long.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tp,  # CP = 1
                                             pipeline_model_parallel_size=cfg.pp,
                                             expert_model_parallel_size=cfg.expert_parallel_size,
                                             distributed_timeout_minutes=cfg.timeout_s / 60)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)  # Megatron's CUDA RNG tracker
    else:
        apply_cpu_compat(cfg.seed)  # Megatron's TP/SP code on gloo: buffers and RNG tracker on the CPU
    logger = StepLogger(cfg.json_log if rank == 0 else None, cfg.steps, quiet=cfg.quiet or rank != 0,
                        run_start=run_start_record(cfg) if cfg.append_log else None)
    try:
        run = build_run(cfg, rank, world_size, device)
        logger.header(describe(run))
        # Plans micro-batch i + 1 (drawing the next global batch when i is the last)
        # on a worker thread while micro-batch i computes.
        note = logger.warn if rank == 0 else _ignore
        micro_batches = Prefetcher(iter_micro_batches(run.sampler, run.split, run.make_plan, note),
                                   name="zeppelin-plan")
        try:
            while run.step < cfg.steps:
                record = train_step(run, micro_batches)
                if rank == 0:
                    logger.log(record)
                if cfg.save and (run.step == cfg.steps or cfg.save_interval and run.step % cfg.save_interval == 0):
                    save_checkpoint(run, Path(cfg.save))
        finally:
            micro_batches.close()
        if cfg.save and run.step == 0:   # --steps 0: the initial state
            save_checkpoint(run, Path(cfg.save))
        close = getattr(run.comm, "close", None)
        if close is not None:
            close()
    finally:
        logger.close()
        parallel_state.destroy_model_parallel()
