"""Megatron-LM patches and scripts/apply_megatron_patch.sh.

Without a Megatron-LM checkout these tests check the script's refusals and that the
patches call only what megatron_zeppelin.integration exports.  With
``MEGATRON_LM_DIR=/path/to/Megatron-LM`` (at core_v0.16.1 or core_v0.19.0) they also
apply the matching patch to a copy of its files, re-apply (idempotent), revert, and
run the patched ``pretrain_gpt.py --help`` and the tiny preset through Megatron's parser.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_zeppelin.integration as integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "apply_megatron_patch.sh"
PATCHES = sorted((ROOT / "patches").glob("core_v*/*.patch"))
MLM = os.environ.get("MEGATRON_LM_DIR")
FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron/core/package_info.py")


def apply(*args):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def fake_checkout(root: Path, version: str, pretrain: str = "print('hi')\n") -> Path:
    (root / "megatron" / "core").mkdir(parents=True)
    major, minor, patch = version.split(".")
    (root / "megatron" / "core" / "package_info.py").write_text(
        f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    (root / "pretrain_gpt.py").write_text(pretrain)
    return root


def test_both_pinned_tags_have_a_patch():
    assert {p.parent.name for p in PATCHES} == {"core_v0.16.1", "core_v0.19.0"}


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.parent.name)
def test_patch_calls_only_exported_names(patch):
    added = [line for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    used = set(re.findall(r"\bzeppelin\.(\w+)", "\n".join(added)))
    assert used and used <= set(integration.__all__), used - set(integration.__all__)
    for name in used:
        assert callable(getattr(integration, name))
    # Small by design: the logic lives in the package.
    assert len(added) <= 30


def test_refuses_a_directory_that_is_not_megatron(tmp_path):
    r = apply(tmp_path)
    assert r.returncode == 2 and "is not a Megatron-LM checkout" in r.stderr


def test_refuses_an_unknown_version(tmp_path):
    r = apply(fake_checkout(tmp_path, "0.15.0"))
    assert r.returncode == 2
    assert "unknown Megatron-LM version 0.15.0" in r.stderr and "core_v0.16.1, core_v0.19.0" in r.stderr


def test_refuses_a_modified_tree(tmp_path):
    r = apply(fake_checkout(tmp_path, "0.16.1"))
    assert r.returncode == 2 and "does not apply" in r.stderr
    assert (tmp_path / "pretrain_gpt.py").read_text() == "print('hi')\n"


def test_usage():
    assert apply().returncode == 2


needs_mlm = pytest.mark.skipif(
    not MLM, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout at core_v0.16.1 or core_v0.19.0 to "
                    "apply the patches for real")


@pytest.fixture(scope="module")
def mlm_copy(tmp_path_factory):
    """The files the patch touches, copied out of MEGATRON_LM_DIR (which stays untouched)."""
    root = tmp_path_factory.mktemp("mlm")
    for f in FILES:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(MLM) / f, root / f)
    return root


@needs_mlm
def test_apply_is_idempotent_and_reverts(mlm_copy):
    before = (mlm_copy / "pretrain_gpt.py").read_text()
    first = apply(mlm_copy)
    assert first.returncode == 0 and ": applied to" in first.stdout, first.stderr
    again = apply(mlm_copy)
    assert again.returncode == 0 and "already applied" in again.stdout
    back = apply("--revert", mlm_copy)
    assert back.returncode == 0 and "reverted" in back.stdout
    assert (mlm_copy / "pretrain_gpt.py").read_text() == before
    assert apply(mlm_copy).returncode == 0


def run_megatron(mlm_copy, *argv, env=None):
    path = [str(mlm_copy), MLM, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **(env or {})}
    r = subprocess.run([sys.executable, *argv], cwd=mlm_copy, capture_output=True, text=True, env=env,
                       timeout=300)
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", r.stderr)
    if r.returncode and missing:
        pytest.skip(f"Megatron-LM needs {missing.group(1)} (pip install six regex pydantic triton)")
    if r.returncode and "cannot import name 'override' from 'typing'" in r.stderr:
        pytest.skip(f"this Megatron-LM needs Python >= 3.12 (typing.override); this is {sys.version.split()[0]}")
    return r


@needs_mlm
def test_patched_help_shows_the_flags(mlm_copy):
    assert apply(mlm_copy).returncode == 0
    r = run_megatron(mlm_copy, "pretrain_gpt.py", "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in ("--zeppelin ", "--zeppelin-planner", "--zeppelin-tokens-per-gpu", "--zeppelin-cluster",
                 "--zeppelin-routing", "--zeppelin-remap", "--zeppelin-plan-dump-dir", "--zeppelin-log-interval"):
        assert flag in r.stdout


@needs_mlm
def test_rendered_preset_parses_with_megatron(mlm_copy):
    code = (
        "import sys\n"
        "from megatron.training.arguments import parse_args, validate_args\n"
        "from megatron_zeppelin import integration as z\n"
        "args = parse_args(z.chain_args_providers(None, z.add_zeppelin_args))\n"
        "validate_args(args, {'tokenizer_type': 'GPT2BPETokenizer'})\n"
        "z.validate_zeppelin_args(args)\n"
        "print('PARSED', args.data_parallel_size, args.global_batch_size, args.zeppelin_tokens_per_gpu)\n")
    argv = subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", "tiny-cpu", "--print-args",
                           "--only", "megatron"], capture_output=True, text=True, check=True).stdout.split()
    r = run_megatron(mlm_copy, "-c", code, *argv, env={"WORLD_SIZE": "4"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PARSED 4 4 1024" in r.stdout


@needs_mlm
def test_patched_pretrain_gpt_steps_on_cpu(mlm_copy, tmp_path):
    """Megatron-LM's own model builder, dataset provider, forward_step and loss_func
    (patched) run two Zeppelin steps on a one-rank CPU world (0.16.1: Python 3.11)."""
    from tests.integration.indexed_data import write_dataset

    assert apply(mlm_copy).returncode == 0
    if "core_v0.16.1" not in apply(mlm_copy).stdout:
        pytest.skip("the CPU smoke run is for core_v0.16.1 (later tags need Python >= 3.12)")
    prefix = write_dataset(str(tmp_path / "docs"), [300, 40, 700, 90, 12, 450, 60, 200, 33, 510] * 2)
    cluster = tmp_path / "one-cpu.yaml"
    text = (ROOT / "configs" / "clusters" / "cpu-sim.yaml").read_text()
    cluster.write_text(re.sub(r"(?m)^(nodes|gpus_per_node|nics_per_node): 2", r"\1: 1", text))
    shutil.copy(Path(__file__).parent / "megatron_lm_smoke.py", mlm_copy)
    r = run_megatron(mlm_copy, "megatron_lm_smoke.py", prefix, str(cluster))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODEL ZeppelinGPTModel ZeppelinAttention" in r.stdout
    steps = [line.split() for line in r.stdout.splitlines() if line.startswith("STEP")]
    assert [s[1] for s in steps] == ["0", "1"] and [s[4] for s in steps] == ["1", "2"]
    for _, _, mean_loss, tokens, _ in steps:
        # An untrained model's per-token loss is near ln(padded vocab 384) = 5.95.
        assert abs(float(mean_loss) - 5.95) < 0.5 and int(tokens) > 0


@needs_mlm
@pytest.mark.parametrize("flags, message", [
    (["--sequence-parallel"], "--sequence-parallel splits tokens over tensor-parallel ranks"),
    (["--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size 4 does not divide the 2 GPUs per node"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
     "--moe-aux-loss-coeff 0"),
    (["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--num-query-groups", "3",
      "--hidden-size", "48"], "--tensor-model-parallel-size 2 does not divide --num-attention-heads 3"),
    (["--tensor-model-parallel-size", "2", "--num-query-groups", "1"],
     "--tensor-model-parallel-size 2 does not divide --num-query-groups (KV heads) 1"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"],
     "--num-experts 3 does not divide over --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2"],
     "--expert-model-parallel-size 4 x expert TP 2 does not divide the 4 ranks"),
    (["--rampup-batch-size", "4", "4", "100"], "--zeppelin does not support --rampup-batch-size"),
    (["--fp8-format", "hybrid"], "--zeppelin does not support --fp8-format"),
    (["--tp-comm-overlap"], "--zeppelin does not support --tp-comm-overlap"),
    (["--enable-cuda-graph"], "--zeppelin does not support --enable-cuda-graph"),
    (["--cuda-graph-impl", "transformer_engine"], "--zeppelin does not support --cuda-graph-impl"),
], ids=["sp-without-tp", "tp-over-node", "moe-aux-loss", "tp-over-heads", "tp-over-kv-heads",
        "experts-over-ep", "ep-over-ranks", "rampup", "fp8", "tp-comm-overlap", "enable-cuda-graph",
        "cuda-graph-impl"])
def test_patched_pretrain_gpt_refuses_before_any_process_group(mlm_copy, flags, message):
    """core_v0.16.1's ``pretrain()`` builds its process groups right after parsing: the
    patched script checks the ``--zeppelin`` flags before calling it.  No
    MASTER_ADDR is set, so reaching ``init_process_group`` would fail otherwise."""
    assert apply(mlm_copy).returncode == 0
    if "core_v0.16.1" not in apply(mlm_copy).stdout:
        pytest.skip("the early check is patched into core_v0.16.1 (0.19 checks right after its own parse)")
    argv = subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", "tiny-cpu", "--print-args",
                           "--only", "megatron"], capture_output=True, text=True, check=True).stdout.split()
    env = {"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "", "MASTER_PORT": ""}
    r = run_megatron(mlm_copy, "pretrain_gpt.py", *argv, "--zeppelin-cluster", "cpu-sim", *flags, env=env)
    errors = [line for line in r.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def _bad_data(tmp_path, kind):
    """A --data-path (and extra flags) broken the way ``kind`` says."""
    import numpy as np

    from tests.integration.indexed_data import write_dataset

    prefix = write_dataset(str(tmp_path / "docs"), [300, 40, 700, 90, 12, 450, 60, 200, 33, 510] * 4)
    if kind == "garbage-idx":
        Path(prefix + ".idx").write_bytes(b"not an index at all")
    elif kind == "short-bin":
        data = Path(prefix + ".bin").read_bytes()
        Path(prefix + ".bin").write_bytes(data[:100])
    elif kind == "missing-prefix":
        return [str(tmp_path / "nope")]
    elif kind == "missing-blend-member":
        return ["0.5", prefix, "0.5", str(tmp_path / "gone")]
    elif kind == "lengths-of-other-data":
        np.savetxt(tmp_path / "lengths.txt", [5, 6, 7], fmt="%d")
        return [prefix, "--zeppelin-data-lengths", str(tmp_path / "lengths.txt")]
    elif kind == "empty-train-split":
        return [prefix, "--split", "0,100,0"]
    elif kind == "flash-missing":
        return [prefix, "--zeppelin-backend", "flash"]
    elif kind == "valid-batch-too-small":
        return [prefix, "--split", "90,10,0", "--global-batch-size", "32", "--eval-iters", "2"]
    return [prefix]


@needs_mlm
@pytest.mark.parametrize("kind, message", [
    ("garbage-idx", "docs.idx: not a Megatron index (19 bytes, no MMIDIDX header)"),
    ("short-bin", "docs.bin: 100 bytes, but"),
    ("missing-prefix", "nope: missing"),
    ("missing-blend-member", "gone: missing"),
    ("lengths-of-other-data", "lengths.txt lists 3 documents, but --data-path holds 40"),
    ("empty-train-split", "--split 0,100,0 gives the training split no document"),
    ("flash-missing", "flash"),
    ("valid-batch-too-small", "the validation split's global batch"),
])
def test_patched_pretrain_gpt_refuses_bad_data_before_any_process_group(mlm_copy, tmp_path, kind, message):
    """Data problems are found where the flag checks run: one line naming the file or
    flag, exit 2, no traceback, before Megatron builds anything (no MASTER_ADDR)."""
    assert apply(mlm_copy).returncode == 0
    if "core_v0.16.1" not in apply(mlm_copy).stdout:
        pytest.skip("the early check is patched into core_v0.16.1 (0.19 checks right after its own parse)")
    if kind == "flash-missing":
        pytest.importorskip("megatron_zeppelin")
        try:
            import flash_attn  # noqa: F401
            pytest.skip("flash-attn is installed here")
        except ImportError:
            pass
    argv = subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", "tiny-cpu", "--print-args",
                           "--only", "megatron"], capture_output=True, text=True, check=True).stdout.split()
    env = {"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "", "MASTER_PORT": ""}
    r = run_megatron(mlm_copy, "pretrain_gpt.py", *argv, "--zeppelin-cluster", "cpu-sim", "--save",
                     str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--data-path",
                     *_bad_data(tmp_path, kind), env=env)
    errors = [line for line in r.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    print(errors[0])
