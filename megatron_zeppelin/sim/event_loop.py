"""The replay's event loop (``sim/replay.py``), compiled with numba.

One function runs a whole chain of segments over flat arrays: the segments'
static data (durations, ports, dependency lists, lanes) is laid out once per
distinct segment and looked up through ``chain_seg``; what changes while the
chain runs (dependency counters, entry and exit times, the heaps, when each
port is free) lives in arrays sized for the whole chain up front, so nothing
is allocated while it runs.  The rules are those of the module docstring of
``sim/replay.py``; every floating-point operation is the one the rules name,
in the order they name it, so a replay is a pure function of its inputs, bit
for bit.

Events are ordered by (time, push order), a total order, so any correct
queue pops them in the same sequence, and leaving out an event that changes
nothing leaves the others' order alone.  Only an op's end lies ahead of the
event that schedules it; an op becoming ready, a batch being posted, a
transfer landing with the rest of its batch and a rank entering a segment
happen at the instant that causes them.  So ends go to a sorted list of
pending ends (``_pend``), and the others to a FIFO of the current instant,
which holds the latest orders at that time: the next event is the first of the
two by (time, order).  An op that ends frees
its rank's compute lane at the same instant, right after its dependants are
released (nothing can come between the two: no other event has that time and
an order in between).

A transfer takes two orders when it starts (its move ending on its sender's
batch, then on its receiver's), but only a batch's last move does anything:
the pending ends get that one, under its order, once every transfer of the
batch has started.  So they hold at most one event per slot -- a rank's compute op
in flight, the batch in flight on each of its two lanes -- keyed (time, order
<< sbits | slot), the event itself in the slot's entry; a transfer end with no
dependant on its rank queues no landing.  An event is one int64: (instance
<< wbits | what) << 3 | kind.

A replay's state is one tuple of arrays (``_start``), which ``_run`` advances;
chains that begin with the same instances share that start.  One compiled
call replays all the chains of a ``run_chains`` (``_replay``), so no state
crosses into Python: it returns their results stacked.
The helpers the loop calls per event take arrays and are compiled without
reference counting (``_nrt=False``): numba counts an array argument's
references with an atomic add and subtract on every call, a fifth of the loop's
time before (hybrid CP's 64-GPU chain, 0.70 -> 0.57 ms with the pending ends
still a heap).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from megatron_zeppelin.pair_heap import key_pop, key_push

READY, DONE, ENTER, POST, MOVED, LANDED = 0, 1, 2, 3, 4, 5


@njit(cache=True, _nrt=False)
def _pend(end_t, end_c, n, t, c):
    """Add the end (``t``, ``c``) to the ``n`` pending ends ``end_t/end_c[:n]``,
    kept sorted latest first (the next one last); returns their new count.

    An insertion step, not a heap: a new end lies behind about a third of the
    pending ones (on a 64-GPU step), so moving those is cheaper than a binary
    heap's pop, whose every level is a hard-to-predict branch (hybrid CP's
    64-GPU 4-layer chain: 0.57 -> 0.44-0.50 ms).  The keys are unique, so the
    sequence of ends taken is the same as a heap's."""
    j = n - 1
    while j >= 0 and (end_t[j] < t or (end_t[j] == t and end_c[j] < c)):
        end_t[j + 1], end_c[j + 1] = end_t[j], end_c[j]
        j -= 1
    end_t[j + 1], end_c[j + 1] = t, c
    return n + 1


@njit(cache=True, _nrt=False)
def _soon(now_c, now_ev, tail, counter, sbits, ev):
    """Queue event ``ev`` (packed by ``_event``) at the current instant; returns
    the FIFO's new tail and the event counter."""
    counter += 1
    now_c[tail], now_ev[tail] = counter << sbits, ev
    return tail + 1, counter


@njit(cache=True, _nrt=False)
def _done(remaining, left, k, r, n, t, now_c, now_ev, tail, counter, sbits, wbits):
    """``n`` more ops of rank ``r`` in instance ``k`` are done; the last one lets
    the rank enter the next instance now.  Returns the FIFO's tail and the counter."""
    remaining[k, r] -= n
    if remaining[k, r] == 0:
        left[k, r] = t
        return _soon(now_c, now_ev, tail, counter, sbits, ((k + 1) << wbits | r) << 3 | ENTER)
    return tail, counter


