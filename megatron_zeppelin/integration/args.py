"""``--zeppelin-*`` flags for Megatron-LM's ``pretrain_gpt.py`` and their validation.

:func:`add_zeppelin_args` is an ``extra_args_provider`` (it takes Megatron's
parser and returns it); :func:`chain_args_providers` composes it with the
provider ``pretrain_gpt.py`` already passes (ModelOpt's, when installed).
:func:`validate_zeppelin_args` runs on the parsed namespace and raises a
:class:`~megatron_zeppelin.errors.ConfigError` naming the conflicting flag and
the fix.  Nothing here imports Megatron, so the flags are testable anywhere.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE, RING_GRAD_DTYPES
from megatron_zeppelin.errors import ConfigError, ZeppelinError
from megatron_zeppelin.planner.base import PLANNERS
from megatron_zeppelin.topology import load_cluster
from megatron_zeppelin.validation import check_float, check_int, check_output_dir

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

#: ``--spec MODULE NAME``: Megatron-LM imports NAME from MODULE as the layer spec (a
#: builder taking the model config: native at 0.19, backported by the 0.16.1 patch).
SPEC = ("megatron_zeppelin.integration.hooks", "zeppelin_layer_spec")

#: Planners whose Plan may differ between ranks: a MILP solved under a wall-clock
#: limit (flexsp) can stop at a different incumbent on each rank, so one rank plans
#: and broadcasts (docs/baselines.md).  The others are deterministic: every rank plans.
PLAN_ON_ONE_RANK = frozenset({"flexsp"})

#: Attention kernel backends the engine can be asked for: ``attention.backends.BACKENDS``
#: (not imported: this module stays free of torch; a test keeps the two equal).
BACKENDS = ("auto", "torch", "torch_flash", "flash", "te")

#: ``--zeppelin-prefetch`` choices: where the next global batch is planned while this step trains.
PREFETCH_MODES = ("process", "thread", "off")

#: Flag defaults; validation reports any ``--zeppelin-*`` flag changed without ``--zeppelin``.
DEFAULTS = {
    "zeppelin_planner": "zeppelin",
    "zeppelin_tokens_per_gpu": None,
    "zeppelin_batch_fill": 0.95,
    "zeppelin_cluster": "h100-8x400g",
    "zeppelin_routing": "on",
    "zeppelin_remap": "on",
    "zeppelin_decide": "on",
    "zeppelin_backend": "auto",
    "zeppelin_ring_grad_dtype": DEFAULT_RING_GRAD_DTYPE,
    "zeppelin_data_lengths": None,
    "zeppelin_seed": None,
    "zeppelin_prefetch": "process",
    "zeppelin_check_plans": "on",
    "zeppelin_plan_dump_dir": None,
    "zeppelin_log_interval": 0,
    "zeppelin_planner_time_limit": 10.0,
}


def add_zeppelin_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``megatron-zeppelin`` argument group to Megatron's parser."""
    g = parser.add_argument_group(
        "megatron-zeppelin", "variable-length data parallelism (see docs/megatron-lm.md)")
    on_off = ("on", "off")
    g.add_argument("--zeppelin", action="store_true",
                   help="Train on token-budget batches of whole documents placed by a planner "
                        "(local / intra-node ring / inter-node ring per sequence).")
    g.add_argument("--zeppelin-planner", choices=list(PLANNERS), default=DEFAULTS["zeppelin_planner"],
                   help="Planner that places each global batch; the others are baselines.")
    g.add_argument("--zeppelin-tokens-per-gpu", type=int, default=None,
                   help="Per data-parallel rank token cap (both layouts); the global batch holds up "
                        "to this times the data-parallel size tokens. Pieces longer than it run on "
                        "rings; --seq-length may be up to this times the data-parallel size.")
    g.add_argument("--zeppelin-batch-fill", type=float, default=DEFAULTS["zeppelin_batch_fill"],
                   help="Global batch token budget as a fraction of --zeppelin-tokens-per-gpu x "
                        "data-parallel size; the slack lets every batch be packed under the cap "
                        "(as python -m megatron_zeppelin.sim assumes).")
    g.add_argument("--zeppelin-cluster", default=DEFAULTS["zeppelin_cluster"],
                   help="Cluster preset name (configs/clusters/) or YAML file: GPUs and NICs "
                        "per node, link speeds; the node count comes from the launched world.")
    g.add_argument("--zeppelin-routing", choices=on_off, default=DEFAULTS["zeppelin_routing"],
                   help="Spread inter-node ring traffic over every NIC of the node.")
    g.add_argument("--zeppelin-remap", choices=on_off, default=DEFAULTS["zeppelin_remap"],
                   help="Token-balanced layout for the linear modules (all-to-all-v remap).")
    g.add_argument("--zeppelin-decide", choices=on_off, default=DEFAULTS["zeppelin_decide"],
                   help="Per batch, plan with routed and with direct crossings, with and without the "
                        "remap (under --zeppelin-remap on) and as static CP's uniform layouts, and run "
                        "the plan whose replayed step the certified surrogate puts fastest (what the "
                        "simulator runs as zeppelin; milliseconds per batch, planned one batch ahead: "
                        "docs/results/planner_latency.md). off runs the first plan, remapping every "
                        "batch (the simulator's zeppelin_nodecide).")
    g.add_argument("--zeppelin-backend", choices=BACKENDS, default=DEFAULTS["zeppelin_backend"],
                   help="Attention kernels: auto runs bf16/fp16 CUDA tensors on torch_flash "
                        "(PyTorch's own FlashAttention) and fp32 or CPU tensors on torch; flash "
                        "(flash-attn 2.6-2.8) and te (TransformerEngine) only when named.")
    g.add_argument("--zeppelin-ring-grad-dtype", choices=RING_GRAD_DTYPES, default=DEFAULTS["zeppelin_ring_grad_dtype"],
                   help="What the backward ring's dK/dV messages travel in: model (the K/V dtype, as "
                        "TransformerEngine's CP ring sends them: half of fp32's bytes for bf16, one "
                        "rounding per ring step) or fp32 (exact accumulation). The planner and the "
                        "engine both follow it (docs/engine.md).")
    g.add_argument("--zeppelin-data-lengths", default=None,
                   help="Optional document lengths file (.npy or text, datasets in --data-path "
                        "order) the data must match: pins the run to the lengths you simulated.")
    g.add_argument("--zeppelin-seed", type=int, default=None,
                   help="Sampler seed (default: --seed).")
    g.add_argument("--zeppelin-prefetch", choices=PREFETCH_MODES, default=DEFAULTS["zeppelin_prefetch"],
                   help="Plan the next global batch while this step trains: process plans in a child "
                        "process (off this interpreter's lock, which launches the step's kernels), "
                        "thread on a background thread (shares the lock: slows a launch-bound step, "
                        "docs/results/planning_interference.md), off before each step.")
    g.add_argument("--zeppelin-check-plans", choices=on_off, default=DEFAULTS["zeppelin_check_plans"],
                   help="All-reduce a 63-bit plan fingerprint each step; a mismatch stops the run.")
    g.add_argument("--zeppelin-plan-dump-dir", default=None,
                   help="Write every step's Plan JSON here (rank 0 only).")
    g.add_argument("--zeppelin-log-interval", type=int, default=DEFAULTS["zeppelin_log_interval"],
                   help="Print tier counts and per-rank balance every N steps (0: never).")
    g.add_argument("--zeppelin-planner-time-limit", type=float,
                   default=DEFAULTS["zeppelin_planner_time_limit"],
                   help="Solver time limit in seconds for MILP planners (flexsp).")
    return parser


