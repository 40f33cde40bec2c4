"""Command line of ``python -m megatron_zeppelin.train`` -> :class:`TrainConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE, RING_GRAD_DTYPES, check_ring_grad_dtype
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import ModelConfig, load_model
from megatron_zeppelin.sampler import DEFAULT_BATCH_FILL, batch_budget
from megatron_zeppelin.sampler.lengths import resolve_lengths
from megatron_zeppelin.train.pipeline_layout import check_pipeline
from megatron_zeppelin.train.strategy_limits import check_strategy_holds
from megatron_zeppelin.train.checkpoint import held_checkpoint
from megatron_zeppelin.validation import (OneLineParser, check_batch_tokens, check_float, check_fresh_log, check_input_file, check_int,
                                          check_not_an_input, check_output_dir, check_output_file,
                                          check_sequence_limits)

STRATEGIES = ("zeppelin", "reference", "te_cp", "packing_dp", "megatron_hybrid_cp", "flexsp", "ulysses_sp")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run, as the command line gave it."""

    nodes: int
    """Nodes (simulated on CPU)."""
    gpus_per_node: int
    """Ranks per node."""
    nics_per_node: int | None
    """NICs per node (None: the cluster preset's, reduced to divide ``gpus_per_node``)."""
    cluster: str
    """Cluster preset name or YAML path (performance numbers for the planner)."""
    strategy: str
    """Planner name, or ``reference`` (plain data parallelism, the oracle)."""
    model: str
    """Model preset name or YAML path."""
    lengths: str | None
    """Document lengths file (synthetic token ids); a bundled name is resolved to its file."""
    data: str | None
    """Megatron indexed dataset prefix (``PREFIX.bin`` / ``PREFIX.idx``)."""
    max_seq_len: int
    """Longest sequence; longer documents are cut into pieces."""
    tokens_per_gpu: int
    """Per-rank token cap of the planners; the global batch is ``batch_fill`` x
    this x world size tokens."""
    steps: int
    """Optimizer steps to run (after a ``--load``, counted from the checkpoint's step)."""
    seed: int
    """Seeds the weights, the sampler and the synthetic tokens."""
    lr: float = 1e-3
    """Adam learning rate."""
    dtype: str = "fp32"
    """``fp32`` or ``bf16`` parameters and activations."""
    routing: bool = True
    """Route inter-node transfers over every NIC of a node (routing layer)."""
    min_routed_bytes: float | None = None
    """Cross-node messages smaller than this go direct.  None: the cost model's
    break-even on GPUs; 0 on a simulated CPU cluster, whose loopback links have
    no cost worth modelling, so every cross-node message exercises the routing."""
    remap: bool = True
    """Token-balanced linear layout through the remapping layer (Zeppelin only)."""
    ring_grad_dtype: str = DEFAULT_RING_GRAD_DTYPE
    """What Zeppelin's backward ring sends dK/dV in: ``model`` (the K/V dtype, as
    TransformerEngine does) or ``fp32`` (exact accumulation); the baselines keep
    TransformerEngine's ``model`` (:attr:`engine_ring_grad_dtype`)."""
    batch_fill: float = DEFAULT_BATCH_FILL
    """Fraction of the cluster's token capacity a global batch fills (slack lets
    every strategy place every batch)."""
    tp: int = 1
    """Tensor-parallel size: each GPU of a TP group (inside one node) holds
    ``1/tp`` of every layer's heads and MLP; plans place sequences over the
    ``world / tp`` data-parallel ranks."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs ``tp > 1``): norms and dropout on
    ``1/tp`` of each rank's tokens (padded to a multiple of ``tp``)."""
    pp: int = 1
    """Pipeline-parallel size: Megatron-Core's 1F1B schedule over ``pp`` stages of
    ``num_layers / pp`` layers each (``train/pipeline.py``); plans place
    sequences over one stage's ``world / (tp x pp)`` data-parallel ranks and every
    stage runs the micro-batch's plan."""
    ep: int | None = None
    """Expert-parallel size: each MoE layer's experts split over this many
    data-parallel ranks (Megatron-Core's all-to-all token dispatcher); None: the
    model preset's ``expert_parallel_size``."""
    micro_batches: int = 1
    """Micro-batches per global batch (gradient accumulation): the global batch
    holds this many times the tokens of one Plan, split by modeled work."""
    batches_of: str | None = None
    """Reference only: train the global batches this strategy trains (each batch
    is planned with it too, so a piece it defers to the next step waits here as
    well); None: the sampler's batches, which every strategy that defers nothing trains."""
    json_log: str | None = None
    """Write one JSON line per step to this file (new or empty, unless ``append_log``)."""
    append_log: bool = False
    """Add to a ``json_log`` that holds lines already, after a ``run_start`` line
    (``train.compare`` reads the last run of such a log)."""
    save: str | None = None
    """Directory to write the checkpoint to after the last step (and every
    ``save_interval`` steps).  It must hold no checkpoint but the ``--load`` one."""
    save_interval: int | None = None
    """Also save after every this many steps (None: at the end only)."""
    load: str | None = None
    """Directory to resume from (model, optimizer and sampler state)."""
    dump_plans: str | None = None
    """Directory to write each step's Plan JSON to."""
    dump_trace: str | None = None
    """Directory to write each step's executed Chrome trace to (``step{k}.json``)."""
    backend: str = "auto"
    """Attention kernel backend: ``auto``, ``torch``, ``torch_flash``, ``flash`` or ``te``."""
    timeout_s: float = 90.0
    """Collective timeout: a dead peer turns into an error after this long."""
    quiet: bool = False
    """No progress bar / per-step console line."""

    @property
    def engine_ring_grad_dtype(self) -> str:
        """The ring-gradient dtype the engine and the planner's cost model use:
        ``--ring-grad-dtype`` for Zeppelin, TransformerEngine's ``model`` for the
        baselines (as their users run them)."""
        return self.ring_grad_dtype if self.strategy == "zeppelin" else DEFAULT_RING_GRAD_DTYPE

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def expert_parallel_size(self) -> int:
        return self.ep if self.ep is not None else load_model(self.model).expert_parallel_size

    def model_config(self) -> ModelConfig:
        """The ``--model`` preset as this run builds it (with its expert-parallel size)."""
        return dataclasses.replace(load_model(self.model), expert_parallel_size=self.expert_parallel_size)

    @property
    def tokens_per_batch(self) -> int:
        """Global batch token budget: ``batch_fill x micro_batches x tokens_per_gpu x
        world`` (so one micro-batch of ``k x`` the tokens per GPU draws the same batches)."""
        return batch_budget(self.micro_batches * self.tokens_per_gpu, self.data_parallel_size,
                            self.max_seq_len, self.batch_fill)

    def check(self) -> "TrainConfig":
        """Checks before any process starts (each names the fix): values, inputs,
        and that every output can be written, so a run never trains for hours
        and then fails to save."""
        for name in ("nodes", "gpus_per_node", "tokens_per_gpu", "micro_batches", "tp", "pp"):
            check_int(getattr(self, name), f"--{name.replace('_', '-')}", minimum=1)
        if self.nics_per_node is not None:
            check_int(self.nics_per_node, "--nics-per-node", minimum=1, maximum=self.gpus_per_node)
        check_int(self.steps, "--steps", minimum=0)
        check_int(self.seed, "--seed", minimum=0, maximum=2**32 - 1)
        check_float(self.lr, "--lr", positive=True)
        check_float(self.timeout_s, "--timeout", positive=True)
        check_float(self.batch_fill, "--batch-fill", positive=True, maximum=1)
        check_ring_grad_dtype(self.ring_grad_dtype)
        if self.min_routed_bytes is not None:
            check_float(self.min_routed_bytes, "--min-routed-bytes", minimum=0)
        model = load_model(self.model)
        check_tensor_parallel(self.tp, self.sequence_parallel, self.gpus_per_node, model)
        check_pipeline(self.pp, model=model, world_size=self.world_size, gpus_per_node=self.gpus_per_node, tp=self.tp,
                       micro_batches=self.micro_batches, expert_parallel_size=self.expert_parallel_size,
                       dump_trace=self.dump_trace is not None)
        if self.ep is not None:
            check_int(self.ep, "--ep", minimum=1)
        check_expert_parallel(self.expert_parallel_size, model, self.data_parallel_size, self.tp,
                              self.sequence_parallel, from_flag=self.ep is not None)
        if (self.lengths is None) == (self.data is None):
            raise ConfigError("give exactly one of --lengths FILE (synthetic tokens) or --data PREFIX "
                              "(Megatron indexed dataset)")
        if self.lengths is not None:
            check_input_file(self.lengths, "--lengths", "a .npy or text file with one document length per line")
        if self.data is not None:
            missing = [self.data + ext for ext in (".bin", ".idx") if not Path(self.data + ext).is_file()]
            if missing:
                raise ConfigError(f"dataset prefix {self.data!r} has no {' / '.join(missing)}; pass the "
                                  "prefix of an existing Megatron indexed dataset (without .bin/.idx)")
        check_sequence_limits(self.max_seq_len, self.tokens_per_gpu, self.data_parallel_size,
                              f"{self.data_parallel_size} data-parallel ranks")
        check_batch_tokens(self.micro_batches * self.tokens_per_gpu * self.data_parallel_size,
                           "--micro-batches x --tokens-per-gpu x data-parallel ranks")
        if self.batches_of is not None and self.strategy != "reference":
            raise ConfigError(f"--batches-of makes the reference train another strategy's batches; with --strategy "
                              f"{self.strategy} drop it (or use --strategy reference --batches-of {self.batches_of})")
        for strategy in {self.strategy, self.batches_of} - {None}:
            check_strategy_holds(strategy, model, max_seq_len=self.max_seq_len, tokens_per_gpu=self.tokens_per_gpu,
                                 data_parallel_size=self.data_parallel_size, tp=self.tp)
        if self.load is not None and not Path(self.load).is_dir():
            raise ConfigError(f"--load {self.load!r} is not a directory; pass the --save directory "
                              "of an earlier run")
        self._check_outputs()
        batch_budget(self.tokens_per_gpu, self.data_parallel_size, self.max_seq_len, self.batch_fill)  # checks the fill
        if self.dump_trace and self.strategy == "reference":
            raise ConfigError("--dump-trace records the Zeppelin engine's ops; the reference strategy runs plain "
                              "attention with no schedule: pick another --strategy or drop --dump-trace")
        if self.dump_trace and self.tp > 1:
            raise ConfigError("--dump-trace lays one Plan's ranks onto the trace, and under --tp the ranks of a "
                              "TP group share a Plan rank: run it with --tp 1")
        return self


    def inputs(self) -> dict[str, str]:
        """Every file this run reads, by the flag that names it."""
        files = {"--lengths": self.lengths, "--model": self.model, "--cluster": self.cluster}
        files = {flag: path for flag, path in files.items() if path is not None and Path(path).is_file()}
        if self.data is not None:
            files.update({"--data (.bin)": self.data + ".bin", "--data (.idx)": self.data + ".idx"})
        if self.load is not None:
            files.update({f"--load ({p.name})": str(p) for p in Path(self.load).iterdir() if p.is_file()})
        return files

    def _check_outputs(self) -> None:
        """Every output is writable and none is an input; --save holds no
        checkpoint of another run; a log is new unless --append-log."""
        if self.save_interval is not None:
            check_int(self.save_interval, "--save-interval", minimum=1)
            if self.save is None:
                raise ConfigError("--save-interval saves checkpoints into --save DIR; add --save")
        inputs = self.inputs()
        for flag, path in (("--save", self.save), ("--dump-plans", self.dump_plans),
                           ("--dump-trace", self.dump_trace)):
            if path is not None:
                check_not_an_input(path, flag, inputs)
                check_output_dir(path, flag)
        if self.save is not None:
            held = held_checkpoint(Path(self.save))
            resumes = self.load is not None and os.path.samefile(self.load, self.save)
            if held is not None and not resumes:
                raise ConfigError(f"--save {self.save!r} already holds a checkpoint ({held}) of another run, which "
                                  f"this run would replace; pass --load {self.save} to resume from it (Megatron's "
                                  "--load = --save), or another --save directory")
        if self.json_log is not None:
            check_not_an_input(self.json_log, "--json-log", inputs)
            for flag, folder in (("--save", self.save), ("--load", self.load), ("--dump-plans", self.dump_plans),
                                 ("--dump-trace", self.dump_trace)):
                if folder is not None and Path(self.json_log).resolve().parent == Path(folder).resolve():
                    raise ConfigError(f"--json-log {self.json_log!r} is inside the {flag} folder, whose files the "
                                      "run writes; pass a path outside it")
            check_fresh_log(self.json_log, "--json-log", self.append_log, "--append-log")
            check_output_file(self.json_log, "--json-log")
        elif self.append_log:
            raise ConfigError("--append-log adds to the --json-log file; add --json-log FILE")


