"""Launch presets: 1:1 YAML mapping, clear errors, golden-file rendering, the CLI."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.integration import SPEC, add_zeppelin_args, validate_zeppelin_args
from megatron_zeppelin.launch import format_command, load_launch_preset, pretrain_args, render_command
from megatron_zeppelin.launch.preset import check_model_fits
from megatron_zeppelin.launch.__main__ import main
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.presets import preset_names

GOLDEN = Path(__file__).parent / "golden"
PRESETS = preset_names("presets")
MINIMAL = "model: tiny\ncluster: cpu-sim\nnodes: 2\ngpus_per_node: 2\nseq_length: 512\ntokens_per_gpu: 1024\n" \
          "train_iters: 5\ndata_path: [d]\ntokenizer_type: NullTokenizer\n"


def rendered(name):
    p = load_launch_preset(name)
    return format_command(render_command(p, load_model(p.model))) + "\n"


def test_bundled_presets_exist():
    assert {"tiny-cpu", "llama-7b-128k-h100-8x8", "llama-13b-tp2-64k-h100-8x8",
            "llama-3b-64k-a800-4x200g"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_golden_rendering(name):
    golden = GOLDEN / f"{name}.txt"
    text = rendered(name)
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.is_file(), f"no golden file for preset {name}; run with UPDATE_GOLDEN=1 and review it"
    assert text == golden.read_text()


@pytest.mark.parametrize("name", PRESETS)
def test_rendered_zeppelin_flags_validate(name):
    """The rendered command passes Zeppelin's checks (Megatron's flags parsed minimally)."""
    p = load_launch_preset(name)
    argv = pretrain_args(p, load_model(p.model))
    parser = add_zeppelin_args(__import__("argparse").ArgumentParser())
    for flag, kind in (("--tensor-model-parallel-size", int), ("--pipeline-model-parallel-size", int),
                       ("--micro-batch-size", int), ("--global-batch-size", int), ("--seq-length", int),
                       ("--dataloader-type", str), ("--attention-dropout", float),
                       ("--transformer-impl", str), ("--normalization", str)):
        parser.add_argument(flag, type=kind)
    for flag in ("--calculate-per-token-loss", "--no-rope-fusion", "--no-persist-layer-norm"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--spec", nargs="*")
    parser.add_argument("--data-path", nargs="*")
    ns, _ = parser.parse_known_args(argv)
    ns.world_size = p.world_size
    ns.apply_rope_fusion, ns.persist_layer_norm = not ns.no_rope_fusion, not ns.no_persist_layer_norm
    validate_zeppelin_args(ns)
    assert tuple(ns.spec) == SPEC and ns.global_batch_size == p.micro_batches * p.data_parallel_size
    assert ns.pipeline_model_parallel_size == p.pipeline_parallel


def test_tensor_parallel_preset_shrinks_the_global_batch():
    p = load_launch_preset("llama-13b-tp2-64k-h100-8x8")
    argv = pretrain_args(p, load_model(p.model))
    assert argv[argv.index("--global-batch-size") + 1] == "32"
    assert argv[argv.index("--tensor-model-parallel-size") + 1] == "2"


def test_pipeline_preset_renders_its_stages_and_micro_batches():
    """llama-70b PP 2 x TP 4 on 64 GPUs: 8 data-parallel ranks, 4 micro-batches each,
    and the per-iteration report every 50 steps as without PP (its sums run after 1F1B)."""
    p = load_launch_preset("llama-70b-128k-pp2-h200-8x8")
    argv = pretrain_args(p, load_model(p.model))
    flag = {f: argv[argv.index(f) + 1] for f in ("--pipeline-model-parallel-size", "--tensor-model-parallel-size",
                                                 "--global-batch-size", "--zeppelin-log-interval")}
    assert flag == {"--pipeline-model-parallel-size": "2", "--tensor-model-parallel-size": "4",
                    "--global-batch-size": "32", "--zeppelin-log-interval": "50"}
    assert p.data_parallel_size == 8
    plain = pretrain_args(load_launch_preset("llama-7b-128k-h100-8x8"), load_model("llama-7b"))
    assert plain[plain.index("--pipeline-model-parallel-size") + 1] == "1"


@pytest.mark.parametrize("extra, message", [
    ("pipeline_parallel: 4\nmicro_batches: 4\n", "pipeline_parallel 4 does not divide the model's 2 layers"),
    ("pipeline_parallel: 2\n", "micro_batches 1 is fewer than the 2 pipeline stages"),
    ("pipeline_parallel: 2\nmicro_batches: 2\nvirtual_pipeline_stages: 2\n",
     "runs the non-interleaved 1F1B schedule only"),
    ("virtual_pipeline_stages: 2\n", "virtual_pipeline_stages 2 interleaves pipeline stages, and pipeline_parallel is 1"),
    ("pipeline_parallel: 2\nmicro_batches: 2\nplanner: flexsp\n", "planner flexsp plans on one rank"),
])
def test_pipeline_combinations_the_engine_path_refuses(tmp_path, extra, message):
    """Each bad combination is one line naming the preset key, before anything launches
    (the checks are pretrain_gpt.py --zeppelin's own, integration/args.py)."""
    p = load_launch_preset(write(tmp_path, MINIMAL + extra))
    with pytest.raises(ConfigError, match=message) as info:
        check_model_fits(p, load_model(p.model))
    assert "\n" not in str(info.value) and str(info.value).startswith("preset p: ")


def test_a_moe_preset_under_pp_is_checked_with_the_dispatcher_it_renders(tmp_path):
    """Expert parallelism renders the all-to-all dispatcher, which PP takes; EP 1
    renders all-gather, which pretrain_gpt.py refuses under PP (the launcher's check
    once assumed all-gather for every MoE model and refused both)."""
    moe = (Path(__file__).parents[2] / "configs" / "models" / "tiny-moe.yaml").read_text()
    write(tmp_path, moe + "expert_parallel_size: 2\n", name="moe-ep2.yaml")
    for model, refused in (("tiny-moe", True), (str(tmp_path / "moe-ep2.yaml"), False)):
        p = load_launch_preset(write(tmp_path, MINIMAL.replace("model: tiny", f"model: {model}")
                                     + "pipeline_parallel: 2\nmicro_batches: 2\n"))
        m = load_model(p.model)
        argv = pretrain_args(p, m)
        dispatcher = argv[argv.index("--moe-token-dispatcher-type") + 1]
        assert dispatcher == ("allgather" if refused else "alltoall")
        if refused:
            with pytest.raises(ConfigError, match="needs --moe-token-dispatcher-type alltoall"):
                check_model_fits(p, m)
        else:
            check_model_fits(p, m)


def test_pipeline_preset_values_are_checked_on_load(tmp_path):
    with pytest.raises(ConfigError, match="tensor_parallel 2 x pipeline_parallel 4 does not divide the 4 GPUs"):
        load_launch_preset(write(tmp_path, MINIMAL + "tensor_parallel: 2\npipeline_parallel: 4\n"))
    with pytest.raises(ConfigError, match="micro_batches"):
        load_launch_preset(write(tmp_path, MINIMAL + "micro_batches: 0\n"))


def test_cli_refuses_a_bad_pipeline_preset_in_one_line(tmp_path):
    path = write(tmp_path, MINIMAL + "pipeline_parallel: 2\n")
    r = subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", str(path), "--print-args"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "raise micro_batches" in r.stderr, r.stderr


def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_unknown_and_missing_keys_are_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'tokens_per_gpus' \\(did you mean 'tokens_per_gpu'\\?\\)"):
        load_launch_preset(write(tmp_path, MINIMAL + "tokens_per_gpus: 4\n"))
    with pytest.raises(ConfigError, match="missing key 'train_iters'"):
        load_launch_preset(write(tmp_path, MINIMAL.replace("train_iters: 5\n", "")))
    assert load_launch_preset(write(tmp_path, MINIMAL)).name == "p"


@pytest.mark.parametrize("extra, match", [
    ("tensor_parallel: 3\n", "tensor_parallel 3 must divide gpus_per_node 2"),
    ("seq_length: 5000\n", "seq_length 5000 is longer"),
    ("planner: ring\n", "planner 'ring'"),
    ("recompute: some\n", "recompute 'some'"),
    ("ring_grad_dtype: bf16\n", "ring_grad_dtype 'bf16' is not one of model, fp32"),
    ("tokenizer_type: HuggingFaceTokenizer\n", "needs tokenizer_model"),
    ("data_path: []\n", "data_path is empty"),
])
def test_inconsistent_values(tmp_path, extra, match):
    text = "\n".join(line for line in MINIMAL.splitlines() if not line.startswith(extra.split(":")[0] + ":"))
    with pytest.raises(ConfigError, match=match):
        load_launch_preset(write(tmp_path, text + "\n" + extra))


def test_moe_model_renders_its_experts(tmp_path):
    """A preset on an MoE model launches an MoE model: experts, top-k, expert width and
    EP rendered from the model preset, no balancing loss, and --zeppelin accepts them."""
    p = load_launch_preset(write(tmp_path, MINIMAL.replace("model: tiny", "model: tiny-moe")))
    argv = pretrain_args(p, load_model(p.model))
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--moe-") or
             argv[i] in ("--num-experts", "--expert-model-parallel-size")}
    assert flags == {"--num-experts": "4", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "64",
                     "--moe-router-load-balancing-type": "none", "--expert-model-parallel-size": "1",
                     "--moe-token-dispatcher-type": "allgather"}
    assert "--num-experts" not in pretrain_args(load_launch_preset("tiny-cpu"), load_model("tiny"))