@njit(cache=True)
def _start(world, chain_seg, seg_base, op_comm, op_rank, op_peer, op_tier, op_sec, op_ndeps,
           users_ptr, users_idx, port_out, port_in, lane_pos, lane_width, onr_ptr, onr_idx,
           op_lane, op_lands, op_bsend, op_brecv, bat_base, bat_ptr, bat_idx, bat_need, rl_ptr, n_tiers, n_ports,
           record):
    """The state of a replay of the chain ``chain_seg`` (segment ids) at time 0,
    every rank about to enter its first instance.

    Static data, per distinct segment ``s`` (op ``i`` of it at ``seg_base[s] + i``):
    ``op_*`` per op, ``users_*`` the ops depending on each op (CSR, segment-local
    ids), ``port_out``/``port_in`` a transfer's ports, ``lane_pos`` a compute
    op's place in its lane; per ``s * world + r``: ``onr_*`` every op on rank
    ``r``'s lanes, its compute lane first (CSR, segment-local ids).  Batches
    (ids global over the distinct segments, segment ``s``'s from ``bat_base[s]``):
    ``op_lane`` a transfer's lane, ``op_lands`` which of its ends (bit 0: the
    sender's, bit 1: the receiver's) has dependants on its rank,
    ``op_bsend``/``op_brecv`` its batch at its
    sender and at its receiver, ``bat_*`` each batch's transfers (CSR,
    segment-local op ids) and how many of them its rank sends, and per
    ``(s * world + r) * 2 + lane`` the rank's batches on that lane in order
    (``rl_ptr``, a range of batch ids).

    :func:`_run` runs it (see :func:`_replay` for the results)."""
    n_inst = len(chain_seg)
    inst_base = np.zeros(n_inst + 1, np.int64)
    inst_bat = np.zeros(n_inst + 1, np.int64)     # each instance's first batch
    lane_cap = np.zeros(world, np.int64)        # ops per rank over the chain: room for its ready compute ops
    for k in range(n_inst):
        s = chain_seg[k]
        inst_base[k + 1] = inst_base[k] + seg_base[s + 1] - seg_base[s]
        inst_bat[k + 1] = inst_bat[k] + bat_base[s + 1] - bat_base[s]
        for r in range(world):
            lane_cap[r] += onr_ptr[s * world + r + 1] - onr_ptr[s * world + r]
    total = inst_base[n_inst]
    total_bat = inst_bat[n_inst]
    # An event is packed as (instance << wbits | what) << 3 | kind.
    widest = world
    for s in range(len(seg_base) - 1):
        widest = max(widest, 2 * (seg_base[s + 1] - seg_base[s]), bat_base[s + 1] - bat_base[s])
    wbits = 1
    while (1 << wbits) <= widest:
        wbits += 1

    waiting = np.empty(total, np.int64)
    for k in range(n_inst):
        sb = seg_base[chain_seg[k]]
        waiting[inst_base[k]:inst_base[k + 1]] = op_ndeps[sb:sb + inst_base[k + 1] - inst_base[k]]
    posted_ends = np.zeros(total, np.int64)     # a transfer's ends whose batch is posted (0, 1, 2)
    op_start = np.zeros(total if record else 0)
    op_end = np.zeros(total if record else 0)
    # Per instance batch: sends whose data is not there yet, transfers not yet
    # started, and the (end, order) of the last to move among those started.
    need = np.empty(total_bat, np.int64)
    unstarted = np.empty(total_bat, np.int64)
    for k in range(n_inst):
        bb = bat_base[chain_seg[k]]
        need[inst_bat[k]:inst_bat[k + 1]] = bat_need[bb:bb + inst_bat[k + 1] - inst_bat[k]]
        for b in range(inst_bat[k + 1] - inst_bat[k]):
            unstarted[inst_bat[k] + b] = bat_ptr[bb + b + 1] - bat_ptr[bb + b]
    last_t = np.full(total_bat, -np.inf)
    last_c = np.zeros(total_bat, np.int64)
    last_ev = np.zeros(total_bat, np.int64)
    entered = np.full((n_inst, world), -1.0)
    left = np.zeros((n_inst, world))
    remaining = np.empty((n_inst, world), np.int64)
    for k in range(n_inst):
        for r in range(world):
            j = chain_seg[k] * world + r
            remaining[k, r] = onr_ptr[j + 1] - onr_ptr[j]
    created = np.zeros(n_inst, np.bool_)
    # Per rank and lane: the instance batch it posts next (or posted, until it is
    # done), and the end of its batches in the instance it is in.
    cursor = np.full(2 * world, -1, np.int64)
    cursor_end = np.full(2 * world, -1, np.int64)

    compute_free = np.zeros(world)
    compute_busy = np.zeros(world, np.bool_)
    finish = np.zeros(world)
    busy = np.zeros((world, n_tiers))
    busy_order = np.full((world, n_tiers), -1, np.int64)
    n_busy = 0
    lbits = 0                        # a lane key is instance << lbits | lane position
    while (1 << lbits) < lane_width:
        lbits += 1
    # Per rank, a heap of ready compute ops keyed by instance x lane width + lane position.
    lane_heap = np.empty(max(lane_cap.sum(), 1), np.int64)
    lane_base = np.zeros(world, np.int64)
    for r in range(1, world):
        lane_base[r] = lane_base[r - 1] + lane_cap[r - 1]
    lane_n = np.zeros(world, np.int64)
    port_free = np.zeros(n_ports)       # when each port has carried every transfer charged to it

    # Events in the future are a rank's compute op ending and the last move of
    # a rank's batch on each lane: at most one each per rank at a time, so the
    # pending ends hold (time, order << sbits | slot) and the event sits at its slot.
    # The current instant's events are a FIFO of (order << sbits, event).
    # Each op is ready once and done once (a transfer: two orders when it
    # starts, done on each end once), each instance batch is posted once, each
    # (instance, rank) entered once: that bounds the FIFO.
    sbits = 2
    while (1 << sbits) < 3 * world:
        sbits += 1
    slots = 1 << sbits
    end_t = np.empty(slots)
    end_c = np.empty(slots, np.int64)
    slot_ev = np.empty(slots, np.int64)
    n_events = 0
    cap = 3 * total + total_bat + (n_inst + 1) * world + 1
    now_c = np.empty(cap, np.int64)
    now_ev = np.empty(cap, np.int64)
    now_head = now_tail = 0
    counter = 0
    for r in range(world):           # every rank enters segment 0 at time 0, rank by rank
        now_tail, counter = _soon(now_c, now_ev, now_tail, counter, sbits, r << 3 | ENTER)
    return (inst_base, inst_bat, waiting, posted_ends, op_start, op_end, need, unstarted, last_t,
            last_c, last_ev, entered, left, remaining, created, cursor, cursor_end, compute_free, compute_busy,
            finish, busy, busy_order, lane_heap, lane_base, lane_n, port_free, end_t, end_c, slot_ev, now_c,
            now_ev, np.array([0.0]), np.array([n_events, now_head, now_tail, counter, n_busy, wbits, sbits, lbits]))


