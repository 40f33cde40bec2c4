"""scripts/gpu_check.sh and benchmarks/gpu_check.py on a machine without CUDA: the
one-line exit, the dry run of every section, the report and exit status, a
section that raises or overruns its budget, the calibration fit on both H200
tables, the skip judgement of the GPU tests."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.topology import load_cluster

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))   # the modules import each other by name, as when run as scripts


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_report = _load("gpu_report")
cal = _load("attn_calibration")
sections = _load("gpu_sections")
gpu_check = _load("gpu_check")
TABLES = cal.load_tables(ROOT / "tests" / "benchmarks" / "fixtures" / "h200-2026-11-26.json")
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")


@needs_no_cuda
def test_script_without_cuda_prints_one_line_and_exits_0():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines() == [gpu_check.NO_GPU], r.stdout + r.stderr


@needs_no_cuda
def test_main_without_cuda(capsys):
    assert gpu_check.main(["--skip", "training"]) == 0
    assert capsys.readouterr().out.strip() == gpu_check.NO_GPU


@pytest.mark.slow
def test_dry_run_passes_every_section(tmp_path):
    """The acceptance run's own code on the CPU: exit 0, every section PASS, the
    summary table first, in the registry's order."""
    out = tmp_path / "report.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    rows = re.findall(r"(?m)^\| (\w+) \| (PASS|\*\*FAIL\*\*|skipped) \|", out.read_text())
    assert [name for name, _ in rows] == list(gpu_check.NAMES), out.read_text()
    failed = [name for name, verdict in rows if verdict != "PASS"]
    assert not failed, r.stdout + r.stderr + out.read_text()
    for name in gpu_check.NAMES:
        assert re.search(rf"(?m)^gpu_check: (PASS|FAIL) {name} \(\d+ s\): \S", r.stdout), r.stdout
    assert r.returncode == 0, r.stdout + r.stderr


def test_arguments():
    args = gpu_check.parse_args(["--cluster", "h200-8x400g", "--skip", "training", "tests", "--steps", "5"])
    assert (args.cluster, args.skip, args.steps, args.dry_run) == ("h200-8x400g", ["training", "tests"], 5, False)
    for bad, line in ((["--skip", "everything"], "invalid choice: 'everything'"), (["--steps", "0"], "--steps"),
                      (["--cluster", "h300"], "unknown cluster preset 'h300'"), (["--table", "nope.json"], "--table")):
        with pytest.raises(ConfigError, match=line):
            gpu_check.parse_args(bad)
    assert gpu_check.NAMES == ("tests", "calibration", "overhead", "concurrency", "delays", "syncs", "training")
    assert sum(s.budget_s for s in gpu_check.SECTIONS) <= gpu_check.TOTAL_BUDGET_S + 60
    assert sections.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


# ------------------------------------------------------------------ runner and report
def test_a_section_that_raises_is_a_fail_with_its_line(monkeypatch, tmp_path):
    def broken(args, dry_run):
        raise RuntimeError("kernel exploded\nsecond line")

    module = type(sys)("broken_sections")
    module.section_tests = broken
    monkeypatch.setitem(sys.modules, "broken_sections", module)
    monkeypatch.setattr(gpu_check, "SECTIONS", (gpu_check.Section("tests", 10, "broken_sections"),))
    result_path = tmp_path / "r.json"
    gpu_check.section_child(gpu_check.parse_args(["--dry-run", "--section", "tests", "--result", str(result_path)]))
    result = gpu_report.SectionResult.read(result_path)
    assert not result.passed and result.figure == "RuntimeError: kernel exploded"
    assert "second line" in result.body   # the traceback goes to the report


def test_a_section_over_its_budget_is_killed_and_fails():
    section = next(s for s in gpu_check.SECTIONS if s.name == "training")
    result, seconds = gpu_check.run_section(section, ["--dry-run"], budget=1, dry_run=True)
    assert not result.passed and result.figure == "training over its budget of 1 s, killed"
    assert seconds < 15


def test_any_fail_makes_the_exit_status_1_and_heads_the_report(monkeypatch, tmp_path):
    verdicts = {"tests": True, "calibration": False, "training": True}

    def fake_run(section, argv, budget, dry_run):
        assert dry_run and budget <= section.budget_s
        return gpu_report.SectionResult(verdicts[section.name], f"{section.name} figure | 1", "body"), 2.0

    monkeypatch.setattr(gpu_check, "run_section", fake_run)
    out = tmp_path / "r.md"
    skip = ["--skip", *(n for n in gpu_check.NAMES if n not in verdicts)]
    assert gpu_check.main(["--dry-run", "--out", str(out), *skip]) == 1
    text = out.read_text()
    assert text.index("| section | result |") < text.index("## tests")
    assert "| calibration | **FAIL** | calibration figure / 1 |" in text and "| delays | skipped |" in text
    assert "**2 of 3 sections passed.**" in text
    verdicts["calibration"] = True
    assert gpu_check.main(["--dry-run", "--out", str(out), *skip]) == 0


