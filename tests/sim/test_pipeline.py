"""The simulator's pipeline model (``sim/pipeline.py``) and ``sim --pp``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.sim.pipeline import (MicroBatchWork, ends_light_order, ideal_bubble, one_f_one_b_order,
                                            pipeline_order, pipeline_step, replay_1f1b, stage_memory,
                                            stage_parameters)
from megatron_zeppelin.topology import load_cluster
from tests.sim.test_cli import REPO, TINY, finish, lengths_file, sim  # noqa: F401  (lengths_file: fixture)


def _uniform(stages: int, micro: int, f: float = 1.0, b: float = 2.0):
    return np.full((stages, micro), f), np.full((stages, micro), b)


def test_order_is_megatrons_1f1b():
    """Stage s runs min(P - s - 1, M) warm-up forwards, then forward/backward pairs,
    then the remaining backwards; every micro-batch once each way."""
    for stages, micro in ((4, 6), (4, 2), (2, 4)):
        for s in range(stages):
            order = one_f_one_b_order(s, stages, micro)
            warmup = min(stages - s - 1, micro)
            assert order[:warmup] == [("F", m) for m in range(warmup)]
            assert sorted(order) == sorted([("F", m) for m in range(micro)] + [("B", m) for m in range(micro)])
            assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(micro))
    assert one_f_one_b_order(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]


def test_equal_micro_batches_give_the_textbook_bubble():
    for stages, micro in ((2, 4), (4, 8), (8, 8)):
        r = replay_1f1b(*_uniform(stages, micro), [0.0] * micro)
        assert r.makespan_s == pytest.approx((micro + stages - 1) * 3.0)
        assert r.bubble == pytest.approx(ideal_bubble(stages, micro))


def test_transfers_sit_on_the_critical_path():
    """P 2, M 4, f 1, b 2, 0.5 s per crossing, worked by hand: stage 1's B0 ends at
    4.5, stage 0's B0 runs 5-7, F2 7-8, B1 8-10, F3 10-11, B2 12-14, B3 15-17."""
    assert replay_1f1b(*_uniform(2, 4), [0.5] * 4).makespan_s == pytest.approx(17.0)


def test_micro_batches_of_different_time_widen_the_bubble():
    """One micro-batch four times the others' stalls every stage behind it; over
    random orders of log-normal times the bubble exceeds that of equal
    micro-batches of the same total work, every time."""
    stages, micro = 4, 8
    times = np.array([1, 1, 1, 4, 1, 1, 1, 1], dtype=float)
    varied = replay_1f1b(np.tile(times, (stages, 1)), np.tile(2 * times, (stages, 1)), [0.0] * micro)
    equal = replay_1f1b(*_uniform(stages, micro, times.mean(), 2 * times.mean()), [0.0] * micro)
    assert varied.busy_s == pytest.approx(equal.busy_s)
    assert varied.bubble > equal.bubble + 0.05
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.lognormal(0, 0.6, micro)
        r = replay_1f1b(np.tile(w, (stages, 1)), np.tile(2 * w, (stages, 1)), [0.0] * micro)
        assert r.bubble > replay_1f1b(*_uniform(stages, micro, w.mean(), 2 * w.mean()), [0.0] * micro).bubble


def test_stage_memory_and_parameters():
    model = load_model("llama-70b")
    assert model.num_parameters == pytest.approx(68.98e9, rel=1e-3)   # Llama-2-70B
    assert sum(stage_parameters(model, s, 8) for s in range(8)) == pytest.approx(model.num_parameters)
    cost = CostModel(load_cluster("h200-8x400g", nodes=2), model)
    works = [MicroBatchWork((1.0,) * 4, (2.0,) * 4, 0.0, tuple([1000 * (m + 1)] * 16)) for m in range(6)]
    memory = stage_memory(works, cost, 4)
    assert [m.in_flight for m in memory] == [4, 3, 2, 1]
    per_token = model.activation_bytes_per_token / 4
    # Stage 0 keeps the heaviest 4 consecutive micro-batches: 3000 + 4000 + 5000 + 6000 tokens.
    assert memory[0].activations == pytest.approx(18000 * per_token)
    assert memory[3].activations == pytest.approx(6000 * per_token)
    params = stage_parameters(model, 1, 4)
    assert memory[1].weights == pytest.approx(2 * params) and memory[1].gradients == pytest.approx(4 * params)
    assert memory[1].optimizer == pytest.approx(12 * params / 16)
    step = pipeline_step(works, cost, 4)
    assert step.step_s > step.replay.makespan_s > 0   # the largest stage's gradient sync after the pipeline
    assert step.replay.bubble == pytest.approx(step.equal.bubble)   # equal times: nothing to lose


