"""FlexSP's greedy grouping (``flexsp.greedy_groups``), compiled with numba.

One function runs the whole bisection over flat per-sequence arrays: which
group sizes a sequence fits, its seconds and tokens per GPU there.  Each
first-fit pass is a loop over the sequences and the open groups, which in
Python cost ~22 ms for the 17 passes of a 1,024-sequence batch.  Every
floating-point operation is the one the Python rules name, in their order
(``load + seconds <= limit``, ``(lo + hi) / 2``), so the compiled code makes
bit-identical decisions.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: :func:`_first_fit` drops the groups that no later sequence fits every this many sequences.
PRUNE_EVERY = 32


@njit(cache=True)
def _least_after(fits, seconds, tokens):
    """Every ``PRUNE_EVERY`` sequences ``j``: per size the least seconds and the
    least tokens of the sequences from ``j`` on that fit it (inf: none)."""
    n, n_sizes = fits.shape
    blocks = (n + PRUNE_EVERY - 1) // PRUNE_EVERY
    least_s = np.full((blocks + 1, n_sizes), np.inf)
    least_t = np.full((blocks + 1, n_sizes), np.inf)
    for j in range(n - 1, -1, -1):
        b = j // PRUNE_EVERY
        for k in range(n_sizes):
            if j == n - 1 or j % PRUNE_EVERY == PRUNE_EVERY - 1:   # a block's last: start from the next's
                least_s[b, k], least_t[b, k] = least_s[b + 1, k], least_t[b + 1, k]
            if fits[j, k]:
                least_s[b, k] = min(least_s[b, k], seconds[j, k])
                least_t[b, k] = min(least_t[b, k], float(tokens[j, k]))
    return least_s, least_t


@njit(cache=True)
def _first_fit(fits, seconds, tokens, sizes, least_s, least_t, world, cap, limit,
               group_k, group_s, group_t, open_, assign):
    """Groups with time <= ``limit``: returns their number (``group_k`` their size
    index, ``assign[j]`` sequence ``j``'s group), or -1.  Longest first, each
    sequence joins the first open group (any size it fits) with time and memory
    left, else opens a group of the smallest size that runs it within
    ``limit`` (least communication, fewest GPUs)."""
    n, n_sizes = fits.shape
    n_groups = 0
    n_open = 0      # open_[:n_open]: groups some later sequence may still fit, oldest first
    used = 0
    for j in range(n):
        if j % PRUNE_EVERY == 0 and j:
            b = j // PRUNE_EVERY
            kept = 0
            for o in range(n_open):
                g = open_[o]
                k = group_k[g]
                if group_s[g] + least_s[b, k] <= limit and group_t[g] + least_t[b, k] <= cap:
                    open_[kept] = g
                    kept += 1
            n_open = kept
        found = -1
        for o in range(n_open):
            g = open_[o]
            k = group_k[g]
            if fits[j, k] and group_s[g] + seconds[j, k] <= limit and group_t[g] + tokens[j, k] <= cap:
                found = g
                break
        if found < 0:
            k = -1
            for kk in range(n_sizes):
                if fits[j, kk] and seconds[j, kk] <= limit:
                    k = kk
                    break
            if k < 0:
                return -1
            used += sizes[k]
            if used > world:
                return -1
            found = n_groups
            group_k[found], group_s[found], group_t[found] = k, 0.0, 0
            n_groups += 1
            open_[n_open] = found
            n_open += 1
        assign[j] = found
        k = group_k[found]
        group_s[found] += seconds[j, k]
        group_t[found] += tokens[j, k]
    return n_groups


@njit(cache=True)
def bisect_first_fit(fits, seconds, tokens, sizes, world, cap, steps):
    """Bisect the makespan limit of :func:`_first_fit` between the slowest
    sequence's best time and the first limit (doubling) that fits.  Returns
    ``(number of groups, size index per group, group per sequence)``; -1 groups:
    none (a sequence fits no size, or nothing fits in 40 doublings)."""
    n, n_sizes = fits.shape
    lo = 0.0
    for j in range(n):
        alone = np.inf
        found = False
        for k in range(n_sizes):
            if fits[j, k]:
                alone = min(alone, seconds[j, k])
                found = True
        if not found:
            return -1, np.zeros(0, np.int64), np.zeros(0, np.int64)
        lo = alone if j == 0 else max(lo, alone)
    hi = lo
    least_s, least_t = _least_after(fits, seconds, tokens)
    group_k, group_s = np.zeros(n, np.int64), np.zeros(n)
    group_t, open_, assign = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    best_n = -1
    for _ in range(40):
        best_n = _first_fit(fits, seconds, tokens, sizes, least_s, least_t, world, cap, hi,
                            group_k, group_s, group_t, open_, assign)
        if best_n >= 0:
            break
        hi *= 2
    if best_n < 0:
        return -1, np.zeros(0, np.int64), np.zeros(0, np.int64)
    best_k, best_assign = group_k[:best_n].copy(), assign.copy()
    for _ in range(steps):
        mid = (lo + hi) / 2
        got = _first_fit(fits, seconds, tokens, sizes, least_s, least_t, world, cap, mid,
                         group_k, group_s, group_t, open_, assign)
        if got < 0:
            lo = mid
        else:
            best_n, hi = got, mid
            best_k, best_assign = group_k[:got].copy(), assign.copy()
    return best_n, best_k, best_assign