def chain_args_providers(*providers: Optional[ArgsProvider]) -> ArgsProvider:
    """One ``extra_args_provider`` that applies each non-None provider in order."""
    active = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in active:
            parser = p(parser)
        return parser

    return provider


def print_help_if_asked(extra_args_provider: ArgsProvider, argv: Sequence[str] | None = None) -> None:
    """Answer ``-h/--help`` with Megatron's flags *and* the extra ones, then exit.

    ``pretrain_gpt.py`` first pre-parses ``sys.argv`` for in-process restart without
    the extra-args provider, and that pre-parse would answer ``--help`` without the
    ``--zeppelin-*`` flags; called before it, this prints the complete help.
    """
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        from megatron.training.arguments import parse_args

        # argparse exits 0 after printing the help.
        parse_args(chain_args_providers(extra_args_provider, escape_help_percent))


def check_args_before_launch(extra_args_provider: ArgsProvider) -> None:
    """Parse ``sys.argv`` as Megatron-LM will and run :func:`check_args` on it, before
    Megatron builds any process group (core_v0.16.1's ``pretrain()`` parses,
    validates and initialises in one call).  Megatron's ``validate_args`` has not run
    yet, so flags it would quietly change are seen as given (``--sequence-parallel``
    with TP 1, which it turns off)."""
    from megatron.training.arguments import parse_args

    check_run_before_launch(parse_args(extra_args_provider))


