"""Launch presets (``configs/presets/*.yaml``): one training run, mapped 1:1 onto a dataclass.

A preset names a model preset and a cluster preset and adds what a Megatron-LM
run needs (parallelism, sequence length and token budget, optimizer, data,
checkpoints).  :func:`load_launch_preset` rejects unknown and missing keys by
name; ``__post_init__`` checks the values against each other so a bad preset
fails before anything is launched.
"""

from __future__ import annotations

import argparse
import os
import re
import warnings
from dataclasses import dataclass, field

from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE, RING_GRAD_DTYPES
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.integration.args import check_pipeline_flags
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.planner.base import PLANNERS
from megatron_zeppelin.presets import build_dataclass, load_yaml, resolve_preset
from megatron_zeppelin.validation import check_float, check_int

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
TRANSFORMER_IMPLS = ("transformer_engine", "local")


@dataclass(frozen=True, kw_only=True)
class LaunchPreset:
    """One ``pretrain_gpt.py --zeppelin`` run."""

    name: str
    """Preset name (file stem)."""
    model: str
    """Model preset (``configs/models/``) or YAML file: layer count, widths, heads."""
    cluster: str
    """Cluster preset (``configs/clusters/``) or YAML file, passed as ``--zeppelin-cluster``."""
    nodes: int
    """Nodes to launch (torchrun ``--nnodes``)."""
    gpus_per_node: int
    """Processes per node (torchrun ``--nproc-per-node``)."""
    seq_length: int
    """Longest piece a document is cut into (``--seq-length``)."""
    tokens_per_gpu: int
    """Per data-parallel rank token cap (``--zeppelin-tokens-per-gpu``); longer pieces run on rings."""
    train_iters: int
    """Optimizer steps (one token-budget global batch each)."""
    data_path: tuple[str, ...]
    """``--data-path`` entries: ``PREFIX`` or ``WEIGHT PREFIX WEIGHT PREFIX ...``."""
    tensor_parallel: int = 1
    """Tensor-parallel size (heads split across TP ranks inside the engine)."""
    pipeline_parallel: int = 1
    """``--pipeline-model-parallel-size``: stages of whole nodes (or a slice of one
    node), each holding ``num_layers / pipeline_parallel`` layers; every stage runs
    each micro-batch's plan (non-interleaved 1F1B)."""
    virtual_pipeline_stages: int = 1
    """Interleaved 1F1B's model chunks per stage; only 1: ``pretrain_gpt.py --zeppelin``
    refuses interleaving (its schedule is not tested with per-micro-batch shapes)."""
    micro_batches: int = 1
    """Packed micro-batches per data-parallel rank per step (``--global-batch-size`` =
    micro_batches x data-parallel size); at least ``pipeline_parallel``."""
    planner: str = "zeppelin"
    """``--zeppelin-planner``: zeppelin or a baseline."""
    routing: bool = True
    """``--zeppelin-routing on|off``."""
    remap: bool = True
    """``--zeppelin-remap on|off``."""
    decide: bool = True
    """``--zeppelin-decide on|off``: each batch's plan picked among the decision's
    candidates by the replay's certified surrogate (on, as pretrain_gpt.py's default)."""
    ring_grad_dtype: str = DEFAULT_RING_GRAD_DTYPE
    """``--zeppelin-ring-grad-dtype``: what the backward ring's dK/dV travel in,
    ``model`` (the K/V dtype, as TransformerEngine does) or ``fp32`` (exact)."""
    precision: str = "bf16"
    """bf16, fp16 or fp32."""
    recompute: str = "selective"
    """Activation recomputation: none, selective (core attention), or full (every layer)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks."""
    transformer_impl: str = "transformer_engine"
    """Megatron ``--transformer-impl``: transformer_engine (GPU) or local."""
    tokenizer_type: str = "HuggingFaceTokenizer"
    """Megatron ``--tokenizer-type``."""
    tokenizer_model: str | None = None
    """``--tokenizer-model`` (a local HF tokenizer folder); None for NullTokenizer."""
    vocab_size: int | None = None
    """NullTokenizer ``--vocab-size`` (default: the model preset's); 257 fits data made
    with ``python -m megatron_zeppelin.data.prepare --tokenizer byte``."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Final learning rate of the cosine decay."""
    warmup_iters: int = 100
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    clip_grad: float = 1.0
    """Gradient norm clip."""
    seed: int = 1234
    """Model init and sampler seed."""
    split: str = "99,1,0"
    """Train/valid/test split of each dataset's documents."""
    save: str = "checkpoints/${name}"
    """Checkpoint folder; ``${name}`` expands to the preset name."""
    save_interval: int = 500
    """Steps between checkpoints."""
    log_interval: int = 1
    """Steps between Megatron log lines."""
    eval_interval: int = 1000
    """Steps between validation runs."""
    eval_iters: int = 10
    """Global batches per validation run."""
    zeppelin_log_interval: int = 50
    """``--zeppelin-log-interval``: tier counts and balance every N steps (0: off;
    default 50).  Under pipeline parallelism its sums run after the step's 1F1B
    schedule, never inside it."""
    plan_dump_dir: str | None = None
    """``--zeppelin-plan-dump-dir`` (None: no plan dumps)."""
    rdzv_port: int = 29500
    """torchrun c10d rendezvous port on the first node."""
    megatron_lm: str = "${MEGATRON_LM_DIR}"
    """Megatron-LM checkout holding the patched ``pretrain_gpt.py``."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """More Megatron flags, appended verbatim (e.g. ``--use-flash-attn``)."""

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node", "tensor_parallel", "pipeline_parallel", "virtual_pipeline_stages",
                    "micro_batches", "seq_length", "tokens_per_gpu", "train_iters", "save_interval", "log_interval",
                    "eval_interval"):
            check_int(getattr(self, key), f"preset {self.name}: {key}", minimum=1)
        for key in ("warmup_iters", "eval_iters", "seed"):
            check_int(getattr(self, key), f"preset {self.name}: {key}", minimum=0)
        check_int(self.zeppelin_log_interval, f"preset {self.name}: zeppelin_log_interval", minimum=0)
        check_int(self.rdzv_port, f"preset {self.name}: rdzv_port", minimum=1, maximum=65535)
        for key in ("lr", "min_lr", "weight_decay", "clip_grad"):
            check_float(getattr(self, key), f"preset {self.name}: {key}", minimum=0)
        if self.gpus_per_node % self.tensor_parallel:
            raise ConfigError(f"preset {self.name}: tensor_parallel {self.tensor_parallel} must divide "
                              f"gpus_per_node {self.gpus_per_node} (a TP group stays inside one node)")
        if self.world_size % (self.tensor_parallel * self.pipeline_parallel):
            raise ConfigError(f"preset {self.name}: tensor_parallel {self.tensor_parallel} x pipeline_parallel "
                              f"{self.pipeline_parallel} does not divide the {self.world_size} GPUs; pick sizes "
                              "whose product divides nodes x gpus_per_node")
        if self.seq_length > self.tokens_per_gpu * self.data_parallel_size:
            raise ConfigError(f"preset {self.name}: seq_length {self.seq_length} is longer than the "
                              f"{self.data_parallel_size} data-parallel ranks x tokens_per_gpu "
                              f"{self.tokens_per_gpu} can hold; raise tokens_per_gpu or lower seq_length")
        for key, value, allowed in (("planner", self.planner, tuple(PLANNERS)),
                                    ("precision", self.precision, PRECISIONS),
                                    ("ring_grad_dtype", self.ring_grad_dtype, RING_GRAD_DTYPES),
                                    ("recompute", self.recompute, RECOMPUTE),
                                    ("transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)):
            if value not in allowed:
                raise ConfigError(f"preset {self.name}: {key} {value!r} is not one of {', '.join(allowed)}")
        if not self.data_path:
            raise ConfigError(f"preset {self.name}: data_path is empty; list at least one dataset PREFIX")
        if self.tokenizer_type != "NullTokenizer" and not self.tokenizer_model:
            raise ConfigError(f"preset {self.name}: tokenizer_type {self.tokenizer_type} needs "
                              "tokenizer_model (a local tokenizer folder)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)


def check_model_fits(p: LaunchPreset, m: ModelConfig) -> None:
    """The preset's parallelism splits the model into whole pieces: TP takes whole
    heads and KV heads, expert parallelism spreads whole experts over data-parallel
    ranks (Megatron-LM would stop on each with an assert after start-up)."""
    for what, n in (("heads", m.num_attention_heads), ("KV heads", m.num_query_groups)):
        if n % p.tensor_parallel:
            raise ConfigError(f"preset {p.name}: tensor_parallel {p.tensor_parallel} does not divide model "
                              f"{m.name}'s {n} {what}; pick a tensor_parallel that divides {n}")
    if m.moe_enabled and p.data_parallel_size % m.expert_parallel_size:
        raise ConfigError(f"preset {p.name}: model {m.name}'s expert_parallel_size {m.expert_parallel_size} "
                          f"does not divide the {p.data_parallel_size} data-parallel ranks; pick a model "
                          "expert_parallel_size or a rank count that fits")
    check_pipeline(p, m)


#: ``pretrain_gpt.py``'s flags in the pipeline checks' messages, and the preset keys they come from.
PRESET_TERMS = (
    (re.compile(r"--zeppelin with --pipeline-model-parallel-size"), "pipeline_parallel"),
    (re.compile(r"--pipeline-model-parallel-size"), "pipeline_parallel"),
    (re.compile(r"drop --num-layers-per-virtual-pipeline-stage"), "set virtual_pipeline_stages: 1"),
    (re.compile(r"--num-layers (\d+)"), r"the model's \1 layers"),
    (re.compile(r"--global-batch-size / data-parallel size = (\d+) micro-batches"), r"micro_batches \1"),
    (re.compile(r"raise --global-batch-size"), "raise micro_batches"),
    (re.compile(r"--zeppelin-planner"), "planner"),
)


def moe_dispatcher(m: ModelConfig) -> str:
    """``--moe-token-dispatcher-type`` a preset renders: all-gather with EP 1, as the
    trainer's model builder picks; all-to-all spreads experts over EP ranks."""
    return "allgather" if m.expert_parallel_size == 1 else "alltoall"


