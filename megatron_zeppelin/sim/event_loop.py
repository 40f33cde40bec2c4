"""The replay's event loop (``sim/replay.py``), compiled with numba.

One function runs a whole chain of segments over flat arrays: the segments'
static data (durations, ports, dependency lists, lanes) is laid out once per
distinct segment and looked up through ``chain_seg``; what changes while the
chain runs (dependency counters, entry and exit times, each port's busy
intervals) lives in per-instance arrays.  The rules are those of the module
docstring of ``sim/replay.py``; every floating-point operation is the one the
rules name, in the order they name it, so a replay is a pure function of its
inputs, bit for bit.

The interpreter ran this loop at about 6 microseconds an event (a 64-GPU
step is millions of events); compiled, it runs it in a fraction of one.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

READY, DONE, FREE, ENTER = 0, 1, 2, 3


@njit(cache=True)
def _first_end_after(ends, t):
    """``bisect.bisect_right(ends, t)``."""
    lo, hi = 0, len(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        if t < ends[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@njit(cache=True)
def _book(starts, ends, a, b, t, dur):
    """The earliest window of ``dur`` from ``t`` on in which ports ``a`` and ``b``
    are both free; booked on both.  A port's intervals never overlap, so sorted
    by start they are sorted by end; nothing can be booked before ``t`` any
    more, so intervals that end by then are dropped."""
    for port in (a, b):
        cut = _first_end_after(ends[port], t)
        if cut:
            del starts[port][:cut]
            del ends[port][:cut]
    start = t
    clear = 0                          # ports in a row found free at ``start``
    port = a
    while clear < 2:                   # move past the interval of either port that overlaps
        s, e = starts[port], ends[port]
        i = _first_end_after(e, start)
        if i < len(e) and s[i] < start + dur:
            start = e[i]               # this port again from there, then the other
            clear = 0
        else:
            clear += 1
            port = b if port == a else a
    end = start + dur
    for port in (a, b):
        s, e = starts[port], ends[port]
        i = _first_end_after(e, start)    # after every interval that ends by ``start``
        # Touching intervals merge, so a port busy back to back is one interval
        # and a later booking jumps it in one step.
        joins_before = i > 0 and e[i - 1] == start
        joins_after = i < len(s) and s[i] == end
        if joins_before and joins_after:
            e[i - 1] = e[i]
            del s[i]
            del e[i]
        elif joins_before:
            e[i - 1] = end
        elif joins_after:
            s[i] = start
        else:
            s.insert(i, start)
            e.insert(i, end)
    return start


@njit(cache=True)
def _release(events, counter, k, op, b, sb, t, released, waiting, ready_at, entered, op_comm, op_rank, op_peer):
    """Op ``op`` of instance ``k`` becomes ready once its dependencies are done and
    its ranks have entered the instance; returns the event counter."""
    g = b + op
    if released[g] or waiting[g] != 0 or entered[k, op_rank[sb + op]] < 0:
        return counter
    if op_comm[sb + op] and entered[k, op_peer[sb + op]] < 0:
        return counter
    released[g] = True
    counter += 1
    heapq.heappush(events, (max(t, ready_at[g]), counter, READY, k, op))
    return counter


@njit(cache=True)
def run_chain(world, chain_seg, seg_base, op_comm, op_rank, op_peer, op_tier, op_sec, op_ndeps,
              users_ptr, users_idx, port_out, port_in, lane_pos, lane_width, sends_ptr, sends_idx,
              onr_ptr, onr_idx, n_tiers, n_ports):
    """Replay the chain ``chain_seg`` (segment ids) from time 0.

    Static data, per distinct segment ``s`` (op ``i`` of it at ``seg_base[s] + i``):
    ``op_*`` per op, ``users_*`` the ops depending on each op (CSR, segment-local
    ids), ``port_out``/``port_in`` a transfer's ports, ``lane_pos`` a compute
    op's place in its lane; per ``s * world + r``: ``sends_*`` rank ``r``'s send
    lane and ``onr_*`` every op on its lanes (CSR, segment-local ids).

    Returns (finish per rank, busy seconds [rank, tier], first-use order of
    each busy entry, entered [instance, rank], left [instance, rank],
    op start and end per instance op, instance base offsets, ops still
    unfinished per [instance, rank], whether each instance was entered)."""
    n_inst = len(chain_seg)
    seg_n = seg_base[1:] - seg_base[:-1]
    inst_base = np.zeros(n_inst + 1, np.int64)
    for k in range(n_inst):
        inst_base[k + 1] = inst_base[k] + seg_n[chain_seg[k]]
    total = inst_base[n_inst]

    waiting = np.empty(total, np.int64)
    for k in range(n_inst):
        b, sb = inst_base[k], seg_base[chain_seg[k]]
        for i in range(seg_n[chain_seg[k]]):
            waiting[b + i] = op_ndeps[sb + i]
    ready_at = np.zeros(total, np.float64)
    data_ready = np.zeros(total, np.bool_)
    released = np.zeros(total, np.bool_)
    op_start = np.zeros(total, np.float64)
    op_end = np.zeros(total, np.float64)
    entered = np.full((n_inst, world), -1.0)
    left = np.zeros((n_inst, world))
    remaining = np.empty((n_inst, world), np.int64)
    for k in range(n_inst):
        for r in range(world):
            j = chain_seg[k] * world + r
            remaining[k, r] = onr_ptr[j + 1] - onr_ptr[j]
    created = np.zeros(n_inst, np.bool_)
    next_send = np.zeros((n_inst, world), np.int64)

    compute_free = np.zeros(world)
    compute_busy = np.zeros(world, np.bool_)
    last_post = np.zeros(world)
    finish = np.zeros(world)
    busy = np.zeros((world, n_tiers))
    busy_order = np.full((world, n_tiers), -1, np.int64)
    n_busy = 0
    send_queue = np.empty((world, n_inst), np.int64)     # segments with unposted sends, in order
    sq_head = np.zeros(world, np.int64)
    sq_tail = np.zeros(world, np.int64)

    events = [(0.0, 0, 0, 0, 0)]            # (time, order, kind, instance, op or rank)
    events.pop()
    compute_heap = [[(0, 0)] for _ in range(world)]     # per rank: (instance x lane width + lane pos, op)
    for h in compute_heap:
        h.pop()
    starts = [[0.0] for _ in range(n_ports)]
    ends = [[0.0] for _ in range(n_ports)]
    for p in range(n_ports):
        starts[p].pop()
        ends[p].pop()
    counter = 0

    # Every rank enters segment 0 at time 0, rank by rank, before any other event
    # (orders below 1).  Entering walks a rank through the segments it has no op in.
    for r0 in range(world):
        heapq.heappush(events, (0.0, r0 - world, ENTER, 0, r0))

    while events:
        t, _, kind, k, what = heapq.heappop(events)
        if kind == FREE:
            r = what
            compute_busy[r] = False
        elif kind == ENTER:
            r = what
            while k < n_inst:
                created[k] = True
                entered[k, r] = t
                s = chain_seg[k]
                j = s * world + r
                if onr_ptr[j + 1] > onr_ptr[j]:
                    if sends_ptr[j + 1] > sends_ptr[j]:
                        send_queue[r, sq_tail[r]] = k
                        sq_tail[r] += 1
                    b, sb = inst_base[k], seg_base[s]
                    for x in range(onr_ptr[j], onr_ptr[j + 1]):     # a transfer needs both ends entered
                        counter = _release(events, counter, k, onr_idx[x], b, sb, t, released, waiting,
                                           ready_at, entered, op_comm, op_rank, op_peer)
                    break
                left[k, r] = t                    # nothing of ours here: pass straight through
                k += 1
            if k >= n_inst:
                finish[r] = t
            continue
        elif kind == READY:
            s = chain_seg[k]
            sb = seg_base[s]
            g = inst_base[k] + what
            r = op_rank[sb + what]
            if op_comm[sb + what]:
                data_ready[g] = True
                # post this rank's sends that are due, in lane order across segments
                while sq_head[r] < sq_tail[r]:
                    kq = send_queue[r, sq_head[r]]
                    jq = chain_seg[kq] * world + r
                    sbq = seg_base[chain_seg[kq]]
                    bq = inst_base[kq]
                    lane_lo, lane_hi = sends_ptr[jq], sends_ptr[jq + 1]
                    while (lane_lo + next_send[kq, r] < lane_hi
                           and data_ready[bq + sends_idx[lane_lo + next_send[kq, r]]]):
                        op = sends_idx[lane_lo + next_send[kq, r]]
                        next_send[kq, r] += 1
                        post = max(t, last_post[r])
                        last_post[r] = post
                        dur = op_sec[sbq + op]
                        start = _book(starts, ends, port_out[sbq + op], port_in[sbq + op], post, dur)
                        end = start + dur
                        op_start[bq + op] = start
                        op_end[bq + op] = end
                        counter += 1
                        heapq.heappush(events, (end, counter, DONE, kq, op))
                    if lane_lo + next_send[kq, r] < lane_hi:
                        break
                    sq_head[r] += 1
                continue
            heapq.heappush(compute_heap[r], (k * lane_width + lane_pos[sb + what], what))
        else:                                                    # DONE
            s = chain_seg[k]
            sb = seg_base[s]
            b = inst_base[k]
            for x in range(users_ptr[sb + what], users_ptr[sb + what + 1]):
                u = users_idx[x]
                waiting[b + u] -= 1
                if ready_at[b + u] < t:
                    ready_at[b + u] = t
                counter = _release(events, counter, k, u, b, sb, t, released, waiting, ready_at, entered,
                                   op_comm, op_rank, op_peer)
            ends_of = (op_rank[sb + what], op_peer[sb + what]) if op_comm[sb + what] \
                else (op_rank[sb + what], -1)
            for r in ends_of:
                if r < 0:
                    continue
                remaining[k, r] -= 1
                if remaining[k, r] == 0:
                    left[k, r] = t
                    counter += 1
                    heapq.heappush(events, (t, counter, ENTER, k + 1, r))
            continue
        # FREE, or a compute op became ready: start the rank's next compute op
        if compute_busy[r] or not compute_heap[r]:
            continue
        key, op = heapq.heappop(compute_heap[r])
        k = key // lane_width
        sb = seg_base[chain_seg[k]]
        t = max(t, compute_free[r])
        dur = op_sec[sb + op]
        compute_busy[r] = True
        compute_free[r] = t + dur
        tier = op_tier[sb + op]
        if busy_order[r, tier] < 0:
            busy_order[r, tier] = n_busy
            n_busy += 1
        busy[r, tier] += dur
        g = inst_base[k] + op
        op_start[g] = t
        op_end[g] = t + dur
        counter += 1
        heapq.heappush(events, (t + dur, counter, DONE, k, op))
        counter += 1
        heapq.heappush(events, (t + dur, counter, FREE, -1, r))
    return finish, busy, busy_order, entered, left, op_start, op_end, inst_base, remaining, created