def test_sim_pp_prints_bubble_and_memory_per_stage(tmp_path):
    lengths = tmp_path / "lens.npy"
    rng = np.random.default_rng(7)
    np.save(lengths, rng.permutation(np.concatenate([rng.integers(64, 2048, 300), rng.integers(4096, 16000, 12)])))
    code, out, err = finish(sim(*TINY, "--lengths", str(lengths), "--pp", "2", "--micro-batches", "4",
                                "--tokens-per-gpu", "8192", "--strategies", "te_cp,zeppelin", "--json", str(tmp_path / "r.json")))
    assert code == 0, err
    assert "as PP 2: stages of 2 nodes, each plan over 4 GPUs" in out
    assert "(P-1)/(M+P-1) = 20.0% at M = 4" in out
    assert "stage 0 (2 in flight)" in out and "stage 1 (1 in flight)" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"]["pipeline_parallel"] == 2 and doc["config"]["world_size"] == 4
    for name in ("te_cp", "zeppelin"):
        r = doc["strategies"][name]
        assert r["feasible"] and len(r["step_times_s"]) == 2 and all(0 < b < 1 for b in r["bubble"])
        assert [m["in_flight"] for m in r["memory_per_stage"]] == [2, 1]


@pytest.mark.parametrize("args, message", [
    (("--pp", "3", "--micro-batches", "3"), "--pp 3 does not divide --nodes 4"),
    (("--pp", "2", "--micro-batches", "1"), "--micro-batches 1 is fewer than the 2 pipeline stages"),
    (("--pp", "4", "--micro-batches", "4"), "--pp 4 does not divide model tiny's 2 layers"),
    (("--pp", "0"), "--pp must be >= 1"),
])
def test_sim_pp_bad_inputs_exit_2_with_one_line(args, message):
    code, out, err = finish(sim(*TINY, *args))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_pp_search_keeps_the_batches_and_pp1_is_the_plain_simulator(tmp_path, lengths_file):
    """``--pp 1,2``: both sizes train the same global batches (PP 2 in twice the
    micro-batches); at PP 1 the replay is the simulator's own step, to rounding
    (the 1F1B replay adds the micro-batches' times in its own order: one ulp
    apart on this sample since the baselines' layouts joined the decision's
    candidates); the tuned table keeps each strategy's fastest size that fits."""
    common = (*TINY, "--lengths", str(lengths_file), "--tokens-per-gpu", "8192", "--strategies", "te_cp,zeppelin")
    code, out, err = finish(sim(*common, "--pp", "1,2", "--micro-batches", "2", "--json", str(tmp_path / "pp.json")))
    assert code == 0, err
    code, _, err = finish(sim(*common, "--micro-batches", "2", "--json", str(tmp_path / "plain.json")))
    assert code == 0, err
    pp, plain = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("pp", "plain"))
    one, two = pp["layouts"]["1"], pp["layouts"]["2"]
    assert one["config"]["tokens_per_batch"] == two["config"]["tokens_per_batch"] == plain["config"]["tokens_per_batch"]
    assert (one["config"]["micro_batches"], two["config"]["micro_batches"]) == (2, 4)
    for name in ("te_cp", "zeppelin"):
        assert one["strategies"][name]["step_times_s"] == pytest.approx(plain["strategies"][name]["step_times_s"],
                                                                        rel=1e-12, abs=0)
        assert one["strategies"][name]["bubble"] == pytest.approx([0.0] * 2, abs=1e-12)
        best = min((1, 2), key=lambda p: pp["layouts"][str(p)]["strategies"][name]["step_time_s"])
        assert pp["tuned"][name]["pp"] == best and pp["tuned"][name]["fits"]
    assert "tuned on 4 nodes, the same global batches at every PP" in out


def test_pp_search_sizes_must_share_the_global_batch():
    code, _, err = finish(sim(*TINY, "--pp", "2,3", "--micro-batches", "2"))
    assert code == 2 and "every size must be a multiple of the smallest (2)" in err, err