def check_run_before_launch(args: argparse.Namespace) -> argparse.Namespace:
    """:func:`check_args`, then under ``--zeppelin`` the data and checkpoint-folder checks
    (``integration/preflight.py``), each a one-line exit 2; later Zeppelin errors are
    reported in one line too (:func:`report_zeppelin_errors_in_one_line`)."""
    check_args(args)
    if args.zeppelin:
        from megatron_zeppelin.integration.preflight import check_before_launch

        _one_line_or_exit(check_before_launch, args)
        report_zeppelin_errors_in_one_line(getattr(args, "save", None))
    return args


def report_zeppelin_errors_in_one_line(save: str | None = None) -> None:
    """An error of the project's own that ends the run later (a batch no plan holds, a
    peer that stopped answering within the deadline) prints as one ``pretrain_gpt.py: error:`` line in
    ``pretrain_gpt.py``'s terms instead of a traceback.  Every other exception (a
    failed save, a lost peer) keeps Python's report, followed by one line naming this
    rank and the last complete checkpoint in ``save`` (``--save``), which stays
    loadable: Megatron-LM writes its tracker file only after every rank saved."""
    previous = sys.excepthook

    def hook(kind, exc, traceback):
        # The project's own errors (ZeppelinError, comm's CommTimeoutError) are one clear line already.
        if issubclass(kind, ZeppelinError) or kind.__module__.startswith("megatron_zeppelin."):
            print(f"pretrain_gpt.py: error: {megatron_terms(str(exc))}", file=sys.stderr, flush=True)
            return
        previous(kind, exc, traceback)
        # The first line of the message, without a C++ source location ("[.../pair.cc:553] ").
        why = megatron_terms(re.sub(r"^\[[^\]]*:\d+\] ", "", (str(exc).splitlines() or [""])[0]))[:160]
        print(f"pretrain_gpt.py: error: rank {os.environ.get('RANK', '0')} stopped: {kind.__name__}: {why}"
              f"{last_checkpoint(save)}", file=sys.stderr, flush=True)
    sys.excepthook = hook


def last_checkpoint(save: str | None) -> str:
    """``; ...`` naming the last complete checkpoint in ``save``, or nothing."""
    tracker = Path(save or "") / "latest_checkpointed_iteration.txt"
    if not save or not tracker.is_file():
        return f"; no complete checkpoint in --save {save}" if save else ""
    return (f"; the last complete checkpoint, iteration {tracker.read_text().strip()} in --save {save}, stays "
            f"loadable: resume with --load {save}")


#: Flags of the project's own trainer that shared code (planner, sampler, communication
#: lanes) names in its messages, and what ``pretrain_gpt.py`` calls the same thing.
MEGATRON_TERMS = (
    (re.compile(r"\(--micro-batches; --global-batch-size / DP under --zeppelin\)"),
     "(--global-batch-size / data-parallel size)"),
    (re.compile(r"(?<![\w-])--micro-batches\b"), "--global-batch-size / data-parallel size"),
    (re.compile(r"(?<![\w-])--tokens-per-gpu\b"), "--zeppelin-tokens-per-gpu"),
    (re.compile(r"(?<![\w-])--max-seq-len\b"), "--seq-length"),
    (re.compile(r"(?<![\w-])--batch-fill\b"), "--zeppelin-batch-fill"),
    (re.compile(r"(?<![\w-])--lengths\b"), "--zeppelin-data-lengths"),
    (re.compile(r"(?<![\w-])--timeout ([0-9.]+) s\b"),
     lambda m: f"--distributed-timeout-minutes ({float(m.group(1)) / 60:g} min)"),
    (re.compile(r"(?<![\w-])--timeout\b"), "--distributed-timeout-minutes"),
    (re.compile(r"use_te=False"), "--transformer-impl local"),
    (re.compile(r"use_te=True"), "--transformer-impl transformer_engine"),
)


