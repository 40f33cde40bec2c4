"""Render a :class:`LaunchPreset` into the ``torchrun ... pretrain_gpt.py ...`` command.

Pure functions from preset data to argument lists, in three groups (torchrun,
Megatron, Zeppelin) so that a SLURM script can ask for the Megatron part only
and build its own ``srun torchrun`` around it.
"""

from __future__ import annotations

import shlex
from typing import Sequence

from megatron_zeppelin.integration.args import SPEC
from megatron_zeppelin.launch.preset import LaunchPreset, moe_dispatcher
from megatron_zeppelin.model_config import ModelConfig



def torchrun_args(p: LaunchPreset, rdzv_host: str = "localhost", rdzv_id: str = "zeppelin") -> list[str]:
    """torchrun flags: one rendezvous for every node (c10d on the first node's host)."""
    return ["torchrun", f"--nnodes={p.nodes}", f"--nproc-per-node={p.gpus_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_host}:{p.rdzv_port}", f"--rdzv-id={rdzv_id}"]


def model_args(m: ModelConfig, p: LaunchPreset) -> list[str]:
    """LLaMA-shaped model flags (RMSNorm, SwiGLU, rotary, no biases, untied output)."""
    args = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--ffn-hidden-size", str(m.ffn_hidden_size), "--num-attention-heads", str(m.num_attention_heads)]
    if m.num_query_groups != m.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    args += ["--seq-length", str(p.seq_length), "--max-position-embeddings", str(p.seq_length),
             "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--no-rope-fusion",
             "--transformer-impl", p.transformer_impl, "--spec", *SPEC]
    if m.moe_enabled:
        # No token dropping and no balancing losses (--zeppelin refuses both: they depend
        # on which tokens the plan puts on a rank).
        args += ["--num-experts", str(m.num_experts), "--moe-router-topk", str(m.moe_router_topk),
                 "--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size or m.ffn_hidden_size),
                 "--moe-router-load-balancing-type", "none",
                 "--expert-model-parallel-size", str(m.expert_parallel_size),
                 "--moe-token-dispatcher-type", moe_dispatcher(m)]
    if p.transformer_impl == "local":  # Megatron's local RMSNorm (torch) has no persistent kernel
        args.append("--no-persist-layer-norm")
    args += ["--tokenizer-type", p.tokenizer_type]
    args += (["--tokenizer-model", p.tokenizer_model] if p.tokenizer_model
             else ["--vocab-size", str(p.vocab_size or m.vocab_size)])
    return args


def training_args(p: LaunchPreset) -> list[str]:
    """Parallelism, batch shape, optimizer, precision, recompute, data and checkpoints."""
    # micro_batches packed micro-batches per data-parallel rank per step: the global
    # batch is a token budget, so Megatron's sample counts are 1 per micro-batch.
    args = ["--tensor-model-parallel-size", str(p.tensor_parallel),
            "--pipeline-model-parallel-size", str(p.pipeline_parallel),
            "--micro-batch-size", "1", "--global-batch-size", str(p.micro_batches * p.data_parallel_size),
            "--calculate-per-token-loss", "--dataloader-type", "external",
            "--train-iters", str(p.train_iters), "--seed", str(p.seed),
            "--lr", repr(p.lr), "--min-lr", repr(p.min_lr), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(p.warmup_iters), "--weight-decay", repr(p.weight_decay),
            "--clip-grad", repr(p.clip_grad), "--adam-beta1", "0.9", "--adam-beta2", "0.95"]
    if p.precision != "fp32":
        args.append(f"--{p.precision}")
    if p.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if p.recompute == "selective":  # Megatron's selective default recomputes core attention
        args += ["--recompute-granularity", "selective"]
    elif p.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    save = p.save.replace("${name}", p.name)
    args += ["--data-path", *p.data_path, "--split", p.split,
             "--save", save, "--load", save, "--save-interval", str(p.save_interval),
             "--log-interval", str(p.log_interval), "--eval-interval", str(p.eval_interval),
             "--eval-iters", str(p.eval_iters)]
    return args + list(p.extra_args)


def zeppelin_args(p: LaunchPreset) -> list[str]:
    """The ``--zeppelin-*`` flags (see megatron_zeppelin.integration.args)."""
    on_off = {True: "on", False: "off"}
    args = ["--zeppelin", "--zeppelin-planner", p.planner, "--zeppelin-tokens-per-gpu", str(p.tokens_per_gpu),
            "--zeppelin-cluster", p.cluster, "--zeppelin-routing", on_off[p.routing],
            "--zeppelin-remap", on_off[p.remap], "--zeppelin-decide", on_off[p.decide],
            "--zeppelin-ring-grad-dtype", p.ring_grad_dtype,
            "--zeppelin-log-interval", str(p.zeppelin_log_interval)]
    if p.plan_dump_dir:
        args += ["--zeppelin-plan-dump-dir", p.plan_dump_dir]
    return args


def pretrain_args(p: LaunchPreset, m: ModelConfig) -> list[str]:
    """Everything after ``pretrain_gpt.py``."""
    return model_args(m, p) + training_args(p) + zeppelin_args(p)


def render_command(p: LaunchPreset, m: ModelConfig, rdzv_host: str = "localhost") -> list[str]:
    """The full launch command of one node."""
    return [*torchrun_args(p, rdzv_host), f"{p.megatron_lm}/pretrain_gpt.py", *pretrain_args(p, m)]


def format_command(argv: Sequence[str]) -> str:
    """Shell text, one flag (with its values) per line, ready to paste.

    ``${VAR}`` references stay unquoted so the shell expands them."""
    lines: list[list[str]] = [[]]
    for arg in argv:
        starts_line = (arg.startswith("-") and not _is_number(arg)) or arg.endswith(".py")
        if starts_line and lines[-1]:
            lines.append([])
        lines[-1].append(arg)
    return " \\\n    ".join(" ".join(_quote(a) for a in line) for line in lines)


def _quote(arg: str) -> str:
    if "${" in arg and shlex.quote(arg.replace("${", "").replace("}", "")) == arg.replace("${", "").replace("}", ""):
        return arg
    return shlex.quote(arg)


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True
