"""All-to-alls as the replay carries them, for the surrogate clock (``planner/surrogate.py``).

A rank posts its transfers of a wave as one batch per lane (NVLink, NIC)
once its data is there; a transfer starts once both its ends posted, each of
its two ports carries the transfers charged to it back to back in the order
they start, and it has moved once both ports have (``sim/replay.py``).  Two
passes use that: the Ulysses groups' all-to-alls (``surrogate_ulysses.py``)
and a direct layout switch, both followed from every rank's own entry.
Compiled: a sort per all-to-all and a running maximum per port.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def carried(post, src, dst, lane, held, port_out, port_in, w):
    """When each transfer ``src -> dst`` on ``lane`` (0: NVLink, 1: NIC) holding
    its ports ``held`` seconds has moved, its ends posting their lane's batch
    at ``post`` (per lane and rank, lane-major).  At equal times ends post in
    rank order, and a rank's batch in transfer order (the schedule's).  In
    linear time: the transfers counting-sorted by when they start, then
    dealt to their ports in that order."""
    m = len(src)
    place = np.empty(2 * w, np.int64)
    place[np.argsort(post, kind="mergesort")] = np.arange(2 * w)
    start = np.empty(m)
    later = np.empty(m, np.int64)
    count = np.zeros(2 * w + 1, np.int64)
    n_ports = 0
    for i in range(m):
        a, b = lane[i] * w + src[i], lane[i] * w + dst[i]
        start[i] = max(post[a], post[b])
        later[i] = max(place[a], place[b])
        count[later[i] + 1] += 1
        n_ports = max(n_ports, port_out[i] + 1, port_in[i] + 1)
    at = np.cumsum(count)
    order = np.empty(m, np.int64)
    for i in range(m):
        order[at[later[i]]] = i
        at[later[i]] += 1
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
        free = -np.inf
        for x in range(first[p], first[p + 1]):
            i = legs[x]
            free = max(start[i], free) + held[i]
            moved[i] = max(moved[i], free)
    return moved


@njit(cache=True)
def exchanged(entry, src, dst, lane, held, port_out, port_in, w):
    """One wave of transfers posted as each rank enters at ``entry``: per rank
    when its batches are done (its entry when it has none)."""
    post = np.empty(2 * w)
    post[:w] = entry
    post[w:] = entry
    moved = carried(post, src, dst, lane, held, port_out, port_in, w)
    done = entry.copy()
    for i in range(len(src)):
        done[src[i]] = max(done[src[i]], moved[i])
        done[dst[i]] = max(done[dst[i]], moved[i])
    return done