def megatron_terms(message: str) -> str:
    """``message`` with the trainer's flag names replaced by ``pretrain_gpt.py``'s."""
    for pattern, replacement in MEGATRON_TERMS:
        message = pattern.sub(replacement, message)
    return message


def _one_line_or_exit(check: Callable[[argparse.Namespace], object], args: argparse.Namespace) -> None:
    try:
        check(args)
    except ZeppelinError as exc:
        print(f"pretrain_gpt.py: error: {megatron_terms(str(exc))}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def escape_help_percent(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Double every bare ``%`` in help strings: argparse %-formats them, and one
    bare ``%`` (Megatron-LM core_v0.19.0 has ``"(e.g. 1.10 = 10%)"``) makes ``--help``
    raise instead of printing.  ``%%`` and ``%(name)s`` placeholders are kept."""
    for action in parser._actions:
        if action.help:
            action.help = _PERCENT.sub(lambda m: "%%" if m.group(0) == "%" else m.group(0), action.help)
    return parser


_PERCENT = re.compile(r"%%|%\(\w+\)|%")


def data_parallel_size(args: argparse.Namespace) -> int | None:
    """Data-parallel size implied by the launched world (None when unknown)."""
    world = getattr(args, "world_size", None)
    if not world:
        return None
    model_parallel = (getattr(args, "tensor_model_parallel_size", 1) or 1) * \
        (getattr(args, "pipeline_model_parallel_size", 1) or 1) * \
        (getattr(args, "context_parallel_size", 1) or 1)
    return world // model_parallel if world % model_parallel == 0 else None


def zeppelin_micro_batches(args: argparse.Namespace) -> int:
    """Micro-batches per global batch under ``--zeppelin`` (``--micro-batch-size 1``).

    Megatron runs ``--global-batch-size / (micro-batch size x DP)`` micro-batches
    per step; with one packed micro-batch per rank that is N = global batch size
    / DP.  Zeppelin's global batch is then a token budget of N x fill x
    tokens-per-GPU x DP, split into N micro-batches of equal modeled work, each
    planned under the per-GPU cap (``planner/micro_batches.py``)."""
    dp = data_parallel_size(args)
    gbs = getattr(args, "global_batch_size", None)
    return gbs // dp if gbs and dp else 1


def validate_zeppelin_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check the ``--zeppelin*`` flags against each other and Megatron's; raise ConfigError."""
    if not getattr(args, "zeppelin", False):
        changed = [k for k, default in DEFAULTS.items() if getattr(args, k, default) != default]
        if changed:
            flag = "--" + changed[0].replace("_", "-")
            raise ConfigError(f"{flag} has no effect without --zeppelin; add --zeppelin or drop it")
        return args
    _resolve_megatron_aliases(args)
    _check_numbers(args)
    _check_megatron_conflicts(args)
    _check_unsupported_features(args)
    _check_model_parallel(args)
    _check_batch_shape(args)
    _check_zeppelin_values(args)
    return args


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """:func:`validate_zeppelin_args` for a launched job: one line on stderr and exit 2
    on every rank (all ranks parse the same flags, so none is left waiting)."""
    _one_line_or_exit(validate_zeppelin_args, args)
    return args


def _flag(args: argparse.Namespace, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def check_pipeline_flags(args: argparse.Namespace) -> None:
    """``--pipeline-model-parallel-size P``: every stage runs each micro-batch's Plan
    (its per-rank token count is the boundary shape, ``variable_seq_lengths``)."""
    pp = _flag(args, "pipeline_model_parallel_size", 1)
    if pp == 1:
        return
    flag = f"--pipeline-model-parallel-size {pp}"
    if _flag(args, "num_layers_per_virtual_pipeline_stage", None) or _flag(
            args, "virtual_pipeline_model_parallel_size", None):
        raise ConfigError(f"--zeppelin with {flag} runs the non-interleaved 1F1B schedule only (the "
                          "interleaved one is not tested with per-micro-batch shapes); drop "
                          "--num-layers-per-virtual-pipeline-stage")
    layers = _flag(args, "num_layers", None)
    if layers is not None and layers % pp:
        raise ConfigError(f"{flag} does not divide --num-layers {layers} (every stage holds the same "
                          "number under --zeppelin); pick a size that divides them")
    world, gpus_per_node = getattr(args, "world_size", None), load_cluster(args.zeppelin_cluster).topology.gpus_per_node
    if world and world % pp == 0 and (world // pp) % gpus_per_node and gpus_per_node % (world // pp):
        raise ConfigError(f"{flag} gives stages of {world // pp} ranks, neither whole nodes of {gpus_per_node} GPUs "
                          "nor a slice of one node; pick a size that divides the nodes or a node's GPUs")
    micro = zeppelin_micro_batches(args)
    if data_parallel_size(args) is not None and micro < pp:
        raise ConfigError(f"--global-batch-size / data-parallel size = {micro} micro-batches is fewer than "
                          f"the {pp} pipeline stages (1F1B needs one per stage); raise --global-batch-size")
    if _flag(args, "zeppelin_planner", "zeppelin") in PLAN_ON_ONE_RANK:
        raise ConfigError(f"--zeppelin-planner {args.zeppelin_planner} plans on one rank and broadcasts "
                          f"inside the step, which {flag} would deadlock; use --zeppelin-planner zeppelin")
    dispatcher = _flag(args, "moe_token_dispatcher_type", "allgather")
    if _flag(args, "num_experts", None) and dispatcher != "alltoall":
        raise ConfigError(f"--zeppelin with {flag} and MoE needs --moe-token-dispatcher-type alltoall: the "
                          f"hidden states' rows change every micro-batch (variable_seq_lengths), which "
                          f"Megatron-Core's {dispatcher} dispatcher does not take; pass "
                          "--moe-token-dispatcher-type alltoall")


def megatron_core_version() -> tuple[int, int]:
    """(major, minor) of the Megatron-Core imported here ((0, 0) where none is)."""
    try:
        from megatron.core.package_info import MAJOR, MINOR
    except ImportError:
        return (0, 0)
    return (int(MAJOR), int(MINOR))


def _check_megatron_conflicts(args: argparse.Namespace) -> None:
    check_pipeline_flags(args)
    if _flag(args, "sequence_parallel", False) and _flag(args, "tensor_model_parallel_size", 1) == 1:
        raise ConfigError("--sequence-parallel splits tokens over tensor-parallel ranks; it needs "
                          "--tensor-model-parallel-size > 1 (or drop it)")
    cp = _flag(args, "context_parallel_size", 1)
    if cp > 1:
        raise ConfigError(f"--zeppelin conflicts with --context-parallel-size {cp}: Zeppelin places long "
                          "sequences on rings itself (per sequence, over the data-parallel ranks); "
                          "drop --context-parallel-size")
    if _flag(args, "hybrid_context_parallel", False):
        raise ConfigError("--zeppelin conflicts with --hybrid-context-parallel: both decide per-sequence "
                          "context parallelism; use --zeppelin-planner megatron_hybrid_cp to run that "
                          "baseline under Zeppelin instead")
    _check_moe(args)
    spec = getattr(args, "spec", None)
    if spec is None or tuple(spec) != SPEC:
        got = f"--spec {' '.join(spec)}" if spec else "no --spec"
        raise ConfigError(f"--zeppelin needs Zeppelin's layer spec, got {got}; pass --spec {' '.join(SPEC)}")
    if str(_flag(args, "attention_backend", "auto")).rsplit(".", 1)[-1] == "local":
        raise ConfigError("--zeppelin conflicts with --attention-backend local: Megatron then replaces the "
                          "layer's core attention with its own; drop the flag")
    if _flag(args, "attention_dropout", 0.0):
        raise ConfigError(f"--zeppelin needs --attention-dropout 0 (got {args.attention_dropout}): ring "
                          "and local shards of one sequence would draw different dropout masks")
    if _flag(args, "apply_rope_fusion", False):
        raise ConfigError("--zeppelin needs --no-rope-fusion: fused RoPE restarts positions at every "
                          "packed span, Zeppelin's ring shards need each token's own position")
    if _flag(args, "transformer_impl", "local") == "local" and \
            _flag(args, "normalization", "RMSNorm") != "RMSNorm":
        raise ConfigError("--zeppelin with --transformer-impl local builds RMSNorm layers; pass "
                          "--normalization RMSNorm (or use --transformer-impl transformer_engine)")
    if _flag(args, "transformer_impl", "local") == "local" and _flag(args, "persist_layer_norm", False):
        raise ConfigError("--zeppelin with --transformer-impl local uses torch's RMSNorm, which has no "
                          "persistent kernel; pass --no-persist-layer-norm")
    for name, why in (("use_legacy_models", "the legacy model has no layer spec to plug into"),
                      ("sft", "SFT packs its own sequences"),
                      ("fim_data", "FIM rewrites documents into fixed-length samples"),
                      ("mock_data", "Zeppelin samples whole documents of an indexed dataset")):
        if _flag(args, name, False):
            raise ConfigError(f"--zeppelin conflicts with --{name.replace('_', '-')} ({why}); drop it"
                              + (" and pass --data-path PREFIX" if name == "mock_data" else ""))


def _resolve_megatron_aliases(args: argparse.Namespace) -> None:
    """Megatron-LM's own name for the per-rank token cap: ``--max-seqlen-per-dp-cp-rank``
    (what ``--hybrid-context-parallel`` packs each rank up to) means what
    ``--zeppelin-tokens-per-gpu`` means, so either flag sets it; both with different
    values is refused."""
    megatron_cap = getattr(args, "max_seqlen_per_dp_cp_rank", None)
    if megatron_cap is None:
        return
    ours = getattr(args, "zeppelin_tokens_per_gpu", None)
    if ours is None:
        args.zeppelin_tokens_per_gpu = megatron_cap
    elif ours != megatron_cap:
        raise ConfigError(f"--max-seqlen-per-dp-cp-rank {megatron_cap} and --zeppelin-tokens-per-gpu {ours} "
                          "both set the per-rank token cap; pass one of them")


#: Megatron-LM features ``--zeppelin`` cannot honour, refused before anything is built:
#: (attribute, flag, is it on?, why).  Each is a "refused" row of docs/compatibility.md.
SHAPES_CHANGE = "per-rank token counts change every step"
UNSUPPORTED: tuple[tuple[str, str, Callable[[object], bool], str], ...] = (
    ("rampup_batch_size", "--rampup-batch-size", bool,
     "a ramp changes the micro-batches per step mid-run, and a Zeppelin checkpoint records the sampler's "
     "position per global batch; warm up with --lr-warmup-iters instead"),
    ("fp8", "--fp8-format", lambda v: v is not None,
     "Zeppelin's attention kernels and ring transfers run in bf16/fp16/fp32, and per-rank token counts are "
     "not multiples of 16; train in --bf16"),
    ("fp8_param_gather", "--fp8-param-gather", bool, "it needs fp8 training"),
    ("fp4", "--fp4-format", lambda v: v is not None, "Zeppelin's kernels run in bf16/fp16/fp32"),
    ("tp_comm_overlap", "--tp-comm-overlap", bool,
     f"TransformerEngine's userbuffers are sized for --seq-length x --micro-batch-size tokens, and {SHAPES_CHANGE}"),
    ("enable_cuda_graph", "--enable-cuda-graph", bool, f"a CUDA graph replays fixed shapes, {SHAPES_CHANGE}"),
    ("external_cuda_graph", "--external-cuda-graph", bool, f"a CUDA graph replays fixed shapes, {SHAPES_CHANGE}"),
    ("cuda_graph_impl", "--cuda-graph-impl", lambda v: v not in (None, "none"),
     f"a CUDA graph replays fixed shapes, {SHAPES_CHANGE}"),
    ("window_size", "--window-size", lambda v: v is not None,
     "Zeppelin's attention is full causal attention inside each document"),
    ("softmax_type", "--softmax-type", lambda v: v not in (None, "vanilla"),
     "Zeppelin's attention kernels compute the vanilla softmax"),
    ("multi_latent_attention", "--multi-latent-attention", bool,
     "Zeppelin's layer spec builds standard (grouped-query) attention"),
    ("experimental_attention_variant", "--experimental-attention-variant", lambda v: v is not None,
     "Zeppelin's layer spec builds standard attention"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path", lambda v: v is not None,
     "Zeppelin's layer spec builds one layer type"),
    ("mtp_num_layers", "--mtp-num-layers", bool, "multi-token-prediction layers are not Zeppelin layers"),
    ("eod_mask_loss", "--eod-mask-loss", bool,
     "Zeppelin trains on whole documents, never across an end-of-document token, and would ignore it"),
    ("phase_transition_iterations", "--phase-transition-iterations", bool,
     "it changes the global batch between phases, and a Zeppelin checkpoint records the sampler's "
     "position per global batch"),
    ("full_validation", "--full-validation", bool,
     "Zeppelin's validation loader has no fixed length; use --eval-iters"),
    ("multiple_validation_sets", "--multiple-validation-sets", bool,
     "Zeppelin validates on the documents --split gives the validation split"),
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm", bool,
     "it overlaps two micro-batches of equal shape"),
)


def _check_unsupported_features(args: argparse.Namespace) -> None:
    for name, flag, is_on, why in UNSUPPORTED:
        if is_on(getattr(args, name, None)):
            raise ConfigError(f"--zeppelin does not support {flag} ({why}); drop {flag}")


def _check_model_parallel(args: argparse.Namespace) -> None:
    """A TP group stays inside one node and takes whole heads and KV heads; experts
    divide over the expert-parallel ranks.  Megatron-Core would stop on the last
    ones with an assert deep inside model or process-group building.  At
    core_v0.16.1 this runs before Megatron's ``validate_args``, so
    ``--num-query-groups`` counts only with ``--group-query-attention``."""
    gpus_per_node = load_cluster(args.zeppelin_cluster).topology.gpus_per_node
    tp = _flag(args, "tensor_model_parallel_size", 1)
    if gpus_per_node % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the {gpus_per_node} GPUs per node "
                          f"of --zeppelin-cluster {args.zeppelin_cluster}; a TP group must stay inside one node")
    heads = _flag(args, "num_attention_heads", None)
    kv_heads = _flag(args, "num_query_groups", None) if _flag(args, "group_query_attention", False) else heads
    for what, n in (("--num-attention-heads", heads), ("--num-query-groups (KV heads)", kv_heads)):
        if n and n % tp:
            raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide {what} {n}: each TP rank "
                              f"takes whole heads; pick a TP size that divides {n}")
    experts, ep = _flag(args, "num_experts", None), _flag(args, "expert_model_parallel_size", 1)
    if experts and experts % ep:
        raise ConfigError(f"--num-experts {experts} does not divide over --expert-model-parallel-size {ep} "
                          f"ranks: each rank holds the same number of whole experts; pick an EP size that "
                          f"divides {experts}")
    world = getattr(args, "world_size", None)
    etp = _flag(args, "expert_tensor_parallel_size", tp)
    if experts and world and world % (ep * etp):
        raise ConfigError(f"--expert-model-parallel-size {ep} x expert TP {etp} does not divide the {world} "
                          "ranks: Megatron spreads the experts over groups of that many ranks; pick an EP "
                          f"size that divides {world // etp if world % etp == 0 else 'the rank count'}")


