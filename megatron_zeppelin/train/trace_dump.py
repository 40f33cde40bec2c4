"""``--dump-trace``: the executed timeline of one training step as a Chrome trace.

Every rank records, per engine call (a layer's attention, a layout switch), when
each of its ops ran (``comm/lanes.py``).  Rank 0 gathers the records and lays
them onto the step schedule the simulator times (``schedule/step.py``): call
``i`` of the step is segment ``i`` of the schedule that the engine runs, and
the rank's op ``j`` of it is the segment's ``j``-th op on that rank (a rank runs
its projection of the schedule) -- anything else means the engine did not
execute the schedule, and the dump fails.  A linear op (projections, MLP,
norms) is the time between the calls around it on its rank.  A transfer spans
from its post on the sender to its landing on the receiver (one clock: all
ranks of a simulated cluster share the machine's monotonic clock).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_zeppelin.comm.lanes import StepRecorder
from megatron_zeppelin.errors import ZeppelinError
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.schedule.attention import AttnShape, Transport
from megatron_zeppelin.schedule.ops import COMM
from megatron_zeppelin.schedule.step import StepShape, remap_messages, step_schedule
from megatron_zeppelin.schedule.trace import write_trace
from megatron_zeppelin.sim.modeled_trace import engine_settings


def rank_record(recorder: StepRecorder) -> dict[str, Any]:
    """What one rank sends to rank 0 (plain data)."""
    return {"calls": [(c.ops, c.start_ns, c.end_ns, c.begin_ns, c.finish_ns) for c in recorder.calls],
            "marks": dict(recorder.marks)}


def write_step_trace(path: Path, plan: Plan, num_layers: int, hidden_size: int, attn: AttnShape,
                     transport: Transport, records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Lay every rank's record onto the step schedule and write the trace."""
    messages = remap_messages(plan)
    step = step_schedule(plan, StepShape(num_layers, attn, hidden_size, remap=bool(messages)), transport)
    ops = step.schedule.ops
    order = sorted(step.segment_offsets.items(), key=lambda kv: kv[1])
    bounds = {key: (start, order[i + 1][1] if i + 1 < len(order) else len(ops))
              for i, (key, start) in enumerate(order)}
    engine_run = [key for key, _ in order if key[2] != "linear"]
    start_ns: dict[int, int] = {}
    end_ns: dict[int, int] = {}
    on_rank = {key: _ops_by_rank(ops, *bounds[key]) for key in engine_run}
    for rank, rec in enumerate(records):
        calls = rec["calls"]
        if len(calls) != len(engine_run):
            raise ZeppelinError(f"--dump-trace: rank {rank} made {len(calls)} engine calls in the step, the "
                                f"schedule has {len(engine_run)}; the engine did not run the schedule")
        for key, (n, starts, ends, _, _) in zip(engine_run, calls):
            mine = on_rank[key].get(rank, [])
            if n != len(mine):
                raise ZeppelinError(f"--dump-trace: rank {rank}'s call for {key} ran {n} ops, the schedule's "
                                    f"segment holds {len(mine)} on it; the engine did not run the schedule")
            for local, t in starts.items():
                start_ns[mine[local]] = min(start_ns.get(mine[local], t), t)
            for local, t in ends.items():
                end_ns[mine[local]] = max(end_ns.get(mine[local], t), t)
        _linear_times(rank, rec, order, bounds, ops, start_ns, end_ns)
    missing = [op.id for op in ops if op.id not in end_ns or (op.kind == COMM and op.id not in start_ns)]
    if missing:
        raise ZeppelinError(f"--dump-trace: op(s) {missing[:8]} of the step schedule never ran; the engine "
                            "did not run the schedule")
    origin = min(start_ns.values())
    times = {oid: ((start_ns.get(oid, end_ns[oid]) - origin) / 1e3, (end_ns[oid] - origin) / 1e3)
             for oid in end_ns}
    write_trace(path, step.schedule, times, {**meta, "source": "executed", "strategy": plan.strategy,
                                             "num_layers": num_layers,
                                             "engine": engine_settings(attn, transport)})


def _ops_by_rank(ops, lo: int, hi: int) -> dict[int, list[int]]:
    """Rank -> ids of the segment's ops ``[lo, hi)`` on its lanes, in op order."""
    out: dict[int, list[int]] = {}
    for op in ops[lo:hi]:
        out.setdefault(op.rank, []).append(op.id)
        if op.kind == COMM:
            out.setdefault(op.peer, []).append(op.id)
    return out


def _linear_times(rank: int, rec: dict[str, Any], order, bounds, ops, start_ns, end_ns) -> None:
    """A linear segment on ``rank`` lasts from the end of the rank's call before it
    to the beginning of its call after it (the backward's start marks the turn
    when no call separates the last layer's forward and backward linear work)."""
    calls = iter(rec["calls"])
    last_end = None
    pending = []                                     # linear segments waiting for the next call
    for key, _ in order:
        if key[2] == "linear":
            pending.append(key)
            continue
        _, _, _, begin, finish = next(calls)
        _close(rank, pending, last_end, begin, rec["marks"], bounds, ops, start_ns, end_ns)
        pending, last_end = [], finish
    _close(rank, pending, last_end, None, rec["marks"], bounds, ops, start_ns, end_ns)


def _close(rank, pending, after, before, marks, bounds, ops, start_ns, end_ns) -> None:
    if not pending:
        return
    turn = marks.get("backward_begin")
    edges = [after] + ([turn] if len(pending) == 2 else []) + [before if before is not None else marks["step_end"]]
    for key, (a, b) in zip(pending, zip(edges, edges[1:])):
        lo, hi = bounds[key]
        for oid in range(lo, hi):
            if ops[oid].rank == rank:
                start_ns[oid], end_ns[oid] = a, b
