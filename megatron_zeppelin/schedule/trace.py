"""Chrome traces of a schedule: what ``train --dump-trace`` and ``sim --trace`` write.

The Chrome trace event format (what ``torch.profiler`` exports and Perfetto
opens): ``{"traceEvents": [{"name", "ph": "X", "pid": rank, "tid": lane, "ts":
us, "dur": us, "args": {...}}], "otherData": {...}}``.  A compute op is one event
on its rank's ``compute`` lane; a transfer is one event on the sender's ``send``
lane and one on the receiver's ``recv`` lane, both spanning post to landing.
``args`` carry the op: ``op`` (id), ``kind``, ``tier``, ``bytes``, ``deps`` and
whatever else the replay needs to re-time it (pairs, block, tokens, lengths,
nic, peer, backward, and ``call``: the engine call of a step's op, whose
transfer waves the replay takes; traces without it replay as one call).
:func:`read_trace` turns a file back into the schedule it was cut from; it
refuses, with one line, anything it cannot replay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.schedule.ops import COMM, COMPUTE, TIERS, Op, Schedule, ScheduleError

LANES = {"compute": 0, "send": 1, "recv": 2}


def trace_events(schedule: Schedule, times_us: Mapping[int, tuple[float, float]]) -> list[dict[str, Any]]:
    """Events of every op in ``times_us`` (op id -> (start, end) in microseconds)."""
    events = []
    for op in schedule.ops:
        if op.id not in times_us:
            continue
        start, end = times_us[op.id]
        args: dict[str, Any] = {"op": op.id, "kind": op.kind, "tier": op.tier, "bytes": op.nbytes,
                                "deps": list(op.deps), "backward": op.backward}
        if schedule.calls is not None:
            args["call"] = schedule.calls[op.id]
        if op.kind == COMM:
            args.update(src=op.rank, peer=op.peer, nic=op.nic)
            lanes = [(op.rank, "send"), (op.peer, "recv")]
        else:
            args.update(pairs=op.pairs, block=op.block, tokens=op.tokens, lengths=list(op.lengths))
            lanes = [(op.rank, "compute")]
        for pid, lane in lanes:
            events.append({"name": op.name, "ph": "X", "pid": pid, "tid": lane, "ts": start,
                           "dur": max(end - start, 0.0), "args": args})
    return events


def write_trace(path: str | Path, schedule: Schedule, times_us: Mapping[int, tuple[float, float]],
                meta: Mapping[str, Any]) -> None:
    """Write the trace of ``schedule``; ``meta`` goes to ``otherData`` (world size
    included), with lane names so Perfetto shows them."""
    events = trace_events(schedule, times_us)
    for rank in range(schedule.world_size):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for lane in LANES:
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lane, "args": {"name": lane}})
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {**meta, "world_size": schedule.world_size}}
    try:
        Path(path).write_text(json.dumps(doc) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write trace {str(path)!r}: {exc.strerror}; pick a writable path") from None


def read_trace(path: str | Path) -> tuple[Schedule, dict[str, Any], dict[int, tuple[float, float]]]:
    """The schedule a trace holds, its ``otherData`` and each op's executed
    (start, end) in microseconds (a transfer: its earliest start and latest end
    over both of its events)."""
    name = str(path)
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"trace {name!r} does not exist; pass a step{{k}}.json written by --dump-trace "
                          "or sim --trace") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"trace {name!r} is not a JSON trace ({exc}); pass a file written by --dump-trace "
                          "or sim --trace") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ConfigError(f"trace {name!r} has no traceEvents list; pass a Chrome trace written by "
                          "--dump-trace or sim --trace")
    meta = doc.get("otherData") if isinstance(doc.get("otherData"), dict) else {}
    world = meta.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"trace {name!r} does not say its world size (otherData.world_size); it was not "
                          "written by megatron_zeppelin")
    fields: dict[int, dict[str, Any]] = {}
    sides: dict[int, set[str]] = {}
    times: dict[int, tuple[float, float]] = {}
    for i, ev in enumerate(doc["traceEvents"]):
        if not isinstance(ev, dict) or ev.get("ph") != "X" or not isinstance(ev.get("args"), dict):
            continue
        try:
            op = _op_fields(ev)
            start, end = float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:   # OverflowError: int(inf)
            raise ConfigError(f"trace {name!r}: event {i} ({str(ev.get('name'))[:40]!r}) is malformed ({exc!r} missing or "
                              "wrong); it must carry args op, kind, tier, bytes, deps") from None
        known = fields.setdefault(op["id"], op)
        if known != op:
            raise ConfigError(f"trace {name!r}: op {op['id']} appears with two different descriptions")
        sides.setdefault(op["id"], set()).add(str(ev.get("tid")))   # str: a malformed tid may be unhashable
        s0, e0 = times.get(op["id"], (start, end))
        times[op["id"]] = (min(s0, start), max(e0, end))
    ids = sorted(fields)
    if ids != list(range(len(ids))):
        if ids and (ids[0] < 0 or ids[-1] >= 2 * len(ids)):   # never list a range an op id made up
            raise ConfigError(f"trace {name!r}: op ids run from {ids[0]} to {ids[-1]} over {len(ids)} ops; the "
                              "trace is damaged: dump it again")
        missing = sorted(set(range(ids[-1] + 1)) - set(ids))
        raise ConfigError(f"trace {name!r} lacks op(s) {missing[:8]}: the step is incomplete; dump it again")
    for oid in ids:
        if fields[oid]["kind"] == COMM and sides[oid] != {"send", "recv"}:
            what = "a receive with no send" if "send" not in sides[oid] else "a send with no receive"
            raise ConfigError(f"trace {name!r}: op {oid} ({fields[oid]['name']}) is {what}")
    calls = [fields[oid].pop("call") for oid in ids]
    try:
        schedule = Schedule(world, tuple(Op(**fields[oid]) for oid in ids),
                            calls=None if None in calls else calls)
    except ScheduleError as exc:
        raise ConfigError(f"trace {name!r}: {exc}") from None
    return schedule, meta, times


def _op_fields(ev: Mapping[str, Any]) -> dict[str, Any]:
    a = ev["args"]
    kind, tier = a["kind"], a["tier"]
    if kind not in (COMPUTE, COMM) or tier not in TIERS:
        raise ValueError(f"kind {kind!r} / tier {tier!r}")
    out = {"id": int(a["op"]), "kind": kind, "tier": tier, "name": str(ev["name"]),
           "deps": tuple(int(d) for d in a["deps"]), "nbytes": int(a["bytes"]), "backward": bool(a["backward"]),
           "call": None if a.get("call") is None else int(a["call"])}
    if kind == COMM:
        out.update(rank=int(a["src"]), peer=int(a["peer"]), nic=None if a.get("nic") is None else int(a["nic"]))
    else:
        out.update(rank=int(ev["pid"]), pairs=int(a["pairs"]), block=int(a["block"]), tokens=int(a["tokens"]),
                   lengths=tuple(int(x) for x in a["lengths"]))
    return out


def local_overlap(schedule: Schedule, times: Mapping[int, tuple[float, float]]) -> dict[int, bool]:
    """For every rank that holds both ring work and local work: whether some local
    compute of it ran while one of its ring transfers (intra- or inter-node, sent
    or received, any leg) was in flight."""
    ring_ranks: set[int] = set()
    local: dict[int, list[tuple[float, float]]] = {}
    flights: dict[int, list[tuple[float, float]]] = {}
    for op in schedule.ops:
        if op.id not in times:
            continue
        if op.kind == COMPUTE and op.tier in ("intra", "inter"):
            ring_ranks.add(op.rank)
        elif op.kind == COMPUTE and op.tier == "local":
            local.setdefault(op.rank, []).append(times[op.id])
        elif op.kind == COMM and op.tier in ("intra", "inter"):
            for r in (op.rank, op.peer):
                flights.setdefault(r, []).append(times[op.id])
    out = {}
    for r in sorted(ring_ranks & set(local)):
        out[r] = any(a0 < b1 and b0 < a1 for a0, a1 in local[r] for b0, b1 in flights.get(r, []))
    return out