@pytest.mark.parametrize("model_text, extra, message", [
    ("hidden_size: 96\nnum_attention_heads: 6\nnum_query_groups: 6\n", "gpus_per_node: 4\ntensor_parallel: 4\n",
     "tensor_parallel 4 does not divide model m's 6 heads"),
    ("num_query_groups: 1\n", "tensor_parallel: 2\n", "tensor_parallel 2 does not divide model m's 1 KV heads"),
    ("num_experts: 4\nexpert_parallel_size: 4\n", "tensor_parallel: 2\n",
     "expert_parallel_size 4 does not divide the 2 data-parallel ranks"),
])
def test_cli_refuses_a_model_the_parallelism_cannot_split(tmp_path, model_text, extra, message):
    base = (Path(__file__).parents[2] / "configs" / "models" / "tiny.yaml").read_text()
    keys = {line.split(":")[0] for line in model_text.splitlines()}
    model = "".join(line + "\n" for line in base.splitlines() if line.split(":")[0] not in keys | {"name"})
    write(tmp_path, model + model_text, "m.yaml")
    text = "\n".join(line for line in MINIMAL.replace("model: tiny", f"model: {tmp_path / 'm.yaml'}").splitlines()
                     if line.split(":")[0] not in {ln.split(":")[0] for ln in extra.splitlines()})
    path = write(tmp_path, text + "\n" + extra)
    r = subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", str(path), "--print-args"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_cli_megatron_only_is_one_arg_per_line(capsys):
    assert main(["--preset", "tiny-cpu", "--print-args", "--only", "megatron"]) == 0
    lines = capsys.readouterr().out.splitlines()
    p = load_launch_preset("tiny-cpu")
    assert lines == pretrain_args(p, load_model(p.model))


