"""Group-size search helpers: ranks by projected load, and the best size within a tier."""

from __future__ import annotations

import numpy as np

class _Ranked:
    """Ranks ordered by projected load, to ask for the ``k``-th least-loaded rank
    that has room for a shard: a wider group has smaller shards, so it can use
    ranks a narrower one cannot."""

    def __init__(self, proj: np.ndarray, room: np.ndarray) -> None:
        order = np.argsort(proj, kind="stable")
        self.proj, self.room = proj[order], room[order]
        self._prefix_room = np.minimum.accumulate(self.room)
        """Least room among the ``k`` least-loaded ranks: when it is enough, the
        answer is the k-th rank itself (no array pass, the usual case)."""

    def kth(self, k: int, need: int) -> float:
        """Projected load of the ``k``-th least-loaded rank with ``need`` free
        token slots (inf when fewer than ``k`` ranks have them)."""
        if self._prefix_room[k - 1] >= need:
            return float(self.proj[k - 1])
        j = int(np.searchsorted(np.cumsum(self.room >= need), k))
        return float(self.proj[j]) if j < len(self.proj) else np.inf


def _lower(a: tuple[float, int, float] | None, b: tuple[float, int, float] | None,
           floor: float) -> tuple[float, int, float] | None:
    """Of two ``(peak, size, spread)`` candidates that do not both fit the
    target, the one with the lower estimated step ``max(peak, floor + spread)``:
    ``spread`` is the group's total work over the world size, what it lifts the
    level every rank ends near from ``floor`` (that level without this
    sequence).  A wider group lowers its own peak but costs more work (short
    kernel blocks, NIC transfers): by peak alone the search took 32- to 64-rank
    groups for 30-100k token sequences once nothing fitted, doubling their work;
    by ``peak + spread`` it left ranks idle when nothing else could fill them
    (None: no candidate)."""
    if a is None:
        return b
    if b is None:
        return a
    return b if max(b[0], floor + b[2]) < max(a[0], floor + a[2]) else a


def _first_fit(lo: int, hi: int, peak, target: float, spread,
               floor: float) -> tuple[float, int, float] | None:
    """Within one tier: the smallest k in ``[lo, hi]`` whose ``peak(k, k)`` (the
    load the group's shards raise their k-th least-loaded rank to) is at most
    ``target``, else the best k among those tried by :func:`_lower` (None: too
    few ranks have token room)."""
    # The smallest size is always a candidate: for tiny sequences latency
    # makes a ring slower than its first size, not faster.
    f = peak(lo, lo)
    best = (f, lo, spread(lo)) if np.isfinite(f) else None
    if best is not None and f <= target:
        return best
    k = lo
    if k < hi:
        # Binary search on a lower bound, the emptiest eligible rank plus the
        # shard, which falls with k inside a tier (shards and per-rank time
        # shrink): no smaller size can fit.
        a, b = k + 1, hi
        while a < b:
            mid = (a + b) // 2
            if peak(mid, 1) > target:
                a = mid + 1
            else:
                b = mid
        k = a
    for kk in range(k, min(hi, 2 * k + 8) + 1):
        f = peak(kk, kk)
        if not np.isfinite(f):
            continue
        if f <= target:
            return f, kk, spread(kk)
        best = _lower(best, (f, kk, spread(kk)), floor)
    return best
