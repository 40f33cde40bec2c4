"""The surrogate's view of a rank's lanes (``planner/surrogate.py``): the floor
under them, what is known of their batches (:class:`LaneClock`), and the
pieces other ranks relay for rings (:class:`Relays`).

The replay's communication lanes (``sim/replay.py``: one per rank and link
class) post a rank's transfers a wave at a time, a batch per wave, and post a
batch only once the batch before it is done; a batch is done once every port
of the rank has carried the rank's transfers of that batch (a port carries
its transfers back to back).  A routed piece's relay sends on in the wave
after its previous hop landed on it: a proxy's NIC crossing after the
dispatch landed in its NVLink batch, a twin's combine after the crossing
landed in its NIC batch.  So a rank's batch of a wave is done no sooner than
the later of its batch before and (for such a relayed send) the other lane's
batch before, plus its busiest port's load in the batch: :func:`lane_floor`.
That pace -- one batch per wave per lane, each as long as the rank's load in
it -- is what a routed crossing's pieces meet at every hop.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def lane_floor(rank, lane, wave, load, waits, w):
    """Per batch (``rank``, ``lane``, ``wave``, sorted by wave) of the rank's
    busiest port ``load`` in it, which ``waits`` (or not) for the rank's other
    lane's batch before it: the earliest it can be done."""
    done = np.full((2, w), -np.inf)
    out = np.empty(len(rank))
    i = 0
    while i < len(rank):
        j = i
        while j < len(rank) and wave[j] == wave[i]:
            j += 1
        for x in range(i, j):           # every batch of the wave from the batches before it
            start = max(done[lane[x], rank[x]], 0.0)
            if waits[x]:
                start = max(start, done[1 - lane[x], rank[x]])
            out[x] = start + load[x]
        for x in range(i, j):
            done[lane[x], rank[x]] = out[x]
        i = j
    return out


class LaneClock:
    """Per rank and lane (0: NVLink, 1: NIC), what is known of when its batch of
    each wave was posted (the latest data its sends wait for) and done
    (``Schedule.waves``: a lane posts a wave's batch once its batch before is
    done and every send of it has its data; what it receives lands once it is
    done).  Built from events (rank, lane, wave, posted, done) arrays."""

    def __init__(self, events: list[tuple]) -> None:
        rank, lane, wave, posted, done = (np.concatenate(x) for x in zip(*events))
        self.span = int(wave.max(initial=0)) + 1
        key = (rank * 2 + lane) * self.span + wave
        order = np.argsort(key, kind="stable")
        self.key, posted, done = key[order], posted[order], done[order]
        self.group = self.key // self.span
        # done by wave: a running maximum that restarts per (rank, lane)
        lift = self.group * (2 * float(np.abs(done).max(initial=0.0)) + 1)
        self.done = np.maximum.accumulate(done + lift) - lift
        new = np.ones(len(key), bool)
        new[1:] = self.key[1:] != self.key[:-1]
        first = np.flatnonzero(new)
        self.post_key = self.key[first]
        self.post = np.maximum.reduceat(posted, first) if len(first) else posted

    def done_by(self, rank: np.ndarray, lane: np.ndarray, wave: np.ndarray) -> np.ndarray:
        """When the batches of ``rank``'s ``lane`` up to ``wave`` were done (-inf: none)."""
        group = rank * 2 + lane
        if not len(self.key):
            return np.full(len(rank), -np.inf)
        i = np.searchsorted(self.key, group * self.span + np.minimum(wave, self.span - 1), side="right") - 1
        ok = (wave >= 0) & (i >= 0)
        ok[ok] = self.group[i[ok]] == group[ok]
        return np.where(ok, self.done[np.maximum(i, 0)], -np.inf)

    def posted_at(self, rank: np.ndarray, lane: np.ndarray, wave: np.ndarray) -> np.ndarray:
        """When the sends of ``rank``'s batch of ``wave`` on ``lane`` had their data (-inf: none)."""
        key = (rank * 2 + lane) * self.span + wave
        if not len(self.key):
            return np.full(len(rank), -np.inf)
        j = np.minimum(np.searchsorted(self.post_key, key), len(self.post_key) - 1)
        ok = (wave >= 0) & (wave < self.span) & (j >= 0)
        ok[ok] = self.post_key[j[ok]] == key[ok]
        return np.where(ok, self.post[np.maximum(j, 0)], -np.inf)


class Relays:
    """The hops of one kind of a ring batch's messages that other ranks relay
    (``RingBatch.relays``), step by step.  A rank posts a hop it relays in its
    own lane's batch of the hop's wave (:class:`LaneClock`): a hop it sends
    leaves once the lane's batch before is done and its batch is posted, a
    hop it receives lands (and can go on) once its batch is done."""

    def __init__(self, relays: tuple) -> None:
        order = np.argsort(relays[2], kind="stable")
        (self.ring, self.link, self.step, self.rank, self.wave, self.lane, self.sends, self.lead,
         self.after) = (x[order] for x in relays)
        self.at = np.searchsorted(self.step, np.arange(self.step.max(initial=-1) + 2))

    def _of(self, t: int) -> slice:
        return slice(self.at[t], self.at[t + 1]) if t + 1 < len(self.at) else slice(0, 0)

    def bound(self, t: int, first_wave: np.ndarray, clock: LaneClock) -> np.ndarray:
        """Per (ring, link) the earliest its message of step ``t`` can reach the
        receiver, its relays' batches allowing; ``first_wave``: per (ring, link)
        the wave of its message's first hop."""
        on = self._of(t)
        out = np.full(first_wave.shape, -np.inf)
        ring, link, rank, lane, sends = self.ring[on], self.link[on], self.rank[on], self.lane[on], self.sends[on]
        wave = first_wave[ring, link] + self.wave[on]
        start = np.maximum(clock.done_by(rank, lane, wave - 1),
                           np.where(sends, clock.posted_at(rank, lane, wave), -np.inf))
        hop = np.maximum(start + self.lead[on], np.where(sends, -np.inf, clock.done_by(rank, lane, wave)))
        np.maximum.at(out, (ring, link), hop + self.after[on])
        return out

    def relayed(self, t: int, arrival: np.ndarray, until: np.ndarray) -> None:
        """Raise ``until`` per relaying rank to when its hops of step ``t``'s
        messages were done, the messages arriving at ``arrival`` per (ring, link)."""
        on = self._of(t)
        np.maximum.at(until, self.rank[on], arrival[self.ring[on], self.link[on]] - self.after[on])
