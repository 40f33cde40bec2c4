"""The hand-off between Megatron-LM's training loop and Zeppelin, per step.

``pretrain_gpt.py`` (patched) calls:

* :func:`zeppelin_layer_spec` -- ``--spec megatron_zeppelin.integration.hooks
  zeppelin_layer_spec``: the GPT layer with ``ZeppelinAttention``;
* :func:`gpt_builder` (0.16.1) / :func:`gpt_model_config_cls` (0.19) -- the built
  ``GPTModel`` becomes a ``ZeppelinGPTModel`` (per-token RoPE positions);
* :func:`build_train_valid_test_loaders` -- instead of Megatron's datasets: one
  :class:`ZeppelinLoader` per split (``--dataloader-type external``);
* :func:`get_batch` / :func:`get_batch_by_keys` -- instead of Megatron's batch:
  this rank's tokens in the Plan's attention layout and a
  ``ZeppelinPackedSeqParams`` carrying the step's ``StepContext``, which
  ``ZeppelinGPTModel`` binds to every attention and remap module.

Each global batch is planned once, identically on every rank (same sampler, same
planner, no communication; ``flexsp`` plans on rank 0 and broadcasts), in a
background thread while the previous step trains; a 63-bit fingerprint
all-reduce proves the ranks agree before the batch is used.  Every
``--zeppelin-log-interval`` iterations the finished iteration is reported
(``step_report``).  With tensor parallelism the planner sees one "GPU" per TP group (the
data-parallel ranks); every TP rank of a group builds the same buffer and runs
its own heads, its rings talking over a copy of its data-parallel group.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.collectives import torch_all_reduce_max
from megatron_zeppelin.comm.groups import LaneGroups
from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE
from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.integration.args import (PLAN_ON_ONE_RANK, PREFETCH_MODES, check_args, megatron_terms,
                                                zeppelin_micro_batches)
from megatron_zeppelin.integration.checkpoint import data_state, restore_sampler
from megatron_zeppelin.integration.data import SPLITS, DocumentBlend, open_blends
from megatron_zeppelin.megatron.groups import data_parallel_comm_groups
from megatron_zeppelin.integration.step_report import (IterationReports, StepClock, format_report,
                                                        megatron_writers, sum_over_ranks, write_report)
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.plan.agreement import AllReduceMax, check_same_plan
from megatron_zeppelin.planner.micro_batches import Split, micro_batch_split
from megatron_zeppelin.plan_process import PlanFn, PlanningProcess
from megatron_zeppelin.prefetch import Prefetcher
from megatron_zeppelin.sampler import GlobalBatch, batch_budget
from megatron_zeppelin.sampler.deferral import DeferringSampler
from megatron_zeppelin.step_context import StepContext
from megatron_zeppelin.topology import ClusterConfig, Topology, load_cluster
from megatron_zeppelin.train.batch import RankBatch, build_rank_batch, padded_length
from megatron_zeppelin.train.pipeline_layout import data_parallel_stage_view


def say_line(line: str) -> None:
    """Print ``line`` in one write: the loader's notes come from its prefetch
    thread, and ``print`` writes the text and the newline separately, so a
    line printed by the main thread at the same time could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------- layer spec
def zeppelin_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron ``--spec`` builder: the GPT layer with ``ZeppelinAttention``.

    ``config`` is Megatron-LM 0.19's ``GPTModelConfig`` (the transformer config on
    ``.transformer``) or 0.16.1's ``TransformerConfig`` (patched ``gpt_builders``).
    """
    from megatron.training import get_args

    return layer_spec_for(check_args(get_args()), getattr(config, "transformer", config))


def layer_spec_for(args: Any, transformer_config: Any) -> Any:
    """The Zeppelin layer spec for Megatron's flags and transformer config."""
    from megatron_zeppelin.megatron.spec import get_zeppelin_layer_spec

    from megatron_zeppelin.megatron.norm import sequence_parallel_block_spec

    spec = get_zeppelin_layer_spec(qk_layernorm=bool(transformer_config.qk_layernorm), remap=args.zeppelin_remap == "on",
                                   use_te=transformer_config.transformer_impl == "transformer_engine",
                                   num_experts=getattr(transformer_config, "num_moe_experts", None))
    # Megatron's local norm refuses sequence parallelism: the block (this pipeline
    # stage's layers) gets norms that accept it.
    stage_layers = transformer_config.num_layers // (getattr(transformer_config, "pipeline_model_parallel_size", 1) or 1)
    return (sequence_parallel_block_spec(spec, stage_layers) if transformer_config.sequence_parallel else spec)