@njit(cache=True)
def _run(state, world, chain_seg, seg_base, op_comm, op_rank, op_peer, op_tier, op_sec, op_ndeps,
         users_ptr, users_idx, port_out, port_in, lane_pos, lane_width, onr_ptr, onr_idx,
         op_lane, op_lands, op_bsend, op_brecv, bat_base, bat_ptr, bat_idx, bat_need, rl_ptr, n_tiers, n_ports,
         record, stop):
    """Run the replay in ``state`` until no event is left, or (``stop`` > 0)
    until the next event is the first to touch an instance from ``stop`` on:
    then it returns True, that event not taken, and ``state`` is where every
    chain that runs the same first ``stop`` instances stands at that point."""
    (inst_base, inst_bat, waiting, posted_ends, op_start, op_end, need, unstarted, last_t,
     last_c, last_ev, entered, left, remaining, created, cursor, cursor_end, compute_free, compute_busy,
     finish, busy, busy_order, lane_heap, lane_base, lane_n, port_free, end_t, end_c, slot_ev, now_c,
     now_ev, clock, ints) = state
    n_events, now_head, now_tail, counter, n_busy, wbits, sbits, lbits = (
        ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6], ints[7])
    n_inst = len(chain_seg)
    wmask = (1 << wbits) - 1
    slots = 1 << sbits
    t = clock[0]
    paused = False
    # Per instance: its segment's first op and first batch, and its batches' offset from there.
    inst_sb = np.empty(n_inst, np.int64)
    inst_bb = np.empty(n_inst, np.int64)
    inst_boff = np.empty(n_inst, np.int64)
    for k in range(n_inst):
        inst_sb[k] = seg_base[chain_seg[k]]
        inst_bb[k] = bat_base[chain_seg[k]]
        inst_boff[k] = inst_bat[k] - inst_bb[k]

    while n_events or now_head < now_tail:
        nxt = n_events - 1                       # the next end
        soon = now_head < now_tail and (n_events == 0 or end_t[nxt] > t or end_c[nxt] > now_c[now_head])
        ev = now_ev[now_head] if soon else slot_ev[end_c[nxt] & (slots - 1)]
        kind, what, k = ev & 7, ev >> 3 & wmask, ev >> (3 + wbits)
        if stop > 0 and _reaches(kind, what, k, stop, chain_seg, onr_ptr, world):
            paused = True
            break
        if soon:
            now_head += 1
            if now_head == now_tail:
                now_head = now_tail = 0
        else:
            t, n_events = end_t[nxt], nxt
        start_rank = -1                  # a rank whose compute lane may start its next op
        start_op = -1                    # the op it starts, if known (else its lane's first ready one)
        at = -1                          # LANDED: the end whose dependants it releases
        lo, hi = 0, 0                    # ops of instance ``k`` that may have become ready:
        on_rank = False                  # users_idx[lo:hi], or (ENTER) onr_idx[lo:hi]
        if kind == ENTER:
            r = what
            while k < n_inst:
                created[k] = True
                entered[k, r] = t
                j = chain_seg[k] * world + r
                if onr_ptr[j + 1] > onr_ptr[j]:
                    for lane in range(2):          # its lanes start on their first batch
                        jl = 2 * j + lane
                        if rl_ptr[jl + 1] > rl_ptr[jl]:
                            b = inst_boff[k] + rl_ptr[jl]
                            cursor[2 * r + lane] = b
                            cursor_end[2 * r + lane] = b + rl_ptr[jl + 1] - rl_ptr[jl]
                            if need[b] == 0:
                                now_tail, counter = _soon(now_c, now_ev, now_tail, counter, sbits,
                                                          ((k << wbits | b - inst_bat[k]) << 3) | POST)
                    on_rank, lo, hi = True, onr_ptr[j], onr_ptr[j + 1]
                    break
                left[k, r] = t                    # nothing of ours here: pass straight through
                k += 1
            if k >= n_inst:
                finish[r] = t
        elif kind == READY:
            sb = inst_sb[k]
            r = op_rank[sb + what]
            if not op_comm[sb + what]:
                if compute_busy[r]:              # it waits its turn in lane order
                    lane_n[r] = key_push(lane_heap, lane_base[r], lane_n[r], k << lbits | lane_pos[sb + what])
                else:                            # a free lane has no op waiting: it starts this one
                    start_rank, start_op = r, what
            else:                                # its data is there: one send fewer for its batch
                b = inst_boff[k] + op_bsend[sb + what]
                need[b] -= 1
                if need[b] == 0 and cursor[2 * r + op_lane[sb + what]] == b:
                    now_tail, counter = _soon(now_c, now_ev, now_tail, counter, sbits,
                                              ((k << wbits | b - inst_bat[k]) << 3) | POST)
        elif kind == POST:
            # A batch is posted: each of its transfers whose other end is posted
            # too is charged to its two ports, each carrying its transfers one
            # after another from now on; it has moved once both have carried it.
            sb, bb = inst_sb[k], inst_bb[k]
            b = bb + what
            for x in range(bat_ptr[b], bat_ptr[b + 1]):
                op = bat_idx[x]
                g = inst_base[k] + op
                posted_ends[g] += 1
                if posted_ends[g] < 2:
                    continue
                dur = op_sec[sb + op]
                a, z = port_out[sb + op], port_in[sb + op]
                start, at_in = max(t, port_free[a]), max(t, port_free[z])
                port_free[a], port_free[z] = start + dur, at_in + dur
                start = max(start, at_in)
                if record:
                    op_start[g] = start
                    op_end[g] = start + dur
                # Its move is over at (end, order) on its sender's batch, then on its
                # receiver's.  Only a batch's last move does anything, so the pending ends
                # hold that one alone, once every transfer of the batch has started.
                counter += 2
                end = start + dur
                for side in range(2):
                    bs = inst_boff[k] + (op_brecv[sb + op] if side else op_bsend[sb + op])
                    if end >= last_t[bs]:
                        last_t[bs], last_c[bs] = end, counter - 1 + side
                        last_ev[bs] = ((k << wbits | 2 * op + side) << 3) | MOVED
                    unstarted[bs] -= 1
                    if unstarted[bs] == 0:
                        r = op_peer[sb + op] if side else op_rank[sb + op]
                        slot = 3 * r + 1 + op_lane[sb + op]
                        slot_ev[slot] = last_ev[bs]
                        n_events = _pend(end_t, end_c, n_events, last_t[bs], last_c[bs] << sbits | slot)
        elif kind == MOVED:
            # The last transfer of a batch is over on one end: the batch is done on
            # that rank, what it received lands, and the lane posts its next batch.
            sb, bb = inst_sb[k], inst_bb[k]
            x, side = what >> 1, what & 1
            lane = op_lane[sb + x]
            r = op_peer[sb + x] if side else op_rank[sb + x]
            b = (op_brecv[sb + x] if side else op_bsend[sb + x])
            for y in range(bat_ptr[b], bat_ptr[b + 1]):
                op = bat_idx[y]
                end = 1 if op_peer[sb + op] == r else 0          # the end it is done on
                if op_lands[sb + op] >> end & 1:
                    now_tail, counter = _soon(now_c, now_ev, now_tail, counter, sbits,
                                              ((k << wbits | 2 * op + end) << 3) | LANDED)
            now_tail, counter = _done(remaining, left, k, r, bat_ptr[b + 1] - bat_ptr[b], t, now_c, now_ev,
                                      now_tail, counter, sbits, wbits)
            cursor[2 * r + lane] += 1
            b = cursor[2 * r + lane]
            if b < cursor_end[2 * r + lane] and need[b] == 0:
                now_tail, counter = _soon(now_c, now_ev, now_tail, counter, sbits,
                                          ((k << wbits | b - inst_bat[k]) << 3) | POST)
        elif kind == LANDED:
            # A transfer is done on one end (its batch there is done): the ops
            # of that end depending on it may be ready.
            sb = inst_sb[k]
            op, side = what >> 1, what & 1
            at = op_peer[sb + op] if side else op_rank[sb + op]
            lo, hi = users_ptr[sb + op], users_ptr[sb + op + 1]
        else:                                    # DONE: its dependants may be ready
            sb = inst_sb[k]
            lo, hi = users_ptr[sb + what], users_ptr[sb + what + 1]
        if hi > lo:
            b, sb = inst_base[k], inst_sb[k]
            for x in range(lo, hi):
                op = onr_idx[x] if on_rank else users_idx[x]
                g = b + op
                if kind == LANDED and op_rank[sb + op] != at:
                    continue                     # a dependant waits for the end it runs on
                if kind != ENTER:
                    waiting[g] -= 1
                if waiting[g] != 0 or entered[k, op_rank[sb + op]] < 0:
                    continue
                waiting[g] = -1                  # ready now (an op's dependencies end by now)
                now_tail, counter = _soon(now_c, now_ev, now_tail, counter, sbits, ((k << wbits | op) << 3) | READY)
        if kind == DONE:                                         # its compute lane is free again
            sb = inst_sb[k]
            r = op_rank[sb + what]
            now_tail, counter = _done(remaining, left, k, r, 1, t, now_c, now_ev, now_tail, counter, sbits, wbits)
            start_rank = r
            compute_busy[r] = False
        r = start_rank
        if r < 0:
            continue
        if start_op >= 0:
            op = start_op
        elif lane_n[r] == 0:
            continue
        else:
            key = key_pop(lane_heap, lane_base[r], lane_n[r])
            lane_n[r] -= 1
            k = key >> lbits
            j = chain_seg[k] * world + r
            op = onr_idx[onr_ptr[j] + (key & ((1 << lbits) - 1))]       # the compute lane heads the rank's ops
        sb = inst_sb[k]
        start = max(t, compute_free[r])
        dur = op_sec[sb + op]
        compute_busy[r] = True
        compute_free[r] = start + dur
        tier = op_tier[sb + op]
        if busy_order[r, tier] < 0:
            busy_order[r, tier] = n_busy
            n_busy += 1
        busy[r, tier] += dur
        if record:
            op_start[inst_base[k] + op] = start
            op_end[inst_base[k] + op] = start + dur
        counter += 1
        slot_ev[3 * r] = ((k << wbits | op) << 3) | DONE
        n_events = _pend(end_t, end_c, n_events, start + dur, counter << sbits | 3 * r)
    clock[0] = t
    ints[0], ints[1], ints[2], ints[3], ints[4] = n_events, now_head, now_tail, counter, n_busy
    return paused


