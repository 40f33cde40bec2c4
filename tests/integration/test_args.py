"""--zeppelin-* flags: parsing, composition with Megatron's provider, validation errors."""

import argparse

import pytest

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.integration import (
    SPEC,
    add_zeppelin_args,
    chain_args_providers,
    check_args,
    print_help_if_asked,
    validate_zeppelin_args,
)
from megatron_zeppelin.integration.args import DEFAULTS, data_parallel_size, zeppelin_micro_batches
from megatron_zeppelin.planner.base import PLANNERS


def parse(argv):
    return add_zeppelin_args(argparse.ArgumentParser()).parse_args(argv)


def megatron_args(**overrides):
    """A namespace as Megatron-LM leaves it after parsing a valid --zeppelin command (8 ranks, TP 2)."""
    ns = parse(["--zeppelin", "--zeppelin-tokens-per-gpu", "4096", "--zeppelin-cluster", "cpu-sim"])
    megatron = dict(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                    context_parallel_size=1, hybrid_context_parallel=False, sequence_parallel=False,
                    num_experts=None, use_legacy_models=False, sft=False, fim_data=False, mock_data=False,
                    micro_batch_size=1, global_batch_size=4, calculate_per_token_loss=True,
                    dataloader_type="external", seq_length=8192, spec=list(SPEC), attention_dropout=0.0,
                    apply_rope_fusion=False, transformer_impl="local", normalization="RMSNorm",
                    data_path=["data/docs_text_document"])
    megatron.update(overrides)
    for k, v in megatron.items():
        setattr(ns, k, v)
    return ns


def test_defaults_and_values():
    ns = parse([])
    assert ns.zeppelin is False
    assert {k: getattr(ns, k) for k in DEFAULTS} == DEFAULTS
    ns = parse(["--zeppelin", "--zeppelin-planner", "flexsp", "--zeppelin-tokens-per-gpu", "65536",
                "--zeppelin-routing", "off", "--zeppelin-remap", "off", "--zeppelin-log-interval", "5",
                "--zeppelin-plan-dump-dir", "plans", "--zeppelin-backend", "torch"])
    assert (ns.zeppelin, ns.zeppelin_planner, ns.zeppelin_tokens_per_gpu, ns.zeppelin_routing,
            ns.zeppelin_remap, ns.zeppelin_log_interval, ns.zeppelin_plan_dump_dir, ns.zeppelin_backend) == \
        (True, "flexsp", 65536, "off", "off", 5, "plans", "torch")


@pytest.mark.parametrize("argv", [["--zeppelin-planner", "ring"], ["--zeppelin-routing", "yes"],
                                  ["--zeppelin-tokens-per-gpu", "lots"], ["--zeppelin-backend", "cudnn"],
                                  ["--zeppelin-ring-grad-dtype", "bf16"]])