def check_tensor_parallel(tp: int, sequence_parallel: bool, gpus_per_node: int, model: ModelConfig) -> None:
    """A TP group stays inside one node and splits whole heads and KV heads."""
    if sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel splits tokens over tensor-parallel ranks; it needs --tp > 1")
    for what, n in (("--gpus-per-node", gpus_per_node), (f"model {model.name}'s heads", model.num_attention_heads),
                    (f"model {model.name}'s KV heads", model.num_query_groups)):
        if n % tp:
            raise ConfigError(f"--tp {tp} does not divide {what} ({n}); pick a TP size that divides it")


def check_expert_parallel(ep: int, model: ModelConfig, data_parallel_size: int, tp: int,
                          sequence_parallel: bool, from_flag: bool) -> None:
    """Experts split evenly over EP ranks of the data-parallel ranks; Megatron-Core
    trains an MoE layer under TP only with sequence parallelism.  ``from_flag``:
    ``ep`` is ``--ep``'s, else the model preset's."""
    what = f"--ep {ep}" if from_flag else f"model {model.name}'s expert_parallel_size {ep}"
    if ep > 1 and not model.moe_enabled:
        raise ConfigError(f"{what} spreads MoE experts over ranks and model {model.name} has none; drop --ep "
                          "or pick an MoE --model (tiny-moe)")
    if model.moe_enabled and model.num_experts % ep:
        raise ConfigError(f"{what} does not divide model {model.name}'s {model.num_experts} experts; "
                          "pick an --ep that divides them")
    if data_parallel_size % ep:
        raise ConfigError(f"{what} does not divide the {data_parallel_size} data-parallel ranks "
                          "(nodes x GPUs per node / --tp); pick an --ep that divides them")
    if model.moe_enabled and tp > 1 and not sequence_parallel:
        raise ConfigError(f"model {model.name}'s MoE layers under --tp {tp} need --sequence-parallel "
                          "(Megatron-Core trains them only with it); add --sequence-parallel")


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m megatron_zeppelin.train",
        description="Train a Megatron-Core GPT with a Zeppelin (or baseline) plan per step. On CPU it "
                    "spawns nodes x GPUs processes (gloo); under torchrun/srun it uses NCCL.")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--nics-per-node", type=int, default=None)
    p.add_argument("--cluster", default="cpu-sim", help="cluster preset name or YAML (default cpu-sim)")
    p.add_argument("--strategy", required=True, choices=STRATEGIES)
    p.add_argument("--model", default="tiny", help="model preset name or YAML (default tiny)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="document lengths: .npy / text file, or a bundled name under "
                                       "configs/lengths/ (tiny-longtail, ...); synthetic token ids")
    src.add_argument("--data", help="Megatron indexed dataset prefix (PREFIX.bin/.idx)")
    p.add_argument("--max-seq-len", type=int, required=True)
    p.add_argument("--tokens-per-gpu", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--routing", type=_on_off, default=True, metavar="on|off",
                   help="routed inter-node transfers over every NIC (default on; zeppelin only: the "
                        "baselines always send through each GPU's own NIC)")
    p.add_argument("--min-routed-bytes", type=float, default=None, metavar="BYTES",
                   help="cross-node messages below this go direct (default: the cost model's break-even "
                        "on GPUs, 0 on a simulated CPU cluster)")
    p.add_argument("--remap", type=_on_off, default=True, metavar="on|off",
                   help="token-balanced layout for the MLPs (default on; zeppelin only: the baselines run "
                        "their MLPs on their attention layout)")
    p.add_argument("--ring-grad-dtype", choices=RING_GRAD_DTYPES, default=DEFAULT_RING_GRAD_DTYPE,
                   help="what the backward ring's dK/dV messages travel in: model (the K/V dtype, as "
                        "TransformerEngine sends them; default) or fp32 (exact accumulation, twice a bf16 "
                        "model's backward ring bytes); zeppelin only: the baselines keep TransformerEngine's")
    p.add_argument("--batch-fill", type=float, default=DEFAULT_BATCH_FILL,
                   help=f"global batch = this x tokens-per-gpu x world tokens (default {DEFAULT_BATCH_FILL})")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel size (inside a node; divides heads and KV heads); plans place "
                        "sequences over the world / N data-parallel ranks (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism over the TP ranks (needs --tp > 1)")
    p.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline-parallel size: Megatron-Core's 1F1B schedule over P stages (P divides the "
                        "layers; --micro-batches >= P); every stage runs the micro-batch's plan (default 1)")
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="expert-parallel size: MoE experts split over N data-parallel ranks, tokens reach "
                        "them through Megatron-Core's all-to-all dispatcher (default: the model preset's "
                        "expert_parallel_size)")
    p.add_argument("--micro-batches", type=int, default=1, metavar="N",
                   help="gradient accumulation: a global batch of N x batch-fill x tokens-per-gpu x world "
                        "tokens, run as N planned micro-batches of equal modeled work (default 1)")
    p.add_argument("--batches-of", choices=[s for s in STRATEGIES if s != "reference"], metavar="STRATEGY",
                   help="with --strategy reference: train the batches STRATEGY trains (a piece it defers to the "
                        "next step waits here too), so the two logs compare step by step")
    p.add_argument("--json-log", metavar="OUT.jsonl", help="one JSON line per step (a new or empty file)")
    p.add_argument("--append-log", action="store_true",
                   help="add to a --json-log that holds lines, after a run_start line (compare reads the last run)")
    p.add_argument("--save", metavar="DIR",
                   help="checkpoint at the end (and every --save-interval steps); DIR holds no other run's "
                        "checkpoint unless it is also --load")
    p.add_argument("--save-interval", type=int, default=None, metavar="N", help="also save every N steps")
    p.add_argument("--load", metavar="DIR")
    p.add_argument("--dump-plans", metavar="DIR")
    p.add_argument("--dump-trace", metavar="DIR",
                   help="write each step's executed timeline as a Chrome trace DIR/step{k}.json (Perfetto opens "
                        "it; python -m megatron_zeppelin.sim replay re-times it)")
    p.add_argument("--backend", choices=("auto", "torch", "torch_flash", "flash", "te"), default="auto",
                   help="attention kernels: auto = torch_flash for bf16/fp16 on CUDA, torch otherwise")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("ZEPPELIN_TIMEOUT_S", 90)),
                   help="seconds before a collective waiting on a dead peer fails (default 90)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-step line")
    return p


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    a = build_parser().parse_args(argv)
    return TrainConfig(
        nodes=a.nodes, gpus_per_node=a.gpus_per_node, nics_per_node=a.nics_per_node, cluster=a.cluster,
        strategy=a.strategy, model=a.model,
        lengths=None if a.lengths is None else str(resolve_lengths(a.lengths)), data=a.data, max_seq_len=a.max_seq_len,
        tokens_per_gpu=a.tokens_per_gpu, steps=a.steps, seed=a.seed, lr=a.lr, dtype=a.dtype,
        routing=a.routing, min_routed_bytes=a.min_routed_bytes, remap=a.remap, ring_grad_dtype=a.ring_grad_dtype,
        batch_fill=a.batch_fill,
        tp=a.tp, pp=a.pp, sequence_parallel=a.sequence_parallel, ep=a.ep, micro_batches=a.micro_batches,
        batches_of=a.batches_of, json_log=a.json_log, append_log=a.append_log, save=a.save,
        save_interval=a.save_interval, load=a.load,
        dump_plans=a.dump_plans, dump_trace=a.dump_trace, backend=a.backend, timeout_s=a.timeout, quiet=a.quiet).check()
