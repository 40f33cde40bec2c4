"""--dump-trace: the executed timeline is the schedule the simulator times.

One trainer run on 2 x 2 ranks dumps every step's executed Chrome trace and
Plan; replaying the trace with the cost model must give exactly what the
simulator gives for the Plan (the engine ran the very ops the model times).
"""

from __future__ import annotations

import json

import pytest

from megatron_zeppelin.plan import Plan
from megatron_zeppelin.schedule import COMM
from megatron_zeppelin.schedule.trace import local_overlap, read_trace
from megatron_zeppelin.sim.cli import main as sim_main
from megatron_zeppelin.train.launch import launch
from megatron_zeppelin.train.cli import parse_args

LENGTHS = [300, 40, 20, 200, 140, 5, 12, 5, 200, 30, 5, 40, 12, 30, 30, 200, 8, 380, 64, 30, 12, 90, 200, 250]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    lengths = tmp / "lengths.txt"
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    launch(parse_args(["--nodes", "2", "--gpus-per-node", "2", "--nics-per-node", "2", "--strategy", "zeppelin",
                       "--model", "tiny", "--lengths", str(lengths), "--max-seq-len", "512",
                       "--tokens-per-gpu", "192", "--steps", "3", "--seed", "7", "--quiet", "--timeout", "60",
                       "--dump-trace", str(tmp / "traces"), "--dump-plans", str(tmp / "plans")]))
    return tmp


def _last_value(capsys) -> float:
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("step_time_s=")
    return float(last.split("=", 1)[1])


def test_trace_format_is_chrome_trace_with_op_args(dumped):
    doc = json.loads((dumped / "traces" / "step0.json").read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert events and {e["pid"] for e in events} == {0, 1, 2, 3}
    for e in events:
        assert {"name", "ph", "pid", "tid", "ts", "dur", "args"} <= set(e)
        assert {"op", "kind", "tier", "bytes", "deps"} <= set(e["args"])
        assert e["args"]["kind"] in ("compute", "comm") and e["dur"] >= 0
        assert e["args"]["tier"] in ("local", "intra", "inter", "ulysses", "remap", "linear")
    tiers = {e["args"]["tier"] for e in events}
    assert {"local", "linear", "remap"} <= tiers and tiers & {"intra", "inter"}   # the run used rings
    schedule, meta, times = read_trace(dumped / "traces" / "step0.json")
    assert meta["source"] == "executed" and meta["num_layers"] >= 1
    # every transfer spans its post on the sender to its landing on the receiver
    for op in schedule.ops:
        if op.kind == COMM:
            assert times[op.id][1] >= times[op.id][0]


@pytest.mark.parametrize("step", [0, 1, 2])
def test_replayed_trace_equals_the_simulated_plan(dumped, step, capsys):
    sim_main(["replay", str(dumped / "traces" / f"step{step}.json"), "--cluster", "cpu-sim", "--model", "tiny"])
    replayed = _last_value(capsys)
    sim_main(["--plan", str(dumped / "plans" / f"plan_{step:06d}.json"), "--cluster", "cpu-sim", "--model",
              "tiny", "--nodes", "2"])
    planned = _last_value(capsys)
    assert replayed > 0 and abs(replayed - planned) <= 0.01 * planned


def test_overlap_is_read_from_the_trace_timestamps():
    from megatron_zeppelin.schedule import Op, Schedule
    ops = (Op(0, COMM, "inter", "kv", rank=0, peer=1),
           Op(1, "compute", "local", "local_fwd", rank=0, lengths=(4,)),
           Op(2, "compute", "inter", "ring_fwd", rank=0, deps=(0,)),
           Op(3, "compute", "local", "local_fwd", rank=1, lengths=(4,)),
           Op(4, "compute", "inter", "ring_fwd", rank=1))
    sched = Schedule(2, ops)
    times = {0: (0.0, 10.0), 1: (2.0, 5.0), 2: (10.0, 12.0), 3: (11.0, 13.0), 4: (0.0, 1.0)}
    assert local_overlap(sched, times) == {0: True, 1: False}


@pytest.mark.parametrize("case, needle", [
    ("missing", "does not exist"),
    ("garbage", "is not a JSON trace"),
    ("no_send", "is a receive with no send"),
    ("world", "it ran on 2 nodes (4 ranks) but --nodes says 4"),
])
def test_bad_traces_exit_2_with_one_line(dumped, tmp_path, capsys, case, needle):
    path = tmp_path / "t.json"
    args = ["--cluster", "cpu-sim", "--model", "tiny"]
    if case == "garbage":
        path.write_text("{not json")
    elif case == "no_send":
        doc = json.loads((dumped / "traces" / "step0.json").read_text())
        sends = [e for e in doc["traceEvents"] if e.get("tid") == "send"]
        doc["traceEvents"].remove(sends[0])
        path.write_text(json.dumps(doc))
    elif case == "world":
        path = dumped / "traces" / "step0.json"
        args += ["--nodes", "4"]
    with pytest.raises(SystemExit) as exc:
        sim_main(["replay", str(path), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


@pytest.mark.parametrize("case, needle", [("missing", "does not exist"),
                                          ("world", "it ran on 2 nodes (4 ranks) but --nodes says 3")])
def test_bad_plans_exit_2_with_one_line(dumped, tmp_path, capsys, case, needle):
    path = dumped / "plans" / "plan_000000.json" if case == "world" else tmp_path / "nope.json"
    with pytest.raises(SystemExit) as exc:
        sim_main(["--plan", str(path), "--cluster", "cpu-sim", "--model", "tiny", "--nodes", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_dumped_plan_records_the_engine_it_ran_on(dumped):
    doc = json.loads((dumped / "plans" / "plan_000000.json").read_text())
    assert Plan.from_dict(doc).world_size == 4
    assert doc["engine"]["itemsize"] == 4 and doc["engine"]["nics_per_node"] == 2
