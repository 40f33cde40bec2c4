"""One rank's training loop: sample, plan, build the buffer, run the GPT, all-reduce.

Every rank runs the sampler and the planner itself (both are deterministic) and
the ranks prove they agree by all-reducing the Plan's fingerprint.  The loss is
the per-token mean over the whole global batch: each rank backpropagates
``sum(its token losses) / global label count`` and gradients are summed over the
world, so every strategy computes the same gradient as plain data parallelism.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.attention.backends import AttentionBackend, get_backend
from megatron_zeppelin.attention.engine import AttentionCounter
from megatron_zeppelin.comm.base import ByteCounters, Communicator
from megatron_zeppelin.comm.collectives import torch_all_reduce_max
from megatron_zeppelin.comm.deadline import Deadline
from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import ConfigError, PlanError, brief
from megatron_zeppelin.megatron import build_gpt_model, build_packed_seq_params
from megatron_zeppelin.model_config import ModelConfig, load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.plan.agreement import check_same_plan
from megatron_zeppelin.remap import RemapContext, RemapCounters, set_remap_context
from megatron_zeppelin.planner.base import PlanContext, get_planner
from megatron_zeppelin.sampler import GlobalBatch, ZeppelinBatchSampler
from megatron_zeppelin.sampler.deferral import DeferringSampler
from megatron_zeppelin.topology import ClusterConfig, Topology, load_cluster
from megatron_zeppelin.train.batch import (TokenSource, build_rank_batch, make_token_source,
                                           num_label_tokens)
from megatron_zeppelin.train.checkpoint import load_state, save_state
from megatron_zeppelin.train.cli import TrainConfig
from megatron_zeppelin.train.log import StepLogger, StepRecord
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
    device: torch.device
    cluster: ClusterConfig
    model_cfg: ModelConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: DeferringSampler
    """Token-budget batches; a piece no plan holds waits for the next step."""
    make_plan: Callable[[Sequence[int]], Plan]
    comm: Communicator | None
    counters: ByteCounters
    remap_counters: RemapCounters
    """Bytes the layout switches sent (also inside ``counters``: same communicator)."""
    backend: AttentionBackend
    source: TokenSource
    remap: bool
    """The MLPs run on the plan's linear layout (``--remap on``, not the reference)."""
    step: int = 0

    @property
    def topology(self) -> Topology:
        return self.cluster.topology


def build_run(cfg: TrainConfig, rank: int, world_size: int, device: torch.device) -> Run:
    """Model (identical on every rank), optimizer, sampler, planner, communicator."""
    cluster = resolve_cluster(cfg)
    cluster.topology.check_world_size(world_size)
    model_cfg = load_model(cfg.model)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    # The reference's linear layout is its attention layout: nothing to remap.
    remap = cfg.remap and cfg.strategy != REFERENCE
    torch.manual_seed(cfg.seed)  # Megatron's CPU init draws from torch's default generator
    model = build_gpt_model(model_cfg, max_seq_len=cfg.max_seq_len, dtype=dtype, remap=remap).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    source, doc_lengths = make_token_source(cfg.lengths, cfg.data, cfg.seed, model_cfg.vocab_size)
    sampler = DeferringSampler(ZeppelinBatchSampler(doc_lengths, max_seq_len=cfg.max_seq_len,
                                                    tokens_per_batch=cfg.tokens_per_batch, seed=cfg.seed))
    counters = ByteCounters()
    comm = None if cfg.strategy == REFERENCE else make_communicator(cfg, cluster, model_cfg, counters,
                                                                     dtype, device)
    run = Run(cfg=cfg, rank=rank, world_size=world_size, device=device, cluster=cluster,
              model_cfg=model_cfg, model=model, optimizer=optimizer, sampler=sampler,
              make_plan=make_planner(cfg, cluster, model_cfg, remap), comm=comm, counters=counters,
              remap_counters=RemapCounters(),
              backend=get_backend(cfg.backend), source=source, remap=remap)
    if cfg.load:
        load_checkpoint(run, Path(cfg.load))
    return run