@njit(cache=True)
def _reaches(kind, what, k, stop, chain_seg, onr_ptr, world):
    """Whether event (``kind``, ``what``, ``k``) touches an instance from ``stop`` on:
    one of them, or a rank entering instance ``k`` with nothing of its own until
    ``stop`` (it passes straight through to there)."""
    if k >= stop:
        return True
    if kind != ENTER:
        return False
    while k < stop:
        j = chain_seg[k] * world + what
        if onr_ptr[j + 1] > onr_ptr[j]:
            return False
        k += 1
    return True


@njit(cache=True)
def _carry(dst, src, stop, record):
    """Put the replay ``src``, paused before instance ``stop`` (``_run``), into the
    fresh state ``dst`` of a chain with the same first ``stop`` instances: their
    ops and batches are numbered alike in both."""
    ops, bats = src[0][stop], src[1][stop]          # instance ops and batches before ``stop``
    dst[2][:ops] = src[2][:ops]                     # waiting, posted ends
    dst[3][:ops] = src[3][:ops]
    if record:                                      # op starts and ends
        dst[4][:ops] = src[4][:ops]
        dst[5][:ops] = src[5][:ops]
    dst[6][:bats] = src[6][:bats]                   # need, unstarted, last move (t, order, event)
    dst[7][:bats] = src[7][:bats]
    dst[8][:bats] = src[8][:bats]
    dst[9][:bats] = src[9][:bats]
    dst[10][:bats] = src[10][:bats]
    dst[11][:stop] = src[11][:stop]                 # entered, left, remaining, created
    dst[12][:stop] = src[12][:stop]
    dst[13][:stop] = src[13][:stop]
    dst[14][:stop] = src[14][:stop]
    dst[15][:] = src[15]                            # lane cursors
    dst[16][:] = src[16]
    dst[17][:] = src[17]                            # compute lanes, finish, busy sums and their order
    dst[18][:] = src[18]
    dst[19][:] = src[19]
    dst[20][:] = src[20]
    dst[21][:] = src[21]
    heap, base, n = src[22], src[23], src[24]       # each rank's ready compute ops, at its base here
    for r in range(len(n)):
        dst[22][dst[23][r]:dst[23][r] + n[r]] = heap[base[r]:base[r] + n[r]]
    dst[24][:] = n
    dst[25][:] = src[25]                            # ports, the pending ends and their slots' events
    dst[26][:] = src[26]
    dst[27][:] = src[27]
    dst[28][:] = src[28]
    head, tail = src[32][1], src[32][2]             # the current instant's FIFO
    dst[29][head:tail] = src[29][head:tail]
    dst[30][head:tail] = src[30][head:tail]
    dst[31][:] = src[31]                            # clock, counters
    dst[32][:5] = src[32][:5]


