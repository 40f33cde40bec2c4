"""All-to-alls as the replay carries them, for the surrogate clock (``planner/surrogate.py``).

A rank posts its transfers of a wave as one batch per lane (NVLink, NIC)
once it entered, its lane's previous batch is done and every send of the
batch has its data; a transfer starts once both its ends posted, each of its
two ports carries the transfers charged to it back to back in the order they
start, and it has moved once both ports have; what a batch received lands
when the whole batch is done (``sim/replay.py``).  Two passes use that: the
Ulysses groups' all-to-alls (``surrogate_ulysses.py``) and the layout
switches (:func:`exchanged`, routed pieces a wave per hop), both followed
from every rank's own entry.  Compiled: a counting sort per wave and a
running maximum per port.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def carried(post, src, dst, lane, held, port_out, port_in, w, free):
    """When each transfer ``src -> dst`` on ``lane`` (0: NVLink, 1: NIC) holding
    its ports ``held`` seconds has moved, its ends posting their lane's batch
    at ``post`` (per lane and rank, lane-major) and each port free from
    ``free`` on (per port; updated).  At equal times ends post in rank order,
    and a rank's batch in transfer order (the schedule's).  In linear time:
    the transfers counting-sorted by when they start, then dealt to their
    ports in that order."""
    m = len(src)
    place = np.empty(2 * w, np.int64)
    place[np.argsort(post, kind="mergesort")] = np.arange(2 * w)
    start = np.empty(m)
    later = np.empty(m, np.int64)
    count = np.zeros(2 * w + 1, np.int64)
    for i in range(m):
        a, b = lane[i] * w + src[i], lane[i] * w + dst[i]
        start[i] = max(post[a], post[b])
        later[i] = max(place[a], place[b])
        count[later[i] + 1] += 1
    at = np.cumsum(count)
    order = np.empty(m, np.int64)
    for i in range(m):
        order[at[later[i]]] = i
        at[later[i]] += 1
    n_ports = len(free)
    on_port = np.zeros(n_ports + 1, np.int64)
    for i in range(m):
        on_port[port_out[i] + 1] += 1
        on_port[port_in[i] + 1] += 1
    first = np.cumsum(on_port)
    at = first.copy()
    legs = np.empty(2 * m, np.int64)
    for i in order:
        legs[at[port_out[i]]] = i
        at[port_out[i]] += 1
        legs[at[port_in[i]]] = i
        at[port_in[i]] += 1
    moved = np.full(m, -np.inf)
    for p in range(n_ports):
        for x in range(first[p], first[p + 1]):
            i = legs[x]
            free[p] = max(start[i], free[p]) + held[i]
            moved[i] = max(moved[i], free[p])
    return moved


@njit(cache=True)
def exchanged(entry, src, dst, lane, held, port_out, port_in, after, wave_ptr, w, n_ports):
    """Transfers posted wave by wave (``wave_ptr``: the transfers of each wave,
    consecutive) as each rank enters at ``entry``; ``after``: per transfer the
    one whose landing at its sender it carries on (-1: none, a first hop).
    Per rank when its batches are done (its entry when it has none)."""
    free = np.full(n_ports, -np.inf)
    lane_free = np.empty(2 * w)                     # per lane and rank: when its last batch was done
    lane_free[:w] = entry
    lane_free[w:] = entry
    landed = np.empty(len(src))
    done = entry.copy()
    for v in range(len(wave_ptr) - 1):
        lo, hi = wave_ptr[v], wave_ptr[v + 1]
        post = lane_free.copy()
        for i in range(lo, hi):
            if after[i] >= 0:
                a = lane[i] * w + src[i]
                post[a] = max(post[a], landed[after[i]])
        moved = carried(post, src[lo:hi], dst[lo:hi], lane[lo:hi], held[lo:hi], port_out[lo:hi], port_in[lo:hi],
                        w, free)
        batch = np.full(2 * w, -np.inf)
        for x in range(hi - lo):
            i = lo + x
            batch[lane[i] * w + src[i]] = max(batch[lane[i] * w + src[i]], moved[x])
            batch[lane[i] * w + dst[i]] = max(batch[lane[i] * w + dst[i]], moved[x])
        for i in range(lo, hi):
            landed[i] = batch[lane[i] * w + dst[i]]
        for j in range(2 * w):
            if batch[j] > -np.inf:
                lane_free[j] = batch[j]
                done[j % w] = max(done[j % w], batch[j])
    return done