def make_communicator(cfg: TrainConfig, cluster: ClusterConfig, model_cfg: ModelConfig,
                      counters: ByteCounters, dtype: torch.dtype, device: torch.device) -> Communicator:
    """Direct point-to-point, or routed over every NIC (``--routing on``).  The
    communicator gets a group of its own so its transfers never interleave with
    the gradient all-reduce on the default group."""
    deadline = Deadline(cfg.timeout_s)
    # new_group's own default timeout is 30 minutes, not the world's.
    group = dist.new_group(list(range(cluster.topology.world_size)), timeout=deadline.timedelta)
    if cfg.routing:
        from megatron_zeppelin.comm.routing import RoutedCommunicator, min_routed_bytes
        threshold = cfg.min_routed_bytes
        if threshold is None:
            threshold = 0.0 if device.type == "cpu" else min_routed_bytes(CostModel(cluster, model_cfg))
        return RoutedCommunicator(group, cluster.topology, counters, threshold, dtype=dtype, device=device,
                                  timeout=deadline.timedelta)
    from megatron_zeppelin.comm.direct import DirectCommunicator
    return DirectCommunicator(group, topology=cluster.topology, counters=counters, deadline=deadline)


def make_planner(cfg: TrainConfig, cluster: ClusterConfig, model_cfg: ModelConfig,
                 remap: bool) -> Callable[[Sequence[int]], Plan]:
    """``seq_lens -> validated Plan`` for the run's strategy."""
    topo = cluster.topology
    if cfg.strategy == REFERENCE:
        return lambda lens: reference_plan(lens, topo.world_size, topo.gpus_per_node)
    planner = get_planner(cfg.strategy)
    # Without the remapping layer the linear modules see the attention layout.
    ctx = PlanContext(cost=CostModel(cluster, model_cfg, routing=cfg.routing),
                      tokens_per_gpu=cfg.tokens_per_gpu, remap_enabled=remap)

    def make_plan(seq_lens: Sequence[int]) -> Plan:
        plan = planner.plan(list(seq_lens), ctx)
        try:
            return plan.validate()
        except PlanError as exc:
            raise PlanError(f"strategy {cfg.strategy} produced an invalid plan: {exc}") from None
    return make_plan


def train_step(run: Run, batch: GlobalBatch, plan: Plan, t0: float) -> StepRecord:
    """Forward, backward, all-reduce and update for one planned global batch
    (``t0``: when planning began)."""
    with _collective(run, "plan agreement all-reduce"):
        check_same_plan(plan, batch.index, torch_all_reduce_max(run.device))
    if run.cfg.dump_plans and run.rank == 0:
        out = Path(run.cfg.dump_plans)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"plan_{run.step:06d}.json").write_text(plan.to_json())
    spans = plan.attention_spans(run.rank)
    pad = 0 if spans else 1  # Megatron's layers cannot run on zero tokens
    data = build_rank_batch(spans, batch.pieces, run.source, run.device, pad_tokens=pad)
    run.counters.reset()
    run.remap_counters.reset()
    pairs = AttentionCounter()
    packed = build_packed_seq_params(
        spans, plan=None if plan.strategy == REFERENCE else plan, rank=run.rank,
        communicator=run.comm, backend=run.backend, device=run.device, pad_tokens=pad,
        counters=pairs)
    if run.remap:
        set_remap_context(run.model, RemapContext(plan=plan, rank=run.rank, comm=run.comm,
                                                  counters=run.remap_counters))
    label_count = num_label_tokens(batch.seq_lens)
    token_loss = run.model(data.tokens[None], packed.position_ids[None], None,
                           labels=data.labels[None], packed_seq_params=packed)  # [1, t]
    loss_sum = (token_loss[0].float() * data.loss_mask).sum()
    (loss_sum / label_count).backward()
    with _collective(run, "gradient all-reduce"):
        grad_norm = allreduce_grads(run.model)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=False)
    stats = torch.tensor([loss_sum.item(), pairs.forward_pairs // run.model_cfg.num_layers,
                          run.counters.intra_node,
                          *[run.counters.inter_node_per_nic.get(n, 0)
                            for n in range(run.topology.nics_per_node)],
                          run.remap_counters.remap_intra_node, run.remap_counters.remap_inter_node],
                         dtype=torch.float64, device=run.device)
    gathered = [torch.empty_like(stats) for _ in range(run.world_size)]
    with _collective(run, "step statistics all-gather"):
        dist.all_gather(gathered, stats)
    rows = torch.stack(gathered).cpu()
    run.step += 1
    return _record(run, plan, batch, rows, grad_norm, label_count, time.perf_counter() - t0)


def _collective(run: Run, what: str):
    """A collective on the default group (its timeout is ``--timeout``): a dead
    or stalled peer becomes one line naming this rank and the operation."""
    return Deadline(run.cfg.timeout_s).collective(f"rank {run.rank}: {what} of step {run.step}")