def run_chains(world, chains, segments, record):
    """Replay each chain of ``chains`` (arrays of segment ids) from time 0;
    ``segments``: the static arrays (``_start``'s arguments after the chain).

    Chains that begin with the same instances replay them once (:func:`_replay`).

    Returns, per chain: (finish per rank, busy seconds [rank, tier], first-use
    order of each busy entry, entered [instance, rank], left [instance, rank],
    op start and end per instance op (if ``record``, else empty), instance
    base offsets, ops still unfinished per [instance, rank], whether each
    instance was entered)."""
    chain_ptr = np.zeros(len(chains) + 1, np.int64)
    chain_ptr[1:] = np.cumsum([len(chain) for chain in chains])
    flat = np.concatenate(chains)
    finish, busy, order, entered, left, remaining, created, inst_base, op_start, op_end = _replay(
        world, flat, chain_ptr, segments, record)
    out = []
    for c in range(len(chains)):
        k0, k1 = chain_ptr[c], chain_ptr[c + 1]
        base = inst_base[k0 + c:k1 + c + 1]
        ops = op_start[base[0]:base[-1]] if record else op_start
        out.append((finish[c], busy[c], order[c], entered[k0:k1], left[k0:k1], ops,
                    op_end[base[0]:base[-1]] if record else op_end, base - base[0], remaining[k0:k1], created[k0:k1]))
    return out