# ------------------------------------------------------------------- model
def as_zeppelin_model(model: Any) -> Any:
    """Re-type a freshly built Megatron-Core ``GPTModel`` as ``ZeppelinGPTModel``.

    Ring shards start mid-sequence, so RoPE must use each token's own position;
    ``ZeppelinGPTModel`` differs from ``GPTModel`` only by that ``_preprocess``
    override (no state of its own), so the built instance is complete as it is.
    Megatron-LM constructs ``GPTModel`` by name inside its builders: re-typing the
    result avoids copying them into the patch.
    """
    from megatron.core.models.gpt import GPTModel

    from megatron_zeppelin.megatron.model import ZeppelinGPTModel

    if type(model) is not GPTModel:
        raise ConfigError(f"--zeppelin trains Megatron-Core's GPTModel, the builder returned "
                          f"{type(model).__name__}; drop --use-legacy-models / ModelOpt")
    model.__class__ = ZeppelinGPTModel
    return model


def gpt_builder(base: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM 0.16.1 ``model_provider`` builder: ``base`` (``gpt_builders.gpt_builder``),
    then :func:`as_zeppelin_model` under ``--zeppelin``."""
    def build(args: Any, *rest: Any, **kwargs: Any) -> Any:
        if not args.zeppelin:
            return base(args, *rest, **kwargs)
        prepare_cpu_rank(args.seed)
        pipeline_shapes(args)
        return as_zeppelin_model(base(args, *rest, **kwargs))
    return build


def pipeline_shapes(args: Any) -> None:
    """Under ``--pipeline-model-parallel-size P > 1`` a rank's hidden states hold its
    token count in the micro-batch's Plan, which changes every micro-batch: the
    model's config must let Megatron-Core's p2p code exchange each shape first
    (``variable_seq_lengths``, which ``validate_args`` always clears).  Megatron
    refuses that flag beside its default all-gather MoE dispatcher even for a dense
    model: there the unused dispatcher type says all-to-all (an MoE model under PP
    must pass ``--moe-token-dispatcher-type alltoall``, ``args.check_pipeline_flags``)."""
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        args.variable_seq_lengths = True
        if not getattr(args, "num_experts", None):
            args.moe_token_dispatcher_type = "alltoall"


def prepare_cpu_rank(seed: int) -> None:
    """On a rank without CUDA (gloo), let Megatron-Core's tensor/sequence-parallel and
    MoE code run with its buffers and RNG tracker on the CPU
    (:mod:`megatron_zeppelin.megatron.cpu_compat`); on GPUs nothing changes.  Called
    after Megatron's parallel state exists, before the model is built."""
    if not torch.cuda.is_available():
        from megatron_zeppelin.megatron.cpu_compat import apply_cpu_compat
        apply_cpu_compat(seed)


@functools.cache
def _zeppelin_gpt_classes() -> tuple[type, type]:
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    class ZeppelinGPTModelBuilder(GPTModelBuilder):
        def build_model(self, *args: Any, **kwargs: Any) -> Any:
            from megatron.training import get_args

            prepare_cpu_rank(get_args().seed)
            transformer = self._model_config.transformer
            # As pipeline_shapes does for 0.16.1 (validate_args clears the flag; the
            # dense model's unused dispatcher never sees it, MoE must be all-to-all).
            if (transformer.pipeline_model_parallel_size or 1) > 1:
                transformer.variable_seq_lengths = True
            return as_zeppelin_model(super().build_model(*args, **kwargs))

    @dataclass(kw_only=True)
    class ZeppelinGPTModelConfig(GPTModelConfig):
        builder: ClassVar[str] = f"{__name__}.ZeppelinGPTModelBuilder"

    # Megatron serializes configs as "module.qualname" and resolves them with
    # getattr(module, name): name both classes as module attributes (see __getattr__).
    for cls in (ZeppelinGPTModelBuilder, ZeppelinGPTModelConfig):
        cls.__qualname__ = cls.__name__
    return ZeppelinGPTModelConfig, ZeppelinGPTModelBuilder


def gpt_model_config_cls() -> type:
    """Megatron-LM 0.19 ``GPTModelConfig`` subclass whose builder returns a
    ``ZeppelinGPTModel`` (pass as ``gpt_config_from_args(args, model_config_cls=...)``;
    it overrides metadata only, as ModelOpt's config does)."""
    return _zeppelin_gpt_classes()[0]


def __getattr__(name: str) -> Any:
    # The two classes subclass megatron.training.models (0.19+), so they are built
    # on first use; Megatron finds them by name through this hook.
    if name in ("ZeppelinGPTModelConfig", "ZeppelinGPTModelBuilder"):
        config_cls, builder_cls = _zeppelin_gpt_classes()
        return config_cls if name == "ZeppelinGPTModelConfig" else builder_cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ batches
@dataclass(frozen=True)
class PreparedBatch:
    """One global batch planned and read into host memory (built off the main thread)."""

    batch: GlobalBatch
    """The sampler's batch (pieces numbered per dataset, as the sampler draws them)."""
    plan: Plan | None
    """Validated Plan of the batch (None until it arrives, where another rank plans)."""
    data: RankBatch | None
    """This rank's input ids, labels and loss mask in attention-layout order (host memory),
    padded with one masked row when the Plan gives the rank no token (None on a
    middle pipeline stage, which reads no token)."""
    sampler_state: dict
    """Sampler state right after drawing this batch (what a checkpoint taken after it holds)."""


@dataclass(frozen=True)
class ZeppelinBatch:
    """What one Megatron micro-batch (= one global batch per rank) gets."""

    tokens: torch.Tensor | None
    """``[1, t]`` input ids (None on a middle pipeline stage)."""
    labels: torch.Tensor | None
    """``[1, t]`` next-token ids (None on a middle pipeline stage)."""
    loss_mask: torch.Tensor | None
    """``[1, t]`` float mask, 0 on each sequence's last token (None on a middle pipeline stage)."""
    position_ids: torch.Tensor
    """``[1, t]`` each token's position inside its own sequence."""
    packed_seq_params: Any
    """``ZeppelinPackedSeqParams`` carrying the step's ``StepContext``."""


class ZeppelinLoader:
    """Iterator of :class:`ZeppelinBatch` over one split (Megatron's external loader)."""

    def __init__(self, *, sampler: DeferringSampler, blend: DocumentBlend,
                 make_plan: Callable[[Sequence[int]], Plan], rank: int, device: torch.device,
                 communicator: Any, backend: Any, all_reduce_max: AllReduceMax | None,
                 prefetch: str = "thread", ring_grad_dtype: str = DEFAULT_RING_GRAD_DTYPE,
                 on_batch: Callable[[PreparedBatch, StepContext], None] | None = None,
                 broadcast_plan: Callable[[Plan | None], Plan] | None = None,
                 tp_size: int = 1, tp_rank: int = 0, split: Split | None = None,
                 pad_multiple: int = 1, sequence_parallel_group: Any = None, reads_tokens: bool = True,
                 note: Callable[[str], None] = lambda line: None) -> None:
        """``sampler``: the split's token-budget sampler; a global batch no plan can
        hold defers its last piece to the next global batch (``note`` hears of each
        deferral), as the trainer does (``sampler/deferral.py``).  ``rank``:
        data-parallel rank (the Plan's rank).  ``all_reduce_max``: the
        plan check (None: off).  ``ring_grad_dtype``: what the backward ring's
        dK/dV travel in (the cost model's, ``--zeppelin-ring-grad-dtype``).  ``on_batch``: called on the main thread with every
        batch handed out and its step context (checkpoint state, plan dumps, the
        previous iteration's report).  ``broadcast_plan``: plan on one rank only
        and hand its Plan to the others (a collective that gets that rank's Plan
        and None elsewhere); None: every rank plans.  ``split``: each global batch
        runs as these micro-batches (None: one).  ``pad_multiple``: each buffer is
        padded (rows without loss) to a multiple of it, at least one row (the TP
        size under ``--sequence-parallel``, which splits rows evenly).
        ``sequence_parallel_group``: Megatron's TP group under ``--sequence-parallel``
        (the remapped MLP gathers its rows over it), else None.  ``reads_tokens``:
        False on a middle pipeline stage, which gets the Plan and shapes only (its
        hidden states come from the previous stage).  ``prefetch``: ``process`` plans
        the next batch in a child process (``make_plan`` must be a picklable
        :class:`PlanFn`) while a thread here samples it and reads its tokens;
        ``thread`` plans on that thread; ``off`` plans in ``__next__``."""
        self.sampler, self.blend, self.make_plan = sampler, blend, make_plan
        self.rank, self.device, self.communicator, self.backend = rank, device, communicator, backend
        self.ring_grad_dtype = ring_grad_dtype
        self.all_reduce_max, self.on_batch, self.broadcast_plan = all_reduce_max, on_batch, broadcast_plan
        self.tp_size, self.tp_rank, self.pad_multiple = tp_size, tp_rank, pad_multiple
        self.sequence_parallel_group, self.reads_tokens = sequence_parallel_group, reads_tokens
        self.split, self.note = split, note
        self.plans_here = broadcast_plan is None or dist.get_rank() == 0
        """This rank computes Plans (all ranks, or the one that broadcasts)."""
        if prefetch not in PREFETCH_MODES:
            raise ConfigError(f"--zeppelin-prefetch {prefetch}: use one of {', '.join(PREFETCH_MODES)}")
        self._planning = PlanningProcess(make_plan) if prefetch == "process" and self.plans_here else None
        if self._planning is not None:
            self.make_plan = self._planning
        self._batches = self._planned_micro_batches()
        # Plan batch k+1 while step k trains: the sampler and planner are pure host
        # code, and collectives stay on this thread.
        prepared = iter(self.prepare, None)
        self._prepared = Prefetcher(prepared, name="zeppelin-plan") if prefetch != "off" else prepared

    def _plan_parts(self, seq_lens: Sequence[int]) -> list[tuple[list[int], Plan | None]]:
        """A global batch's micro-batches (sequence indices) and their Plans; raises
        InfeasibleError when one cannot be planned (the sampler then defers a piece).
        Where another rank plans (flexsp), its Plans come later (None here): every
        rank splits alike, and a batch its planner cannot place stops the run."""
        parts = self.split(seq_lens) if self.split is not None else [list(range(len(seq_lens)))]
        if not self.plans_here:
            return [(part, None) for part in parts]
        try:
            return [(part, self.make_plan([seq_lens[i] for i in part])) for part in parts]
        except InfeasibleError as exc:
            if self.broadcast_plan is None:
                raise
            raise ConfigError(f"--zeppelin-planner {exc}; only planners every rank runs defer a piece "
                              "to the next global batch (e.g. --zeppelin-planner zeppelin)") from None

    def _planned_micro_batches(self) -> Iterator[tuple[GlobalBatch, Plan | None, dict]]:
        while True:
            batch, parts = self.sampler.next_planned(self._plan_parts, self.note)
            state = self.sampler.state_dict()
            for part, plan in parts:
                yield GlobalBatch(batch.index, batch.epoch, tuple(batch.pieces[i] for i in part)), plan, state

    def prepare(self) -> PreparedBatch:
        """Draw, plan and read the next micro-batch (pure host work: safe off the main thread).
        Where another rank plans, the plan and data are left for :meth:`__next__`."""
        batch, plan, state = next(self._batches)
        if plan is None:
            return PreparedBatch(batch, None, None, state)
        return self._with_plan(PreparedBatch(batch, plan, None, state))

    def _with_plan(self, p: PreparedBatch) -> PreparedBatch:
        if not self.reads_tokens:
            return p
        data = build_rank_batch(p.plan.attention_spans(self.rank), self.blend.blend_pieces(p.batch.pieces),
                                self.blend, torch.device("cpu"), multiple_of=self.pad_multiple)
        return dataclasses.replace(p, data=data)

    def __iter__(self) -> "ZeppelinLoader":
        return self

    def __next__(self) -> ZeppelinBatch:
        prepared = next(self._prepared)
        if self.broadcast_plan is not None:
            prepared = dataclasses.replace(prepared, plan=self.broadcast_plan(prepared.plan))
            if prepared.data is None:
                prepared = self._with_plan(prepared)
        if self.all_reduce_max is not None:
            check_same_plan(prepared.plan, prepared.batch.index, self.all_reduce_max)
        batch = self._to_device(prepared)
        if self.on_batch is not None:
            self.on_batch(prepared, batch.packed_seq_params.context)
        return batch

    def _to_device(self, p: PreparedBatch) -> ZeppelinBatch:
        from megatron_zeppelin.megatron.packed import build_packed_seq_params

        context = StepContext(plan=p.plan, rank=self.rank, communicator=self.communicator, backend=self.backend,
                              ring_grad_dtype=self.ring_grad_dtype,
                              tp_size=self.tp_size, tp_rank=self.tp_rank,
                              sequence_parallel_group=self.sequence_parallel_group)
        spans = p.plan.attention_spans(self.rank)
        if p.data is None:  # a middle pipeline stage: the rows its hidden states will have
            held = sum(sp.length for sp in spans)
            packed = build_packed_seq_params(spans, context=context, device=self.device,
                                             pad_tokens=padded_length(held, self.pad_multiple) - held)
            return ZeppelinBatch(None, None, None, packed.position_ids[None], packed)
        packed = build_packed_seq_params(spans, context=context, device=self.device, pad_tokens=p.data.pad_tokens)
        move = lambda t: t.to(self.device, non_blocking=True)[None]  # noqa: E731  [t] -> [1, t]
        return ZeppelinBatch(move(p.data.tokens), move(p.data.labels), move(p.data.loss_mask),
                             packed.position_ids[None], packed)

    def close(self) -> None:
        if isinstance(self._prepared, Prefetcher):
            self._prepared.close()
        if self._planning is not None:
            self._planning.close()


def get_batch(data_iterator: Any) -> tuple:
    """Megatron-LM 0.16.1 ``get_batch`` result: tokens, labels, loss_mask,
    attention_mask (None: causal inside each sequence), position_ids, packed params."""
    b = next(data_iterator)
    return b.tokens, b.labels, b.loss_mask, None, b.position_ids, b.packed_seq_params


def get_batch_by_keys(data_iterator: Any, keys: Sequence[str]) -> list:
    """Megatron-LM 0.19 ``get_batch`` result in ``BATCH_KEYS`` order; the patched
    ``forward_step`` takes the packed params (the Plan) from the ``cu_seqlens`` slot."""
    b = next(data_iterator)
    fields = {"tokens": b.tokens, "labels": b.labels, "loss_mask": b.loss_mask,
              "position_ids": b.position_ids, "cu_seqlens": b.packed_seq_params}
    return [fields.get(k) for k in keys]


# ------------------------------------------------------------------ setup
def model_config_from_args(args: Any) -> ModelConfig:
    """The cost model's view of Megatron's model flags."""
    heads = args.num_attention_heads
    return ModelConfig(
        name="pretrain_gpt", num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=getattr(args, "padded_vocab_size", None) or args.vocab_size,
        dtype_bytes=2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4)


def build_plan_fn(planner: str, cost: CostModel, tokens_per_gpu: int, remap: bool,
                  time_limit_s: float, tp_size: int = 1, decide: bool = False) -> PlanFn:
    """``seq_lens -> validated Plan`` (picklable: ``--zeppelin-prefetch process`` runs it in a
    child process; ``plan_process.PlanFn`` documents each argument)."""
    return PlanFn(planner, cost, tokens_per_gpu, remap, time_limit_s, tp_size, decide)


def _build_communicator(groups: LaneGroups, topology: Topology, cost: CostModel, routing: bool,
                        timeout: timedelta, dtype: torch.dtype, device: torch.device) -> Any:
    if routing:
        from megatron_zeppelin.comm.routing import RoutedCommunicator, min_routed_bytes
        return RoutedCommunicator(groups.intra, topology, min_routed_bytes=min_routed_bytes(cost), dtype=dtype,
                                  device=device, timeout=timeout, inter_group=groups.inter)
    from megatron_zeppelin.comm.direct import DirectCommunicator
    return DirectCommunicator(groups.intra, topology, timeout=timeout, device=device, inter_group=groups.inter)


def _resolve_cluster(args: Any, world_size: int, tp: int, pp: int, tp_rank: int) -> ClusterConfig:
    cluster = load_cluster(args.zeppelin_cluster)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and int(local) != cluster.topology.gpus_per_node:
        raise ConfigError(f"--zeppelin-cluster {args.zeppelin_cluster} has {cluster.topology.gpus_per_node} "
                          f"GPUs per node but this node runs {local} processes; use a matching preset")
    return data_parallel_stage_view(cluster, world_size, tp, pp, tp_rank)


def broadcast_plan_from_rank0(device: torch.device) -> Callable[[Plan | None], Plan]:
    """Collective: global rank 0 passes its Plan, every other rank None; all get rank 0's."""
    def broadcast(plan: Plan | None) -> Plan:
        box = [plan.to_json() if plan is not None else None]
        dist.broadcast_object_list(box, src=0, device=device)
        return plan if plan is not None else Plan.from_json(box[0]).validate()
    return broadcast


def build_train_valid_test_loaders(args: Any) -> tuple[ZeppelinLoader | None, ...]:
    """Megatron's dataset provider under ``--zeppelin``: one loader per split.

    Called on every rank (``is_distributed``) after the checkpoint is loaded, so
    ``args.iteration`` is the number of global batches already trained on.
    """
    from megatron.core import parallel_state as mpu

    from megatron_zeppelin.attention.backends import get_backend

    check_args(args)
    tp, dp = args.tensor_model_parallel_size, mpu.get_data_parallel_world_size()
    pp = args.pipeline_model_parallel_size or 1
    sequence_parallel = bool(getattr(args, "sequence_parallel", False))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    plan_cluster = _resolve_cluster(args, dist.get_world_size(), tp, pp, tp_rank=0)
    own_cluster = _resolve_cluster(args, dist.get_world_size(), tp, pp, tp_rank=dist.get_rank() % tp)
    plan_cluster.topology.check_world_size(dp)
    model = model_config_from_args(args)
    routing = args.zeppelin_routing == "on"
    cost = CostModel(plan_cluster, model, routing=routing, ring_grad_dtype=args.zeppelin_ring_grad_dtype)
    make_plan = build_plan_fn(args.zeppelin_planner, cost, args.zeppelin_tokens_per_gpu,
                              args.zeppelin_remap == "on", args.zeppelin_planner_time_limit, tp,
                              decide=args.zeppelin_decide == "on")
    broadcast = broadcast_plan_from_rank0(device) if args.zeppelin_planner in PLAN_ON_ONE_RANK else None
    # Every wait on a peer has Megatron's own deadline (--distributed-timeout-minutes).
    timeout = timedelta(minutes=getattr(args, "distributed_timeout_minutes", 10))
    communicator = _build_communicator(data_parallel_comm_groups(tp, dp, timeout, pp=pp), own_cluster.topology, cost,
                                       routing, timeout,
                                       getattr(args, "params_dtype", torch.float32), device)
    backend = get_backend(args.zeppelin_backend)
    blends = open_blends(args.data_path, args.split, args.zeppelin_data_lengths)
    seed = args.seed if args.zeppelin_seed is None else args.zeppelin_seed
    consumed = {"train": args.iteration,
                "valid": getattr(args, "consumed_valid_samples", 0) // args.global_batch_size, "test": 0}
    check = plan_check(device, pp) if args.zeppelin_check_plans == "on" else None
    micro = zeppelin_micro_batches(args)  # --global-batch-size / DP
    into_micro = micro_batch_split(micro, tokens_per_gpu=args.zeppelin_tokens_per_gpu, data_parallel_size=dp,
                              max_seq_len=args.seq_length, batch_fill=args.zeppelin_batch_fill, cost=cost)
    clock = StepClock()
    first = dist.get_rank() == 0
    say = say_line if first else (lambda line: None)
    if blends["valid"] is None and (getattr(args, "eval_iters", 0) or 0) > 0:
        # Megatron-LM would evaluate on a missing loader (TypeError at the first evaluation).
        say(f"zeppelin: --split {args.split} gives the validation split no document: evaluation is off "
            f"(as with --eval-iters 0, not {args.eval_iters}); give it a share, e.g. --split 98,2,0, to evaluate")
        args.eval_iters = 0
    loaders: list[ZeppelinLoader | None] = []
    for i, split in enumerate(SPLITS):
        blend = blends[split]
        if blend is None:
            loaders.append(None)
            continue
        # Each split draws its own order: the seed is offset by the split's index.
        budget = batch_budget(micro * args.zeppelin_tokens_per_gpu, dp, args.seq_length, args.zeppelin_batch_fill)
        sampler = DeferringSampler(blend.sampler(max_seq_len=args.seq_length, tokens_per_batch=budget, seed=seed + i))
        resumed = restore_sampler(sampler, consumed[split], saved_data_state(args) if split == "train" else None)
        if resumed:
            say(resumed)
        on_batch = (record_batch(args, split, first, iteration_reports(args, first, clock, model, device), budget)
                    if split == "train" else lambda p, context: clock.other_batch())
        loaders.append(ZeppelinLoader(
            sampler=sampler, blend=blend, make_plan=make_plan, rank=mpu.get_data_parallel_rank(),
            device=device, communicator=communicator, backend=backend, all_reduce_max=check,
            prefetch=args.zeppelin_prefetch, ring_grad_dtype=cost.ring_grad_dtype, split=into_micro,
            pad_multiple=tp if sequence_parallel else 1,
            sequence_parallel_group=mpu.get_tensor_model_parallel_group() if sequence_parallel else None,
            reads_tokens=mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage(),
            on_batch=on_batch, broadcast_plan=broadcast, tp_size=tp, tp_rank=dist.get_rank() % tp,
            note=lambda line, split=split: say(f"zeppelin {split}: {megatron_terms(line)}")))
    return tuple(loaders)


def plan_check(device: torch.device, pp: int) -> AllReduceMax:
    """The plan fingerprint all-reduce: over every rank, or under pipeline
    parallelism over this rank's stage (its tensor- and data-parallel ranks).  A
    collective spanning stages inside Megatron's 1F1B schedule would wait on a
    stage that is itself waiting to receive; a stage's ranks call the loader in
    step.  The stages agree by construction (the same sampler, split and planner
    on every rank, no communication), which each stage's check proves within it."""
    if pp == 1:
        return torch_all_reduce_max(device)
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_and_data_parallel_group()

    def reduce(values: Sequence[int]) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()
    return reduce


def saved_data_state(args: Any) -> dict | None:
    """The Zeppelin data state in the checkpoint Megatron resumed from (None: no
    resume, ``--finetune``, or a checkpoint written without ``--zeppelin``).

    Megatron-LM copies only its own counters out of the checkpoint's ``args``; this
    reads that entry again the way Megatron's ``load_args_from_checkpoint`` does
    (``torch_dist``: its common state; ``torch``: rank 0's file)."""
    if not getattr(args, "load", None) or not getattr(args, "iteration", 0) or getattr(args, "finetune", False):
        return None
    from megatron.training.checkpointing import _load_base_checkpoint

    state_dict = _load_base_checkpoint(args.load, args, rank0=True)[0]
    return getattr((state_dict or {}).get("args"), "zeppelin_data_state", None)


def record_batch(args: Any, split: str, first: bool, reports: IterationReports | None,
                 tokens_per_batch: int) -> Callable[[PreparedBatch, StepContext], None]:
    """The training loader's ``on_batch``: record the data state on ``args`` (saved in
    every Megatron checkpoint); hand each micro-batch to ``reports`` (the
    ``--zeppelin-log-interval`` report of each finished iteration; None: off); on the
    ``first`` rank also dump plans."""
    dump = Path(args.zeppelin_plan_dump_dir) if args.zeppelin_plan_dump_dir else None
    micro = zeppelin_micro_batches(args)
    seen = {"index": -1, "micro": 0}  # micro-batches of one global batch share its index

    def handle(p: PreparedBatch, context: StepContext) -> None:
        args.zeppelin_data_state = data_state(p.sampler_state, p.batch.index + 1, tokens_per_batch)
        seen["micro"] = seen["micro"] + 1 if p.batch.index == seen["index"] else 0
        seen["index"] = p.batch.index
        if reports is not None:
            reports.training_batch(p, context)
        if first and dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            suffix = f"_mb{seen['micro']}" if micro > 1 else ""
            (dump / f"{split}_plan_{p.batch.index:07d}{suffix}.json").write_text(p.plan.to_json())
    return handle


def iteration_reports(args: Any, first: bool, clock: StepClock, model: ModelConfig,
                      device: torch.device) -> IterationReports:
    """The training split's per-iteration reports: written to Megatron's writers on
    every rank, printed on the ``first``; under pipeline parallelism summed after
    each step's schedule (:func:`run_after_each_schedule`)."""
    pipelined = (args.pipeline_model_parallel_size or 1) > 1

    def emit(micro_batches: Sequence[PreparedBatch], report: Any) -> None:
        write_report(report, megatron_writers())
        if first:
            print(f"{format_plan_log(micro_batches)}, {format_report(report)}", flush=True)

    reports = IterationReports(args.zeppelin_log_interval, model, clock,
                               lambda values: sum_over_ranks(values, device), pipelined=pipelined, emit=emit,
                               note=say_line if first else (lambda line: None))
    if pipelined and args.zeppelin_log_interval:
        run_after_each_schedule(reports.after_schedule)
    return reports


def run_after_each_schedule(hook: Callable[[], None]) -> None:
    """Run ``hook`` on every rank right after each training step's pipeline schedule.

    Megatron-LM's ``train()`` hands its ``finalize_model_grads`` (the gradients'
    all-reduce, called on every rank once the schedule's last backward is done, and
    already a collective across the pipeline) to the schedule as
    ``config.finalize_model_grads_func``, read from ``megatron.training.training`` when
    ``train()`` starts, after the loaders are built: that name gets a wrapper calling
    it, then ``hook``.  Evaluation (forward only) calls neither."""
    from megatron.training import training

    finalize = getattr(training.finalize_model_grads, "zeppelin_wrapped", training.finalize_model_grads)

    @functools.wraps(finalize)
    def finalize_then_hook(*args: Any, **kwargs: Any) -> Any:
        result = finalize(*args, **kwargs)
        hook()
        return result

    finalize_then_hook.zeppelin_wrapped = finalize  # type: ignore[attr-defined]  (a rebuild wraps it once)
    training.finalize_model_grads = finalize_then_hook


def format_plan_log(micro_batches: Sequence[PreparedBatch]) -> str:
    """Batch, sequences, tokens and tiers (summed over the global batch's micro-batches),
    attention and linear balance (max / mean; the least balanced micro-batch's)."""
    ratio = lambda xs: max(xs) / (sum(xs) / len(xs)) if sum(xs) else 1.0  # noqa: E731
    tiers = [p.plan.tier_counts() for p in micro_batches]
    tier = {name: sum(getattr(t, name) for t in tiers) for name in ("local", "intra", "inter", "ulysses")}
    attention = max(ratio(p.plan.attn_pairs_per_rank()) for p in micro_batches)
    linear = max(ratio(p.plan.linear_tokens_per_rank()) for p in micro_batches)
    parts = f" in {len(micro_batches)} micro-batches" if len(micro_batches) > 1 else ""
    return (f"zeppelin batch {micro_batches[0].batch.index}: {sum(len(p.batch.pieces) for p in micro_batches)} "
            f"seqs, {sum(p.batch.num_tokens for p in micro_batches)} tokens{parts}, "
            f"local {tier['local']} intra {tier['intra']} inter {tier['inter']} ulysses {tier['ulysses']}, "
            f"attention max/mean {attention:.3f}, linear max/mean {linear:.3f}")