def check_pipeline(p: LaunchPreset, m: ModelConfig) -> None:
    """What ``pretrain_gpt.py --zeppelin`` refuses under pipeline parallelism
    (``integration/args.py``'s checks, the single source), before launch and in
    the preset's own words."""
    if p.pipeline_parallel == 1 and p.virtual_pipeline_stages > 1:
        raise ConfigError(f"preset {p.name}: virtual_pipeline_stages {p.virtual_pipeline_stages} interleaves "
                          "pipeline stages, and pipeline_parallel is 1; set virtual_pipeline_stages: 1")
    flags = argparse.Namespace(
        pipeline_model_parallel_size=p.pipeline_parallel, num_layers=m.num_layers,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_stages if p.virtual_pipeline_stages > 1 else None,
        num_layers_per_virtual_pipeline_stage=None, world_size=p.world_size, zeppelin_cluster=p.cluster,
        tensor_model_parallel_size=p.tensor_parallel, context_parallel_size=1,
        global_batch_size=p.micro_batches * p.data_parallel_size, zeppelin_planner=p.planner,
        zeppelin_log_interval=p.zeppelin_log_interval, num_experts=m.num_experts if m.moe_enabled else None,
        moe_token_dispatcher_type=moe_dispatcher(m))
    try:
        with warnings.catch_warnings():
            # Its release check imports megatron.core, which warns on a host without TE or Apex.
            warnings.simplefilter("ignore")
            check_pipeline_flags(flags)
    except ConfigError as exc:
        message = str(exc)
        for pattern, replacement in PRESET_TERMS:
            message = pattern.sub(replacement, message)
        raise ConfigError(f"preset {p.name}: {message}") from None


def load_launch_preset(name_or_path: str | os.PathLike) -> LaunchPreset:
    """Load a launch preset by name (``configs/presets/``) or YAML path."""
    path = resolve_preset("presets", name_or_path)
    data = load_yaml(path)
    data.setdefault("name", path.stem)
    for key in ("data_path", "extra_args"):
        if key in data:
            value = data[key]
            data[key] = tuple(str(v) for v in (value if isinstance(value, list) else [value]))
    preset = build_dataclass(LaunchPreset, data, str(path))
    # The rendered command names these presets: they must exist now, not on the cluster.
    resolve_preset("clusters", preset.cluster)
    resolve_preset("models", preset.model)
    return preset