def _check_moe(args: argparse.Namespace) -> None:
    """MoE options whose result would depend on which tokens the plan puts on a rank."""
    if not _flag(args, "num_experts", None):
        return
    if _flag(args, "moe_expert_capacity_factor", None) is not None:
        raise ConfigError("--zeppelin with MoE conflicts with --moe-expert-capacity-factor: which tokens an "
                          "expert drops would depend on which tokens the plan puts on a rank; drop the flag "
                          "(no token dropping)")
    balancing = _flag(args, "moe_router_load_balancing_type", "none")
    balancing = balancing if isinstance(balancing, list) else [balancing]
    coeffs = _flag(args, "moe_aux_loss_coeff", 0.0)
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs]
    if any(t != "none" and c for t, c in zip(balancing, coeffs * len(balancing))):
        raise ConfigError(f"--zeppelin with MoE needs --moe-aux-loss-coeff 0 or --moe-router-load-balancing-type "
                          f"none (got {' '.join(balancing)} with coefficient {' '.join(map(str, coeffs))}): the "
                          "balancing loss is taken over the tokens on a rank, which the plan decides, so "
                          "gradients would differ from data parallelism's")
    if _flag(args, "moe_z_loss_coeff", None):
        raise ConfigError(f"--zeppelin with MoE conflicts with --moe-z-loss-coeff {args.moe_z_loss_coeff}: the "
                          "z-loss is averaged over the tokens on a rank, which the plan decides; drop the flag")


