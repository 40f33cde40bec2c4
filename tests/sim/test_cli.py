"""``python -m megatron_zeppelin.sim`` end to end, as a user runs it (subprocess)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.sim.cli import main
from megatron_zeppelin.sim.progress import Progress
from megatron_zeppelin.sim.simulate import STRATEGY_NAMES, sample_batches, uses_routing
from megatron_zeppelin.cost.tp import tp_view
from megatron_zeppelin.planner.base import PLANNERS, PlanContext, get_planner
from megatron_zeppelin.sim.rounds import plan_batch, rounds_timeline
from megatron_zeppelin.sim.timeline import step_timeline
from megatron_zeppelin.topology import load_cluster

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def sim(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_zeppelin.sim", "--no-progress", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory) -> Path:
    rng = np.random.default_rng(7)
    lens = np.concatenate([rng.integers(64, 2048, 300), rng.integers(4096, 40000, 12)])
    path = tmp_path_factory.mktemp("lengths") / "lens.npy"
    np.save(path, rng.permutation(lens))
    return path


# 8 GPUs in 4 nodes; 16K max length / 4K tokens per GPU -> te_cp's CP group of 4 spans two nodes.
TINY = ("--cluster", "cpu-sim", "--nodes", "4", "--model", "tiny", "--max-seq-len", "16384",
        "--tokens-per-gpu", "4096", "--steps", str(STEPS), "--flexsp-time-limit", "1")


@pytest.fixture(scope="module")
def run(lengths_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    code, stdout, stderr = finish(sim(*TINY, "--lengths", str(lengths_file), "--json", str(out / "r.json"),
                                      "--dump-plans", str(out / "plans"), "--plot", str(out / "t.png")))
    assert code == 0, stderr
    return out, json.loads((out / "r.json").read_text()), stdout


def test_json_keys_and_table(run):
    _, result, stdout = run
    assert result["steps"] == STEPS
    assert set(result["strategies"]) == set(STRATEGY_NAMES)
    cfg = result["config"]
    assert cfg["world_size"] == 8
    # The static layout search keeps the longest sequence within its TP x CP group.
    assert cfg["te_cp_cp_size"] * cfg["te_cp_tp_size"] * 4096 >= 16384
    assert "te_cp: TP=" in cfg["static_layouts"]["te_cp"] and "te_cp TP=" in stdout
    for name, r in result["strategies"].items():
        assert {"step_time_s", "planner_ms", "speedup_vs_te_cp", "feasible", "error"} <= set(r)
        assert r["feasible"] is (r["error"] is None)
        assert name in stdout
    te = result["strategies"]["te_cp"]
    assert te["feasible"] and te["speedup_vs_te_cp"] == pytest.approx(1.0)
    for r in result["strategies"].values():
        if r["feasible"]:
            assert r["speedup_vs_te_cp"] == pytest.approx(te["step_time_s"] / r["step_time_s"], rel=1e-9)
            assert r["step_time_s"] >= result["lower_bound_step_s"]


def test_dumped_plans_reproduce_the_reported_numbers(run):
    """Every dumped plan reads back and validates; re-timed (a planner with
    micro-batches re-planned into its rounds) it gives the JSON's step time."""
    out, result, _ = run
    cfg = result["config"]
    cost = CostModel(load_cluster("cpu-sim", nodes=4), load_model("tiny"))
    batches = {}
    for name, r in result["strategies"].items():
        files = sorted((out / "plans").glob(f"step*_{name}.json"))
        if not r["feasible"]:
            continue
        assert [f.name for f in files] == [f"step{k}_{name}.json" for k in range(STEPS)]
        tp = cfg["tp_sizes"][name]
        mine = cost.routed(uses_routing(name))
        mine = tp_view(mine, tp) if tp > 1 else mine
        size = {"te_cp": cfg["te_cp_cp_size"]}.get(name)
        if name in ("ulysses_sp", "megatron_dp_balanced"):     # their searched SP / CP size
            size = int(cfg["static_layouts"][name].split(" (tried")[0].split("P=")[-1])
        ctx = PlanContext(cost=mine, tokens_per_gpu=4096 * tp, cp_size=size, time_limit_s=1.0, tp_size=tp)
        times = []
        for k, f in enumerate(files):
            plan = Plan.from_dict(json.loads(f.read_text())).validate()
            assert plan.world_size * tp == 8 and plan.token_cap in (None, 4096 * tp)
            batches.setdefault(k, list(plan.seq_lens))
            assert list(plan.seq_lens) == batches[k]          # every strategy saw the same batch
            planner = get_planner(name if name in PLANNERS else "zeppelin")
            if name.startswith("zeppelin"):      # its decision's one pass here (several carry no cap)
                assert plan.token_cap == 4096 * tp, name
                times.append(step_timeline(plan, mine).step_s)
            elif hasattr(planner, "plan_rounds") and name != "flexsp":   # flexsp's MILP is timed
                merged, rounds = plan_batch(planner, plan.seq_lens, ctx)
                assert merged == plan
                times.append(rounds_timeline(rounds, mine).step_s)
            elif name != "flexsp":
                times.append(step_timeline(plan, mine).step_s)
        if name != "flexsp":
            assert r["step_time_s"] == pytest.approx(sum(times) / STEPS, rel=1e-9), name
    lower = sum(cost.lower_bound_s(batches[k]) for k in range(STEPS)) / STEPS
    assert result["lower_bound_step_s"] == pytest.approx(lower, rel=1e-9)
    assert (out / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_micro_batches_are_planned_apart_and_share_one_sync(lengths_file, tmp_path):
    """``--micro-batches 3``: every strategy plans the same three micro-batches of
    each global batch (together the batch, each under the cap), and the step is
    their rounds one after another with one gradient sync."""
    code, stdout, stderr = finish(sim(*TINY, "--lengths", str(lengths_file), "--micro-batches", "3",
                                      "--strategies", "te_cp,zeppelin", "--json", str(tmp_path / "r.json"),
                                      "--dump-plans", str(tmp_path / "plans")))
    assert code == 0, stderr
    assert "3 micro-batches per step" in stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["micro_batches"] == 3
    cost = CostModel(load_cluster("cpu-sim", nodes=4), load_model("tiny"))
    batches = sample_batches(np.load(lengths_file), max_seq_len=16384, steps=STEPS,
                             tokens_per_batch=result["config"]["tokens_per_batch"])
    for name, r in result["strategies"].items():
        assert r["feasible"], r["error"]
        tp = result["config"]["tp_sizes"][name]
        mine = cost.routed(uses_routing(name))
        mine = tp_view(mine, tp) if tp > 1 else mine
        for k in range(STEPS):
            plans = [Plan.from_dict(json.loads((tmp_path / "plans" / f"step{k}_{name}_mb{i}.json").read_text()))
                     for i in range(3)]
            assert all(p.seq_lens and max(p.attention_tokens_per_rank()) <= 4096 * tp for p in plans)
            assert sorted(n for p in plans for n in p.seq_lens) == sorted(batches[k])
            if name == "zeppelin":    # te_cp plans in rounds: re-timed through the dumped merged plans only
                assert r["step_times_s"][k] == pytest.approx(rounds_timeline(plans, mine).step_s, rel=1e-9)
    # Three micro-batches per step hold three times one pass's tokens.
    assert result["config"]["tokens_per_batch"] > 2.5 * 8 * 4096 * 0.9


def test_defaults_run_on_the_bundled_sample():
    code, stdout, stderr = finish(sim("--steps", "1", "--strategies", "te_cp,zeppelin"))
    assert code == 0, stderr
    assert "synthetic-longtail.npy" in stdout and "| zeppelin " in stdout and "| te_cp " in stdout


def _bad_inputs(tmp: Path, lengths_file: Path) -> dict[str, tuple[list[str], str]]:
    """case -> (arguments, a fragment the one-line error must contain)."""
    np.save(tmp / "empty.npy", np.array([], dtype=np.int64))
    (tmp / "neg.txt").write_text("100\n-5\n")
    (tmp / "words.txt").write_text("100\nabc\n")
    np.save(tmp / "float.npy", np.array([1.5, 2.0]))
    cluster = (REPO / "configs/clusters/cpu-sim.yaml").read_text().replace("gpus_per_node: 2", "gpus_per_node: 4")
    (tmp / "nics.yaml").write_text(cluster.replace("nics_per_node: 2", "nics_per_node: 3"))
    ok = [*TINY, "--lengths", str(lengths_file)]
    return {
        "empty": ([*TINY, "--lengths", str(tmp / "empty.npy")], "no document length"),
        "negative": ([*TINY, "--lengths", str(tmp / "neg.txt")], "positive"),
        "non-integer": ([*TINY, "--lengths", str(tmp / "words.txt")], "not an integer"),
        "float-npy": ([*TINY, "--lengths", str(tmp / "float.npy")], "integer"),
        "missing": ([*TINY, "--lengths", str(tmp / "nope.npy")], "synthetic-longtail"),
        "cluster": ([*ok, "--cluster", "h100-8x40g"], "h100-8x400g"),
        "model": ([*ok, "--model", "llama-8b"], "llama-7b"),
        "strategy": ([*ok, "--strategies", "te_cp,zepelin"], "zeppelin_norouting"),
        "cap": ([*ok, "--tokens-per-gpu", "1024"], "--tokens-per-gpu"),
        "nics": ([*ok, "--cluster", str(tmp / "nics.yaml")], "divide"),
        "steps": ([*ok, "--steps", "0"], "--steps"),
        "fill": ([*ok, "--batch-fill", "1.5"], "--batch-fill"),
        "plot-step": ([*ok, "--plot-step", "5"], "--plot-step"),
        "flag": ([*ok, "--colour"], "--colour"),
        "not-a-number": ([*ok, "--nodes", "two"], "--nodes"),
        "json-dir": ([*ok, "--strategies", "te_cp", "--json", str(tmp / "neg.txt" / "r.json")], "cannot be written"),
        "json-input": ([*ok, "--json", str(lengths_file)], "is an input of this run (--lengths)"),
        "one-token": ([*ok, "--max-seq-len", "1"], "--max-seq-len must be >= 2"),
        "same-outputs": ([*ok, "--json", str(tmp / "r.png"), "--plot", str(tmp / "r.png")], "both write"),
        "micro-zero": ([*ok, "--micro-batches", "0"], "--micro-batches"),
        "micro-empty": ([*ok, "--tokens-per-batch", "16384", "--micro-batches", "200"], "empty"),
        "ring-grad-dtype": ([*ok, "--ring-grad-dtype", "bf16"], "'model', 'fp32'"),
    }


@pytest.mark.parametrize("case", ["empty", "negative", "non-integer", "float-npy", "missing", "cluster",
                                  "model", "strategy", "cap", "nics", "steps", "fill", "plot-step", "flag",
                                  "not-a-number",
                                  "json-dir", "micro-zero", "micro-empty", "json-input", "one-token",
                                  "same-outputs", "ring-grad-dtype"])
def test_bad_inputs_exit_2_with_one_line(case, lengths_file, tmp_path, capsys):
    """In-process for speed: any exception but SystemExit(2) fails the test."""
    args, fragment = _bad_inputs(tmp_path, lengths_file)[case]
    with pytest.raises(SystemExit) as exc:
        main(["--no-progress", *args])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines


def test_bad_inputs_as_a_user_sees_them(lengths_file, tmp_path):
    """Through the real entry point: one line naming the module, exit 2, no traceback."""
    cases = _bad_inputs(tmp_path, lengths_file)
    procs = {name: sim(*cases[name][0]) for name in ("negative", "flag", "cap")}
    for name, proc in procs.items():
        code, _, stderr = finish(proc)
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, (name, stderr)
        assert lines[0].startswith("megatron_zeppelin.sim: error: "), lines[0]
        assert cases[name][1] in lines[0], lines[0]


def test_progress_bar_draws_only_when_enabled():
    out = io.StringIO()
    bar = Progress(4, stream=out, enabled=True, width=8)
    bar.advance("step 0 te_cp")
    bar.advance("step 0 zeppelin")
    bar.close()
    frames = out.getvalue().split("\r")[1:]
    assert frames[0].startswith("[##------] 1/4") and "step 0 te_cp" in frames[0]
    assert frames[1].startswith("[####----] 2/4") and out.getvalue().endswith("\n")
    quiet = io.StringIO()       # StringIO is no terminal: no bar, and no line within the heartbeat
    bar = Progress(4, stream=quiet)
    bar.advance("x")
    bar.close()
    assert quiet.getvalue() == ""


def test_a_non_terminal_gets_a_progress_line_every_heartbeat():
    out = io.StringIO()
    bar = Progress(4, stream=out, heartbeat_s=0.05)
    bar.advance("step 0 flexsp")
    time.sleep(0.3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and lines[0].startswith("progress: 1/4 plans, ") and lines[0].endswith("step 0 flexsp")
    time.sleep(0.2)
    assert out.getvalue().splitlines() == lines          # closed: no more lines


def test_modeled_trace_holds_every_rank_and_replays(lengths_file, tmp_path):
    """--trace writes the modeled Chrome trace of one step: every rank of the plan
    (a TP view's ranks are TP groups), and ``sim replay`` re-times it, the same
    twice over."""
    code, _, stderr = finish(sim(*TINY, "--lengths", str(lengths_file), "--strategies", "zeppelin",
                                 "--steps", "1", "--trace", str(tmp_path / "t.json"),
                                 "--dump-plans", str(tmp_path / "plans")))
    assert code == 0, stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    world = json.loads((tmp_path / "plans" / "step0_zeppelin.json").read_text())["world_size"]
    assert doc["otherData"]["source"] == "model" and doc["otherData"]["world_size"] == world
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"} == set(range(world))
    values = []
    for _ in range(2):
        code, out, stderr = finish(subprocess.Popen(
            [sys.executable, "-m", "megatron_zeppelin.sim", "replay", str(tmp_path / "t.json"), "--cluster",
             "cpu-sim", "--model", "tiny"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        assert code == 0, stderr
        last = out.strip().splitlines()[-1]
        assert last.startswith("step_time_s=")
        values.append(float(last.split("=", 1)[1]))
    assert values[0] > 0 and values[0] == values[1]


@pytest.mark.parametrize("ring_grad_dtype, acc_itemsize", [("model", 2), ("fp32", 4)])
def test_the_ring_grad_dtype_is_recorded_in_the_json_and_the_trace(ring_grad_dtype, acc_itemsize, lengths_file,
                                                                   tmp_path, capsys):
    """--ring-grad-dtype reaches the run's record (--json config) and the modeled
    trace's engine settings (acc_itemsize: the bytes dK/dV travel in, bf16 model)."""
    main(["--no-progress", *TINY, "--lengths", str(lengths_file), "--strategies", "zeppelin", "--steps", "1",
          "--ring-grad-dtype", ring_grad_dtype, "--json", str(tmp_path / "r.json"), "--trace", str(tmp_path / "t.json")])
    capsys.readouterr()
    assert json.loads((tmp_path / "r.json").read_text())["config"]["ring_grad_dtype"] == ring_grad_dtype
    engine = json.loads((tmp_path / "t.json").read_text())["otherData"]["engine"]
    assert (engine["itemsize"], engine["acc_itemsize"]) == (2, acc_itemsize)
