"""The surrogate's floor under a rank's lanes (``planner/surrogate.py``).

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