def test_full_recompute_trades_memory_for_a_second_forward(tmp_path, lengths_file):
    model = load_model("llama-70b")
    cost = CostModel(load_cluster("h200-8x400g", nodes=2), model)
    works = [MicroBatchWork((1.0,) * 4, (2.0,) * 4, 0.0, tuple([1000 * (m + 1)] * 16)) for m in range(6)]
    kept = stage_memory(works, cost, 4, recompute=True)
    # Layer inputs of the 4 micro-batches in flight, plus one layer's activations of the largest.
    assert kept[0].activations == pytest.approx(18000 * model.hidden_bytes_per_token * 20
                                                + 6000 * model.activation_bytes_per_token / 80)
    assert kept[0].activations < stage_memory(works, cost, 4)[0].activations / 10
    steps = {}
    for recompute in ("none", "full"):
        code, _, err = finish(sim(*TINY, "--lengths", str(lengths_file), "--tokens-per-gpu", "8192", "--pp", "2",
                                  "--micro-batches", "2", "--strategies", "zeppelin", "--recompute", recompute,
                                  "--json", str(tmp_path / f"{recompute}.json")))
        assert code == 0, err
        steps[recompute] = json.loads((tmp_path / f"{recompute}.json").read_text())["strategies"]["zeppelin"]
    assert steps["full"]["step_time_s"] > steps["none"]["step_time_s"]
    assert steps["full"]["memory_per_stage"][0]["activations"] < steps["none"]["memory_per_stage"][0]["activations"]


def test_pp_search_goes_on_without_a_size_the_stage_cannot_hold(tmp_path, lengths_file):
    """At PP 4 a stage of one node (2 GPUs x 4096 tokens) cannot hold a 16K
    sequence: the search says so and keeps PP 2."""
    model = tmp_path / "tiny4.yaml"
    model.write_text((REPO / "configs/models/tiny.yaml").read_text().replace("num_layers: 2", "num_layers: 4"))
    code, out, err = finish(sim(*TINY, "--lengths", str(lengths_file), "--pp", "2,4", "--micro-batches", "2",
                                "--model", str(model), "--strategies", "zeppelin", "--json", str(tmp_path / "r.json")))
    assert code == 0, err
    assert ("PP 4: not simulated: --max-seq-len 16384 is longer than the cluster can hold "
            "(2 GPUs x 4096 tokens per GPU = 8192)") in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert list(doc["layouts"]) == ["2"] and "4" in doc["not_simulated"] and doc["tuned"]["zeppelin"]["pp"] == 2


def test_lightest_at_the_ends_shortens_the_pipeline():
    """ends_light_order puts the heaviest micro-batches in the middle; on the
    llama-70b PP 4 shape (three micro-batches of one 128K sequence, twice the
    others) and over random log-normal times it shortens 1F1B against the given
    order; pipeline_order keeps the given order where that replays shorter."""
    assert ends_light_order([3.0, 1.0, 2.0, 5.0, 4.0]) == [1, 0, 3, 4, 2]   # times 1, 3, 5 to the front; 4, 2 back
    assert ends_light_order([1.0, 1.0, 1.0]) == [0, 2, 1]                   # ties: index order

    def makespan(times, stages=4, transfer=0.04):
        t = np.array(times) / stages
        return replay_1f1b(np.tile(t / 3, (stages, 1)), np.tile(2 * t / 3, (stages, 1)), [transfer] * len(t)).makespan_s

    split = [15.6, 15.6, 15.6, 7.7, 7.7, 7.7, 7.7, 7.7]
    ordered = [split[i] for i in pipeline_order(split, 4)]
    assert sorted(ordered[:3] + ordered[-2:]) == [7.7] * 5 and ordered[3:6] == [15.6] * 3
    assert makespan(ordered) < 0.95 * makespan(split)
    rng = np.random.default_rng(1)
    gains = []
    for _ in range(30):
        w = list(rng.lognormal(0, 0.5, 8))
        gains.append(makespan([w[i] for i in pipeline_order(w, 4)], transfer=0) / makespan(w, transfer=0))
    assert np.mean(gains) < 0.9 and max(gains) <= 1.0 + 1e-9   # never longer than the given order (its own model)
    # Light ends already: lightest-at-the-ends would replay longer, the given order stays.
    given = [1.0, 2.2, 1.3, 0.8]
    assert ends_light_order(given) == [3, 2, 1, 0] and pipeline_order(given, 2) == [0, 1, 2, 3]


def test_pp_alone_runs_one_micro_batch_per_stage(lengths_file):
    code, out, err = finish(sim(*TINY, "--lengths", str(lengths_file), "--tokens-per-gpu", "8192", "--pp", "2",
                                "--strategies", "zeppelin"))
    assert code == 0, err
    assert "2 steps of 2 micro-batches" in out and "stage 1 (1 in flight)" in out