@njit(cache=True)
def _replay(world, chains, chain_ptr, segments, record):
    """Replay chain ``c``, ``chains[chain_ptr[c]:chain_ptr[c + 1]]``, for each ``c``
    (``segments``: the static arrays, ``_start``'s arguments after the chain).

    Chains that begin with the same instances replay them once: every event
    before the first that touches an instance where the chains differ is the
    same in all of them, so the first chain runs to that event, the others
    start from where it stands (:func:`_carry`), and all run on from there.

    Returns the chains' results stacked: finish [chain, rank], busy seconds and
    their first-use order [chain, rank, tier]; per instance of every chain in
    turn, entered, left and ops still unfinished [instance, rank] and whether
    it was entered; each chain's instance base offsets in turn (one more than
    its instances), counted over the chains' ops laid end to end; and, if
    ``record``, every op's start and end there."""
    seg_base, n_tiers = segments[0], segments[24]
    n_chains = len(chain_ptr) - 1
    first = chains[chain_ptr[0]:chain_ptr[1]]
    shared = len(first) if n_chains > 1 else 0
    for c in range(1, n_chains):
        other = chains[chain_ptr[c]:chain_ptr[c + 1]]
        k = 0
        while k < min(len(first), len(other)) and first[k] == other[k]:
            k += 1
        shared = min(shared, k)
    n_inst = chain_ptr[n_chains]
    inst_base = np.zeros(n_inst + n_chains, np.int64)
    for c in range(n_chains):
        at = chain_ptr[c] + c
        for k in range(chain_ptr[c], chain_ptr[c + 1]):
            inst_base[at + 1] = inst_base[at] + seg_base[chains[k] + 1] - seg_base[chains[k]]
            at += 1
        if c + 1 < n_chains:
            inst_base[at + 1] = inst_base[at]
    finish = np.zeros((n_chains, world))
    busy = np.zeros((n_chains, world, n_tiers))
    order = np.zeros((n_chains, world, n_tiers), np.int64)
    entered = np.zeros((n_inst, world))
    left = np.zeros((n_inst, world))
    remaining = np.zeros((n_inst, world), np.int64)
    created = np.zeros(n_inst, np.bool_)
    n_ops = inst_base[n_inst + n_chains - 1] if record else 0
    op_start = np.zeros(n_ops)
    op_end = np.zeros(n_ops)
    state0 = _start(world, first, *segments, record)
    paused = False
    if shared > 0:
        paused = _run(state0, world, first, *segments, record, shared)
    for c in range(n_chains - 1, -1, -1):         # the first chain last: the others start from it, paused
        chain = chains[chain_ptr[c]:chain_ptr[c + 1]]
        state = state0
        if c > 0:
            state = _start(world, chain, *segments, record)
            if paused:
                _carry(state, state0, shared, record)
        _run(state, world, chain, *segments, record, 0)
        k0, k1 = chain_ptr[c], chain_ptr[c + 1]
        finish[c] = state[19]
        busy[c] = state[20]
        order[c] = state[21]
        entered[k0:k1] = state[11]
        left[k0:k1] = state[12]
        remaining[k0:k1] = state[13]
        created[k0:k1] = state[14]
        if record:
            b = inst_base[k0 + c]
            op_start[b:b + len(state[4])] = state[4]
            op_end[b:b + len(state[5])] = state[5]
    return finish, busy, order, entered, left, remaining, created, inst_base, op_start, op_end