def _check_batch_shape(args: argparse.Namespace) -> None:
    mbs = _flag(args, "micro_batch_size", 1)
    if mbs != 1:
        raise ConfigError(f"--zeppelin needs --micro-batch-size 1 (got {mbs}): Zeppelin's global batch is "
                          "a token budget (--zeppelin-tokens-per-gpu x data-parallel size) delivered "
                          "as one packed micro-batch per rank, not a count of fixed-length samples")
    dp = data_parallel_size(args)
    gbs = getattr(args, "global_batch_size", None)
    if gbs is not None and dp is not None and (gbs < dp or gbs % dp):
        raise ConfigError(f"--zeppelin runs N packed micro-batches per rank per step: --global-batch-size "
                          f"must be N x the data-parallel size {dp} (got {gbs}); the global batch in "
                          "tokens is N x --zeppelin-batch-fill x --zeppelin-tokens-per-gpu x data-parallel size")
    if not _flag(args, "calculate_per_token_loss", False):
        raise ConfigError("--zeppelin needs --calculate-per-token-loss: ranks hold different token "
                          "counts, so the loss must be the mean over every token of the global batch")
    if _flag(args, "dataloader_type", "external") != "external":
        raise ConfigError(f"--zeppelin feeds Megatron through its own loader; pass --dataloader-type "
                          f"external (got {args.dataloader_type})")
    seq = getattr(args, "seq_length", None)
    tpg = getattr(args, "zeppelin_tokens_per_gpu", None)
    if tpg is None:
        raise ConfigError("--zeppelin needs --zeppelin-tokens-per-gpu (or Megatron's --max-seqlen-per-dp-cp-rank): "
                          "the per-rank token budget, e.g. 2x --seq-length")
    if seq is None:
        raise ConfigError("--zeppelin needs --seq-length: the longest piece a document is cut into")
    if tpg < 1:
        raise ConfigError(f"--zeppelin-tokens-per-gpu must be >= 1, got {tpg}")
    if dp is not None and seq > tpg * dp:
        raise ConfigError(f"--seq-length {seq} is longer than the cluster can hold: the longest piece is "
                          f"placed on at most the {dp} data-parallel ranks x --zeppelin-tokens-per-gpu "
                          f"{tpg} = {tpg * dp} tokens; raise --zeppelin-tokens-per-gpu to at least "
                          f"{-(-seq // dp)} or lower --seq-length")


