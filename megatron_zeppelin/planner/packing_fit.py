"""The placement loop of ``planner/packing.py``, compiled with numba.

Sequences arrive in placement order (longest first); each goes to the bin
with the fewest tokens (ties: lower bin) whose ranks all stay under the cap.
Bins leave a heap keyed ``(tokens, bin)`` in that order until one fits, and
those tried go back: a sequence costs ``log`` of the bins, not a sort of them
(1,024 bins, 16,384 sequences).  Keys are unique, so the bins are tried in
the same order as by any correct heap.  Integer arithmetic only: the
placements are those of the Python rule, exactly.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from megatron_zeppelin.pair_heap import pop, push


@njit(cache=True)
def place_in_order(lengths, one_rank, split, loads, cap, stop_at_miss):
    """Place sequence ``j`` (``lengths[j]`` tokens): on the least-loaded rank of
    the bin where ``one_rank[j]`` (ties: first rank), else ``split[j]`` tokens
    per rank.  ``loads`` (bins x ranks) is updated in place.  Returns the bin of
    every sequence (-1: it fits none), its tokens per rank, and how many
    sequences were tried (fewer than all: ``stop_at_miss`` and one fit none)."""
    n = lengths.shape[0]
    num_bins, width = loads.shape
    heap_t, heap_b = np.empty(num_bins, np.int64), np.empty(num_bins, np.int64)
    n_heap = 0
    for b in range(num_bins):
        n_heap = push(heap_t, heap_b, n_heap, loads[b].sum(), b)
    tried_t, tried_b = np.empty(num_bins, np.int64), np.empty(num_bins, np.int64)
    bin_of = np.full(n, -1, np.int64)
    shares = np.zeros((n, width), np.int64)
    share = np.zeros(width, np.int64)
    for j in range(n):
        n_tried = 0
        while n_heap > 0:
            t, b, n_heap = pop(heap_t, heap_b, n_heap)
            if one_rank[j]:
                share[:] = 0
                least = 0
                for r in range(1, width):
                    if loads[b, r] < loads[b, least]:
                        least = r
                share[least] = lengths[j]
            else:
                share[:] = split[j]
            fits = True
            for r in range(width):
                if loads[b, r] + share[r] > cap:
                    fits = False
                    break
            tried_t[n_tried], tried_b[n_tried] = t, b
            n_tried += 1
            if fits:
                loads[b] += share
                shares[j] = share
                bin_of[j] = b
                tried_t[n_tried - 1] = t + share.sum()
                break
        for e in range(n_tried):
            n_heap = push(heap_t, heap_b, n_heap, tried_t[e], tried_b[e])
        if bin_of[j] < 0 and stop_at_miss:
            return bin_of, shares, j + 1
    return bin_of, shares, n