def test_megatron_packing_schedulers_run_under_pp_with_their_own_micro_batches(tmp_path, lengths_file):
    """``sim --pp 2`` runs Megatron-LM's dynamic CP and its dp_balanced baseline: each
    re-packs the whole global batch (not the --micro-batches split) and its
    micro-batches are the pipeline's, as many as its scheduler makes."""
    code, out, err = finish(sim(*TINY, "--lengths", str(lengths_file), "--tokens-per-gpu", "8192", "--pp", "2",
                                "--micro-batches", "2", "--strategies",
                                "te_cp,megatron_dp_balanced,megatron_dynamic_cp,zeppelin",
                                "--json", str(tmp_path / "r.json")))
    assert code == 0, err
    doc = json.loads((tmp_path / "r.json").read_text())
    for name in ("megatron_dp_balanced", "megatron_dynamic_cp"):
        r = doc["strategies"][name]
        assert r["feasible"] and all(0 < b < 1 for b in r["bubble"]), (name, r["error"])
    from megatron_zeppelin.planner.dynamic_cp import dynamic_cp_micro_batches
    from megatron_zeppelin.sim.pipeline_report import simulate_strategy
    from megatron_zeppelin.sim.simulate import build_strategies, sample_batches
    cost = CostModel(load_cluster("cpu-sim", nodes=2), load_model("tiny"))
    [s] = build_strategies(["megatron_dynamic_cp"], cost, cp_size=1)
    batches = sample_batches(np.load(lengths_file), max_seq_len=16384, tokens_per_batch=4 * 8192 * 4, steps=2)
    halves = lambda lens: [list(range(0, len(lens), 2)), list(range(1, len(lens), 2))]   # noqa: E731
    args = __import__("argparse").Namespace(tokens_per_gpu=8192, flexsp_time_limit=1.0, recompute="none")
    r = simulate_strategy(s, batches, halves, 2, args)
    assert r.error is None
    assert [step.micro_batches for step in r.steps] == [len(dynamic_cp_micro_batches(b, 8192, 4)) for b in batches]
    assert all(step.micro_batches > 2 for step in r.steps)     # more than the split's two halves


def test_hybrid_cp_is_refused_under_pp_as_megatron_core_refuses_it(tmp_path, lengths_file):
    """Megatron-Core 0.16 asserts PP 1 with --hybrid-context-parallel: at PP 2 the
    strategy is infeasible with that reason, at PP 1 it runs."""
    code, out, err = finish(sim(*TINY, "--lengths", str(lengths_file), "--tokens-per-gpu", "8192", "--pp", "1,2",
                                "--micro-batches", "2", "--strategies", "te_cp,megatron_hybrid_cp",
                                "--json", str(tmp_path / "r.json")))
    assert code == 0, err
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["layouts"]["1"]["strategies"]["megatron_hybrid_cp"]["feasible"]
    assert "refuses --hybrid-context-parallel with pipeline parallelism" in \
        doc["layouts"]["2"]["strategies"]["megatron_hybrid_cp"]["error"]
    assert doc["tuned"]["megatron_hybrid_cp"]["pp"] == 1


def test_under_pp_the_layout_search_keeps_the_fastest_layout_that_fits():
    """LLaMA-7B at 16K tokens per GPU, PP 2 on 4 H100 nodes: TP 1 is Zeppelin's
    fastest layout but its first stage needs more than 80 GiB; the search under
    PP keeps TP 2, which fits (before, the tuned table fell back to PP 4 at TP 1
    and showed Zeppelin 0.87x te_cp).  No layout fitting: the fastest.  The batch
    (three long documents, nine short) has TP 1 1.3 % ahead of TP 2 under the
    lanes replay (5236 against 5307 ms); the earlier batch's 0.06 % was a tie."""
    from megatron_zeppelin.cost.tp import tp_view
    from megatron_zeppelin.sim.pipeline import fits_memory
    from megatron_zeppelin.sim.rounds import timed_batch
    from megatron_zeppelin.sim.static_layout import choose_layout
    from megatron_zeppelin.sim.strategy import Strategy, plan_context
    from megatron_zeppelin.planner.base import get_planner

    cost = CostModel(load_cluster("h100-8x400g", nodes=2), load_model("llama-7b"), routing=True)
    lens = [131072, 65536, 32768] + [3000] * 9            # 256K tokens: 16 GPUs x 16K x 0.98
    args = dict(max_seq_len=131072, tokens_per_gpu=16384)
    fits = fits_memory(stages=2, micro_batches=2)
    free = choose_layout("zeppelin", cost, [lens], **args)
    assert free.layout.tp == 1
    planner = get_planner("zeppelin")
    timed = {tp: timed_batch(planner, lens, plan_context(Strategy("zeppelin", planner, view, tp_size=tp), 16384, 1.0))
             for tp, view in ((1, cost), (2, tp_view(cost, 2)))}
    assert not fits(cost, timed[1]) and fits(tp_view(cost, 2), timed[2])
    kept = choose_layout("zeppelin", cost, [lens], **args, fits=fits)
    assert kept.layout.tp == 2 and "TP=1" in kept.report and "(over memory)" in kept.report
    assert choose_layout("zeppelin", cost, [lens], **args, fits=lambda view, t: False).layout == free.layout
