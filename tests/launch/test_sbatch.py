"""scripts/slurm/*.sbatch and scripts/*.sh: syntax, shellcheck, and the DRY_RUN command."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts" / "slurm").glob("*.sbatch")) + [ROOT / "scripts" / "apply_megatron_patch.sh"]
SBATCH = ROOT / "scripts" / "slurm" / "pretrain_gpt.sbatch"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install -y shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    r = subprocess.run(["shellcheck", "-x", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def dry_run(tmp_path, **env):
    """Run the sbatch script in DRY_RUN mode as SLURM would, with a fake scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    scontrol.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DRY_RUN": "1", "PRESET": "tiny-cpu",
            "MEGATRON_LM_DIR": "/opt/Megatron-LM", "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242", "ZEPPELIN_DIR": str(ROOT), **env}
    return subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=full, cwd=tmp_path)


def test_dry_run_prints_the_launch(tmp_path):
    r = dry_run(tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for piece in ("srun --nodes=2 --ntasks-per-node=1", "torchrun --nnodes=2 --nproc-per-node=2",
                  "--rdzv-backend=c10d --rdzv-endpoint=gpu-node-07:29500 --rdzv-id=4242",
                  f"bash {SBATCH} --bind python /opt/Megatron-LM/pretrain_gpt.py",
                  "--zeppelin --zeppelin-planner zeppelin --zeppelin-tokens-per-gpu 1024",
                  "NIC_MAP=mlx5_0 mlx5_1", "NCCL_NET_GDR_LEVEL=PHB"):
        assert piece in out, piece
    assert not (tmp_path / "logs").exists()  # a dry run writes nothing


def test_dry_run_roce_and_bad_input(tmp_path):
    r = dry_run(tmp_path, NET="roce")
    assert r.returncode == 0 and "NCCL_IB_GID_INDEX=3" in r.stdout and "NIC_MAP=mlx5_0 mlx5_0 mlx5_1" in r.stdout
    bad = dry_run(tmp_path, NET="ethernet")
    assert bad.returncode == 2 and "NET=ethernet" in bad.stderr
    nodes = dry_run(tmp_path, SLURM_JOB_NUM_NODES="3")
    assert nodes.returncode == 2 and "preset tiny-cpu wants 2" in nodes.stderr


def test_bind_wrapper_picks_the_ranks_nic(tmp_path):
    env = {**os.environ, "NIC_MAP": "mlx5_0 mlx5_0 mlx5_1 mlx5_1", "LOCAL_RANK": "3", "GPUS_PER_NUMA": ""}
    r = subprocess.run(["bash", str(SBATCH), "--bind", "sh", "-c", "echo $NCCL_IB_HCA"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "mlx5_1"


def test_dry_run_renders_pipeline_parallelism_and_refuses_a_bad_preset_in_one_line(tmp_path):
    """The PP preset's launch carries its stages; a preset the launcher refuses stops
    the script with the launcher's one line and exit 2 (before: a traceback, exit 1)."""
    r = dry_run(tmp_path, PRESET="llama-70b-128k-pp2-h200-8x8", SLURM_JOB_NUM_NODES="8")
    assert r.returncode == 0, r.stderr
    assert "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2" in r.stdout
    assert "--global-batch-size 32" in r.stdout and "torchrun --nnodes=8 --nproc-per-node=8" in r.stdout
    for extra in ("pipeline_parallel: 2\n", "tensor_parallel: 2\npipeline_parallel: 4\n"):
        bad = tmp_path / "bad.yaml"
        bad.write_text("model: tiny\ncluster: cpu-sim\nnodes: 2\ngpus_per_node: 2\nseq_length: 512\n"
                       "tokens_per_gpu: 1024\ntrain_iters: 5\ndata_path: [d]\ntokenizer_type: NullTokenizer\n" + extra)
        r = dry_run(tmp_path, PRESET=str(bad))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "preset bad: " in r.stderr, r.stderr