def test_training_without_megatron_core_names_the_wheel(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron.core" else real(name, *a))
    result = sections.section_training(argparse.Namespace(cluster=None, steps=1, section_budget=10), dry_run=True)
    assert not result.passed
    assert "needs megatron.core" in result.figure and "megatron_core-0.16.1-cp312" in result.figure


def test_skips_pass_only_for_a_package_that_does_not_import():
    absent = "could not import 'flash_attn_not_here': No module named 'flash_attn_not_here'"
    present = "could not import 'numpy': numpy.core.multiarray failed to import"   # numpy imports here
    assert sections.judge_skips([absent], dry_run=False) == []
    assert sections.judge_skips([present, "needs CUDA", "flaky"], dry_run=False) == [present, "needs CUDA", "flaky"]
    assert sections.judge_skips(["needs CUDA"], dry_run=True) == []
    if importlib.util.find_spec("flash_attn") is None:
        assert sections.judge_skips(["flash-attn is not installed"], dry_run=False) == []


# ------------------------------------------------------------------ calibration
@pytest.mark.parametrize("name", sorted(TABLES["tables"]))
def test_the_fit_holds_both_h200_tables(name):
    table = TABLES["tables"][name]
    curve, errors, held = cal.check_table(table, TABLES["peak_tflops"])
    assert held and curve.efficiency > 0 and curve.half_block > 0
    lo, hi = table["check"]
    assert all(abs(e) <= table["tolerance"] for L, e in zip(table["lengths"], errors) if lo <= L <= hi)


def test_fit_figures_on_the_fa2_table_match_the_h200_note():
    gqa = cal.fit_curve(**{k: TABLES["tables"]["fa2-varlen-gqa"][k] for k in ("lengths", "tflops")},
                        peak=TABLES["peak_tflops"])
    assert gqa.efficiency == pytest.approx(0.341, abs=1e-3) and gqa.half_block == pytest.approx(648, abs=2)


def test_the_linearized_fit_it_replaces_is_negative_on_the_sdpa_run():
    """Why the fit is in efficiency space: the first H200 run's 1/eff-linear fit."""
    table = TABLES["tables"]["sdpa-dense-mha"]
    eff = np.asarray(table["tflops"]) / TABLES["peak_tflops"]
    _, intercept = np.polyfit(1 / np.asarray(table["lengths"], float), 1 / eff, 1)
    assert 1 / intercept < 0
    assert cal.fit_curve(table["lengths"], table["tflops"], TABLES["peak_tflops"]).efficiency > 0


def test_fit_recovers_an_exact_curve_and_refuses_nonsense():
    lengths = [64, 256, 1024, 4096, 32768]
    tflops = [0.5 * L / (L + 1500) * 989 for L in lengths]
    curve = cal.fit_curve(lengths, tflops, 989)
    assert curve.efficiency == pytest.approx(0.5, rel=1e-3) and curve.half_block == pytest.approx(1500, rel=1e-2)
    # Rising faster than L / (L + h) (a CPU at tiny sizes): the efficiency stays a fraction of peak.
    assert 0 < cal.fit_curve([32, 64, 128], [0.5, 2, 8], 10).efficiency <= 1
    for bad in (([128], [50]), ([128, 256], [50, -1]), ([0, 256], [50, 60]), ([128, 256], [50, 990])):
        with pytest.raises(ValueError):
            cal.fit_curve(*bad, 989)


def test_the_preset_means_the_fitted_curve_to_the_cost_model(tmp_path):
    """The written preset, loaded as a cluster, gives the cost model the fitted
    efficiency at every length: local attention seconds equal the H200 table's."""
    table = TABLES["tables"]["fa2-varlen-gqa"]
    curve = cal.fit_curve(table["lengths"], table["tflops"], TABLES["peak_tflops"])
    base = (ROOT / "configs" / "clusters" / "h200-8x400g.yaml").read_text()
    path = tmp_path / "nvidia-h200-torch-flash-calibrated.yaml"
    path.write_text(cal.calibrated_preset(base, path.stem, curve, "torch_flash varlen, NVIDIA H200, 2026-11-26"))
    cluster = load_cluster(str(path))
    assert cluster.name == path.stem and cluster.nic == load_cluster("h200-8x400g").nic
    assert "# torch_flash varlen, NVIDIA H200, 2026-11-26" in path.read_text()
    model = ModelConfig(name="gqa", num_layers=1, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                        ffn_hidden_size=14336, vocab_size=32000)
    cost = CostModel(cluster, model)
    for L, measured in zip(table["lengths"], table["tflops"]):
        flops = L * (L + 1) / 2 * cal.pair_flops(32, 128)
        modeled = flops / cost.local_attn_s(L) / 1e12
        assert modeled == pytest.approx(measured, rel=0.05)   # the table's worst point is 4.2 % off


def test_kernels_are_timed_after_a_warm_up_of_every_length():
    calls = []

    class Recording:
        def varlen_forward(self, q, k, v, *, cu_seqlens, max_seqlen, scale):
            calls.append(max_seqlen)
            return q.clone(), torch.zeros(q.shape[1], q.shape[0])

        def varlen_backward(self, dout, q, k, v, out, lse, *, cu_seqlens, max_seqlen, scale):
            assert int(cu_seqlens[-1]) == q.shape[0] and max_seqlen <= 64
            return q, k, v

    tflops = cal.time_kernel(Recording(), cal.Timing((16, 64), 64, (2, 1, 8), "float32", 3), torch.device("cpu"))
    assert calls == [16, 64, 16, 16, 16, 16, 64, 64, 64, 64] and all(t > 0 for t in tflops)
    assert cal.pack_documents(16, 40) == [16, 16, 8] and cal.pack_documents(64, 40) == [64]