def _record(run: Run, plan: Plan, batch: GlobalBatch, rows: torch.Tensor, grad_norm: float,
            label_count: int, seconds: float) -> StepRecord:
    topo = run.topology
    inter = [[0] * topo.nics_per_node for _ in range(topo.nodes)]
    for r in range(run.world_size):
        for nic in range(topo.nics_per_node):
            inter[topo.node_of(r)][nic] += int(rows[r, 3 + nic])
    return StepRecord(
        step=run.step - 1, loss=float(rows[:, 0].sum()) / label_count, grad_norm=grad_norm,
        num_tokens=batch.num_tokens, plan=plan.tier_counts(),
        attn_pairs_per_rank=[int(x) for x in rows[:, 1]],
        linear_tokens_per_rank=plan.linear_tokens_per_rank(),
        attention_tokens_per_rank=plan.attention_tokens_per_rank(),
        intra_node_bytes=int(rows[:, 2].sum()), inter_node_per_nic=inter,
        remap_intra_node_bytes=int(rows[:, -2].sum()), remap_inter_node_bytes=int(rows[:, -1].sum()),
        step_time_s=seconds)


def allreduce_grads(model: torch.nn.Module) -> float:
    """Sum gradients over the world (one flat buffer); returns the global grad L2 norm."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n
    return float(flat.norm())


def save_checkpoint(run: Run, directory: Path) -> None:
    """Model, optimizer, sampler and step: enough for an exact resume.  Rank 0
    writes it atomically; nobody waits for it (a barrier would turn a slow but
    complete save into a timeout), the launcher waits for rank 0 to exit."""
    if run.rank == 0:
        save_state(directory, {"step": run.step, "model": run.model.state_dict(),
                               "optimizer": run.optimizer.state_dict(), "sampler": run.sampler.state_dict(),
                               "strategy": run.cfg.strategy, "model_preset": run.model_cfg.name})


def load_checkpoint(run: Run, directory: Path) -> None:
    path, state = load_state(directory, run.device)
    if state["model_preset"] != run.model_cfg.name:
        raise ConfigError(f"{path} is of model {state['model_preset']!r}, this run builds "
                          f"{run.model_cfg.name!r}; pass the same --model")
    step = int(state["step"])
    if step >= run.cfg.steps:
        raise ConfigError(f"{path} is at step {step} and --steps {run.cfg.steps} counts from the start: "
                          f"nothing left to train; pass --steps greater than {step}")
    try:
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} does not fit this model or optimizer ({brief(exc, 240)}); load a "
                          "checkpoint of the same --model") from None
    run.sampler.load_state_dict(state["sampler"])
    run.step = step


def _ignore(_message: str) -> None:
    """Other ranks defer the same pieces; rank 0 says so."""


def describe(run: Run) -> str:
    """One line saying what this run does."""
    cfg, topo, m = run.cfg, run.cluster.topology, run.model_cfg
    on = {True: "on", False: "off"}
    features = ("plain attention, no communication" if cfg.strategy == REFERENCE else
                f"{type(run.backend).__name__} kernels, routing {on[cfg.routing]}, remap {on[run.remap]}")
    return (f"{cfg.strategy} on {topo.nodes} nodes x {topo.gpus_per_node} GPUs ({topo.nics_per_node} NICs "
            f"per node, {'gloo on CPU' if run.device.type == 'cpu' else 'NCCL'}); model {m.name} "
            f"({m.num_layers} layers, hidden {m.hidden_size}); {features}; {cfg.steps} steps of at most "
            f"{cfg.tokens_per_batch} tokens, cap {cfg.tokens_per_gpu} per GPU")


def run_rank(cfg: TrainConfig, rank: int, world_size: int, device: torch.device) -> None:
    """Train ``cfg.steps`` steps in total (a ``--load`` run continues up to it)."""
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel()  # TP = PP = CP = 1: Zeppelin is data parallel
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)  # Megatron's CUDA RNG tracker
    logger = StepLogger(cfg.json_log if rank == 0 else None, cfg.steps, quiet=cfg.quiet or rank != 0)
    try:
        run = build_run(cfg, rank, world_size, device)
        logger.header(describe(run))
        while run.step < cfg.steps:
            t0 = time.perf_counter()
            batch, plan = run.sampler.next_planned(run.make_plan, logger.warn if rank == 0 else _ignore)
            record = train_step(run, batch, plan, t0)
            if rank == 0:
                logger.log(record)
        close = getattr(run.comm, "close", None)
        if close is not None:
            close()
        if cfg.save:
            save_checkpoint(run, Path(cfg.save))
    finally:
        logger.close()
        parallel_state.destroy_model_parallel()