def test_bad_values_rejected_by_argparse(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_planner_choices_are_the_registry():
    action = next(a for a in add_zeppelin_args(argparse.ArgumentParser())._actions
                  if a.dest == "zeppelin_planner")
    assert list(action.choices) == list(PLANNERS)


def test_chain_keeps_both_providers_in_order():
    calls = []

    def other(parser):
        calls.append("other")
        parser.add_argument("--modelopt-flag", action="store_true")
        return parser

    parser = chain_args_providers(other, None, add_zeppelin_args)(argparse.ArgumentParser())
    ns = parser.parse_args(["--modelopt-flag", "--zeppelin"])
    assert calls == ["other"] and ns.modelopt_flag and ns.zeppelin
    assert chain_args_providers(None)(parser) is parser


def test_valid_namespace_passes():
    ns = megatron_args()
    assert validate_zeppelin_args(ns) is ns
    assert data_parallel_size(ns) == 4


def test_pipeline_parallel_passes():
    """PP 2 x TP 2 x DP 2 on 8 ranks, 2 micro-batches per global batch (one per stage)."""
    ns = megatron_args(pipeline_model_parallel_size=2, num_layers=4)
    assert validate_zeppelin_args(ns) is ns
    assert data_parallel_size(ns) == 2


@pytest.mark.parametrize("overrides, words", [
    ({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1},
     ["--pipeline-model-parallel-size 2", "drop --num-layers-per-virtual-pipeline-stage"]),
    ({"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 1, "world_size": 6, "global_batch_size": 6},
     ["stages of 3 ranks, neither whole nodes of 2 GPUs"]),
    ({"pipeline_model_parallel_size": 2, "num_layers": 3},
     ["--pipeline-model-parallel-size 2 does not divide --num-layers 3"]),
    ({"pipeline_model_parallel_size": 2, "global_batch_size": 2},
     ["= 1 micro-batches is fewer than the 2 pipeline stages"]),
    ({"pipeline_model_parallel_size": 2, "zeppelin_planner": "flexsp"}, ["--zeppelin-planner flexsp", "deadlock"]),
    ({"pipeline_model_parallel_size": 2, "num_experts": 8}, ["--pipeline-model-parallel-size 2 and MoE",
                                                             "--moe-token-dispatcher-type alltoall"]),
    ({"context_parallel_size": 2}, ["--context-parallel-size 2", "drop --context-parallel-size"]),
    ({"hybrid_context_parallel": True}, ["--hybrid-context-parallel", "megatron_hybrid_cp"]),
    ({"num_experts": 8, "moe_expert_capacity_factor": 1.0}, ["--moe-expert-capacity-factor", "no token dropping"]),
    ({"num_experts": 8, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01},
     ["--moe-aux-loss-coeff 0", "aux_loss with coefficient 0.01"]),
    ({"num_experts": 8, "moe_router_load_balancing_type": ["seq_aux_loss"], "moe_aux_loss_coeff": [0.1]},
     ["--moe-router-load-balancing-type none", "seq_aux_loss"]),
    ({"num_experts": 8, "moe_z_loss_coeff": 0.001}, ["--moe-z-loss-coeff 0.001"]),
    ({"tensor_model_parallel_size": 1, "sequence_parallel": True},
     ["--sequence-parallel", "--tensor-model-parallel-size > 1"]),
    ({"tensor_model_parallel_size": 4, "zeppelin_cluster": "cpu-sim"},
     ["--tensor-model-parallel-size 4 does not divide the 2 GPUs per node", "cpu-sim"]),
    ({"num_attention_heads": 3}, ["--tensor-model-parallel-size 2 does not divide --num-attention-heads 3"]),
    ({"num_attention_heads": 4, "group_query_attention": True, "num_query_groups": 1},
     ["--tensor-model-parallel-size 2 does not divide --num-query-groups (KV heads) 1"]),
    ({"num_experts": 6, "expert_model_parallel_size": 4},
     ["--num-experts 6 does not divide over --expert-model-parallel-size 4"]),
    ({"num_experts": 6, "expert_model_parallel_size": 3},
     ["--expert-model-parallel-size 3 x expert TP 2 does not divide the 8 ranks", "divides 4"]),
    ({"mock_data": True}, ["--mock-data", "--data-path"]),
    ({"sft": True}, ["--sft"]),
    ({"micro_batch_size": 2}, ["--micro-batch-size 1", "token budget"]),
    ({"global_batch_size": 6}, ["--global-batch-size", "N x the data-parallel size 4 (got 6)"]),
    ({"global_batch_size": 2}, ["--global-batch-size", "N x the data-parallel size 4 (got 2)"]),
    ({"calculate_per_token_loss": False}, ["--calculate-per-token-loss"]),
    ({"dataloader_type": "single"}, ["--dataloader-type external"]),
    ({"zeppelin_tokens_per_gpu": None}, ["--zeppelin-tokens-per-gpu"]),
    ({"seq_length": None}, ["--seq-length"]),
    ({"seq_length": 4 * 4096 + 1}, ["--seq-length 16385", "at least 4097"]),
    ({"spec": None}, ["no --spec", " ".join(SPEC)]),
    ({"spec": ["local"]}, ["--spec local"]),
    ({"attention_dropout": 0.1}, ["--attention-dropout 0"]),
    ({"attention_backend": "AttnBackend.local"}, ["--attention-backend local"]),
    ({"apply_rope_fusion": True}, ["--no-rope-fusion"]),
    ({"normalization": "LayerNorm"}, ["--normalization RMSNorm"]),
    ({"persist_layer_norm": True}, ["--no-persist-layer-norm"]),
    ({"zeppelin_log_interval": -1}, ["--zeppelin-log-interval"]),
    ({"zeppelin_cluster": "h100-8x400"}, ["h100-8x400g"]),
    ({"zeppelin_data_lengths": "/nonexistent/lengths.npy"}, ["--zeppelin-data-lengths"]),
    ({"data_path": None}, ["--data-path"]),
])
def test_conflicts_name_the_flag_and_fix(overrides, words):
    with pytest.raises(ConfigError) as exc:
        validate_zeppelin_args(megatron_args(**overrides))
    for word in words:
        assert word in str(exc.value)


@pytest.mark.parametrize("overrides, message", [
    ({"tensor_model_parallel_size": 0}, "--tensor-model-parallel-size must be >= 1, got 0"),   # was ZeroDivisionError
    ({"expert_model_parallel_size": 0, "num_experts": 8}, "--expert-model-parallel-size must be >= 1, got 0"),
    ({"zeppelin_planner_time_limit": float("nan")}, "--zeppelin-planner-time-limit must be a finite number, got nan"),
    ({"zeppelin_planner_time_limit": float("inf")}, "--zeppelin-planner-time-limit must be a finite number, got inf"),
    ({"zeppelin_batch_fill": float("nan")}, "--zeppelin-batch-fill must be a finite number, got nan"),
    ({"seq_length": 0}, "--seq-length must be >= 1, got 0"),
    ({"seq_length": -4096}, "--seq-length must be >= 1, got -4096"),
    ({"zeppelin_tokens_per_gpu": 0}, "--zeppelin-tokens-per-gpu must be >= 1, got 0"),
    ({"zeppelin_plan_dump_dir": "/proc/zeppelin-plans"}, "--zeppelin-plan-dump-dir '/proc/zeppelin-plans' cannot be "
                                                         "written"),
])
def test_every_bad_value_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError) as exc:
        validate_zeppelin_args(megatron_args(**overrides))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_moe_without_token_dropping_is_accepted():
    validate_zeppelin_args(megatron_args(num_experts=8))
    # Megatron-LM's defaults: the aux_loss balancing type with coefficient 0 adds nothing.
    validate_zeppelin_args(megatron_args(num_experts=8, moe_router_load_balancing_type="aux_loss",
                                         moe_aux_loss_coeff=0.0))


def test_model_parallel_sizes_that_divide_are_accepted():
    # --num-query-groups counts only with --group-query-attention (Megatron ignores it otherwise).
    validate_zeppelin_args(megatron_args(num_attention_heads=4, num_query_groups=1))
    validate_zeppelin_args(megatron_args(num_experts=8, expert_model_parallel_size=4))


def test_sequence_parallel_is_accepted():
    # The loaders pad each rank's buffer to a multiple of TP (tests/integration/test_loaders_dist.py).
    validate_zeppelin_args(megatron_args(sequence_parallel=True))


def test_global_batch_size_maps_to_micro_batches():
    # 8 ranks / TP 2 = 4 data-parallel ranks: --global-batch-size 12 is 3 micro-batches per rank.
    for gbs, micro in ((4, 1), (12, 3), (64, 16)):
        args = validate_zeppelin_args(megatron_args(global_batch_size=gbs))
        assert zeppelin_micro_batches(args) == micro


def test_longest_piece_may_span_every_rank():
    # 4 data-parallel ranks x 4096 tokens: a 16384-token piece fits on a 4-rank ring.
    validate_zeppelin_args(megatron_args(seq_length=4 * 4096))


def test_flags_without_zeppelin_are_an_error():
    ns = parse(["--zeppelin-planner", "te_cp"])
    with pytest.raises(ConfigError, match="--zeppelin-planner has no effect without --zeppelin"):
        validate_zeppelin_args(ns)
    plain = parse([])
    assert validate_zeppelin_args(plain) is plain


def test_check_args_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        check_args(megatron_args(micro_batch_size=4))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pretrain_gpt.py: error: --zeppelin needs --micro-batch-size 1")


def test_help_passthrough_only_on_help():
    print_help_if_asked(add_zeppelin_args, argv=["--zeppelin"])  # returns: nothing to answer


def test_help_escapes_bare_percent_only():
    from megatron_zeppelin.integration.args import escape_help_percent

    parser = argparse.ArgumentParser()
    parser.add_argument("--a", default=3, help="headroom (e.g. 1.10 = 10%)")
    parser.add_argument("--b", default=4, help="kept: 50%% and %(default)s")
    text = escape_help_percent(parser).format_help()
    assert "10%)" in text and "kept: 50% and 4" in text


@pytest.mark.parametrize("overrides, flag", [
    (dict(rampup_batch_size=["4", "4", "100"]), "--rampup-batch-size"),
    (dict(fp8="hybrid"), "--fp8-format"),
    (dict(fp8_param_gather=True), "--fp8-param-gather"),
    (dict(fp4="nvfp4"), "--fp4-format"),
    (dict(tp_comm_overlap=True), "--tp-comm-overlap"),
    (dict(enable_cuda_graph=True), "--enable-cuda-graph"),
    (dict(external_cuda_graph=True), "--external-cuda-graph"),
    (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl"),
    (dict(window_size=(128, 0)), "--window-size"),
    (dict(softmax_type="learnable"), "--softmax-type"),
    (dict(multi_latent_attention=True), "--multi-latent-attention"),
    (dict(experimental_attention_variant="gated_delta_net"), "--experimental-attention-variant"),
    (dict(heterogeneous_layers_config_path="layers.json"), "--heterogeneous-layers-config-path"),
    (dict(mtp_num_layers=1), "--mtp-num-layers"),
    (dict(eod_mask_loss=True), "--eod-mask-loss"),
    (dict(phase_transition_iterations=[10]), "--phase-transition-iterations"),
    (dict(full_validation=True), "--full-validation"),
    (dict(multiple_validation_sets=True), "--multiple-validation-sets"),
    (dict(overlap_moe_expert_parallel_comm=True), "--overlap-moe-expert-parallel-comm"),
])
def test_unsupported_megatron_features_are_refused(overrides, flag):
    with pytest.raises(ConfigError, match=f"^--zeppelin does not support {flag} .*; drop {flag}$"):
        validate_zeppelin_args(megatron_args(**overrides))


def test_defaults_of_the_unsupported_features_pass():
    validate_zeppelin_args(megatron_args(rampup_batch_size=None, fp8=None, fp4=None, tp_comm_overlap=False,
                                         cuda_graph_impl="none", softmax_type="vanilla", window_size=None,
                                         mtp_num_layers=None, phase_transition_iterations=None))


def test_max_seqlen_per_dp_cp_rank_is_the_token_cap():
    args = megatron_args(max_seqlen_per_dp_cp_rank=2048)
    args.zeppelin_tokens_per_gpu = None
    assert validate_zeppelin_args(args).zeppelin_tokens_per_gpu == 2048
    assert validate_zeppelin_args(megatron_args(max_seqlen_per_dp_cp_rank=4096)).zeppelin_tokens_per_gpu == 4096
    with pytest.raises(ConfigError, match="--max-seqlen-per-dp-cp-rank 2048 and --zeppelin-tokens-per-gpu 4096"):
        validate_zeppelin_args(megatron_args(max_seqlen_per_dp_cp_rank=2048))


def test_messages_from_shared_code_name_pretrain_gpt_flags():
    from megatron_zeppelin.integration.args import megatron_terms

    assert megatron_terms("lanes did not complete within --timeout 600 s: a peer stopped") == \
        "lanes did not complete within --distributed-timeout-minutes (10 min): a peer stopped"
    assert megatron_terms("raise --tokens-per-gpu or lower --max-seq-len; --zeppelin-tokens-per-gpu stays") == \
        "raise --zeppelin-tokens-per-gpu or lower --seq-length; --zeppelin-tokens-per-gpu stays"
    assert megatron_terms("use fewer micro-batches (--micro-batches; --global-batch-size / DP under --zeppelin)") == \
        "use fewer micro-batches (--global-batch-size / data-parallel size)"
    assert megatron_terms("pass use_te=False for local modules") == "pass --transformer-impl local for local modules"


def test_a_zeppelin_error_that_ends_a_run_is_one_line(capsys, monkeypatch):
    import sys

    from megatron_zeppelin.errors import InfeasibleError
    from megatron_zeppelin.integration.args import report_zeppelin_errors_in_one_line

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    report_zeppelin_errors_in_one_line()
    sys.excepthook(InfeasibleError, InfeasibleError("no plan; raise --tokens-per-gpu"), None)
    assert capsys.readouterr().err == "pretrain_gpt.py: error: no plan; raise --zeppelin-tokens-per-gpu\n"


def test_the_last_complete_checkpoint_is_named(tmp_path):
    from megatron_zeppelin.integration.args import last_checkpoint

    assert last_checkpoint(None) == ""
    assert last_checkpoint(str(tmp_path)) == f"; no complete checkpoint in --save {tmp_path}"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20\n")
    assert last_checkpoint(str(tmp_path)) == (f"; the last complete checkpoint, iteration 20 in --save {tmp_path}, "
                                              f"stays loadable: resume with --load {tmp_path}")


def test_a_communication_deadline_names_the_megatron_flag(capsys, monkeypatch):
    import sys

    from megatron_zeppelin.comm.deadline import CommTimeoutError
    from megatron_zeppelin.integration.args import report_zeppelin_errors_in_one_line

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    report_zeppelin_errors_in_one_line()
    error = CommTimeoutError("rank 1: receiving op 3 did not complete within --timeout 600 s: a peer stalled")
    sys.excepthook(CommTimeoutError, error, None)
    assert capsys.readouterr().err == ("pretrain_gpt.py: error: rank 1: receiving op 3 did not complete within "
                                       "--distributed-timeout-minutes (10 min): a peer stalled\n")