def test_cli_errors_are_one_line(tmp_path):
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", *argv], capture_output=True,
                              text=True, env={**os.environ, "MEGATRON_LM_DIR": str(tmp_path)})
    typo = run("--preset", "tiny-cpus", "--print-args")
    assert typo.returncode == 2 and "did you mean 'tiny-cpu'" in typo.stderr and typo.stderr.count("\n") == 1
    multi = run("--preset", "tiny-cpu", "--run")
    assert multi.returncode == 2 and "spans 2 nodes" in multi.stderr
    missing = run("--preset", "tiny-cpu", "--run", "--rdzv-host", "node-0")
    assert missing.returncode == 2 and "pretrain_gpt.py does not exist" in missing.stderr


def test_run_sets_cuda_device_max_connections(tmp_path, monkeypatch):
    """--run launches like the SLURM script: CUDA_DEVICE_MAX_CONNECTIONS=1 unless exported."""
    import megatron_zeppelin.launch.__main__ as launch_main

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    seen = []
    monkeypatch.setattr(launch_main.subprocess, "call", lambda argv, env: seen.append(env) or 0)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert launch_main._run(["python", str(script)]) == 0
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert launch_main._run(["python", str(script)]) == 0
    assert [e["CUDA_DEVICE_MAX_CONNECTIONS"] for e in seen] == ["1", "8"]