def _check_numbers(args: argparse.Namespace) -> None:
    """Every size and limit the checks below divide by or compare with is a
    number in range (a TP size of 0 was a ZeroDivisionError; a NaN limit passed)."""
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "num_attention_heads",
                 "num_query_groups", "num_experts", "seq_length", "zeppelin_tokens_per_gpu", "micro_batch_size",
                 "global_batch_size"):
        if getattr(args, name, None) is not None:
            check_int(getattr(args, name), "--" + name.replace("_", "-"), minimum=1)
    check_int(args.zeppelin_log_interval, "--zeppelin-log-interval", minimum=0)
    check_float(args.zeppelin_batch_fill, "--zeppelin-batch-fill", positive=True, maximum=1)
    check_float(args.zeppelin_planner_time_limit, "--zeppelin-planner-time-limit", positive=True)
    if args.zeppelin_plan_dump_dir is not None:
        check_output_dir(args.zeppelin_plan_dump_dir, "--zeppelin-plan-dump-dir")


def _check_zeppelin_values(args: argparse.Namespace) -> None:
    if args.zeppelin_log_interval < 0:
        raise ConfigError(f"--zeppelin-log-interval must be >= 0, got {args.zeppelin_log_interval}")
    if not 0 < args.zeppelin_batch_fill <= 1:
        raise ConfigError(f"--zeppelin-batch-fill must be in (0, 1], got {args.zeppelin_batch_fill}")
    if args.zeppelin_planner_time_limit <= 0:
        raise ConfigError("--zeppelin-planner-time-limit must be > 0 seconds")
    if args.zeppelin_data_lengths is not None and not Path(args.zeppelin_data_lengths).is_file():
        raise ConfigError(f"--zeppelin-data-lengths {args.zeppelin_data_lengths!r} does not exist; pass a "
                          ".npy or text file of document lengths, or drop the flag")
    if not getattr(args, "data_path", None):
        raise ConfigError("--zeppelin needs --data-path: Megatron indexed datasets (PREFIX with "
                          "PREFIX.bin and PREFIX.idx) of whole documents, split by --split "
                          "(per-split --train-data-path etc. are not supported)")
