"""The last resort for batches that fill the token cap (nearly) exactly.

The packing passes and the tokens-only fill are greedy: on a batch of, say,
2,033 tokens for 2,048 slots one early choice (a ring over two ranks instead
of four) can leave the last sequences no room although a placement exists.
This search places sequences longest first and backtracks, trying for each a
few placements that use the free room differently: whole on the
tightest-fitting rank, or as a ring whose largest zigzag shards go to the
roomiest ranks (a ring's order is free: rank ``ranks[i]`` holds shard ``i``),
from the smallest ring size up.  States already seen (same position, same
multiset of free room) are skipped, and the search stops after a fixed number
of steps, so it costs milliseconds where the greedy fill already works and
returns ``None`` rather than run long on a batch that has no placement (the
sampler then defers a document, see ``sampler/deferral.py``).

Depth first, a wrong choice near the top is only undone after every
placement below it has been tried, which a step budget never reaches on a
batch of a dozen sequences with 3 tokens of free room (16 ranks x 161: found
after 10,536 steps).  The search therefore first runs as a limited
discrepancy search: rounds that allow 0, 1, 2, ... departures from the
candidates' order in total, wherever in the batch (that batch: 176 steps).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from megatron_zeppelin.plan.shards import zigzag_shard_tokens
from megatron_zeppelin.planner.zeppelin.loads import _Assign, min_ring_size

#: Placements tried by one search before it gives up (each is O(world size):
#: about 60 us at 32 ranks, so a batch without a placement costs well under a
#: second per search, while the planner plans the next batch during this
#: one's compute).  1,500 missed a placement of a 100 %-full 32-rank batch
#: that 10,000 find (tests/planner/test_zeppelin.py's explicit example).
SEARCH_STEPS = 10_000


def exact_fill(lens: np.ndarray, cap: int, world: int) -> _Assign | None:
    """Placement of every sequence under the token cap by tokens alone, or None.
    Two searches of SEARCH_STEPS each: by limited discrepancy with a ring's
    best-fit rank order first, then depth first with the roomiest ranks first
    (which one finds a placement sooner depends on the batch: on the 100 %-full
    batches of tests/planner/test_zeppelin.py's generator the first finds all
    159 of 1,000 draws at >= 98 % fill on >= 4 ranks, the second the explicit
    32-rank example it misses)."""
    chosen = _search(lens, cap, world, tight_rings_first=True, discrepancies=itertools.count()) or \
        _search(lens, cap, world, tight_rings_first=False, discrepancies=(math.inf,))
    if chosen is None:
        return None
    out = _Assign.empty(len(lens))
    for seq, ranks in enumerate(chosen):
        out.set(seq, ranks)
    return out


def _search(lens: np.ndarray, cap: int, world: int, tight_rings_first: bool,
            discrepancies) -> list[tuple[int, ...]] | None:
    """Ranks of every sequence, or None.  Each round of ``discrepancies``
    tries, at every position, candidates up to the round's remaining allowance
    (candidate ``i`` spends ``i``; ``inf``: plain depth first)."""
    order = np.argsort(-lens, kind="stable").tolist()
    room = np.full(world, cap, dtype=np.int64)
    chosen: list[tuple[int, ...]] = [()] * len(lens)
    # (position, multiset of free room) -> the largest allowance it failed with.
    failed: dict[tuple[int, bytes], float] = {}
    steps = 0
    for allowance in discrepancies:
        # One frame per placed position: key, candidates, next to try, the one
        # applied, the allowance it was entered with.  Iterative: a batch can
        # hold thousands of sequences.
        frames: list[list] = []
        pos, cut = 0, False
        while pos < len(order):
            if len(frames) == pos:
                left = allowance if pos == 0 else frames[-1][4] - (frames[-1][2] - 1)
                key = (pos, np.sort(room).tobytes())
                known = failed.get(key, -1) >= left
                cands = [] if known else _candidates(room, int(lens[order[pos]]), cap, world, tight_rings_first)
                frames.append([key, cands, 0, None, left])
            frame = frames[-1]
            if frame[3] is not None:
                ranks, tokens = frame[3]
                room[list(ranks)] += tokens
                frame[3] = None
            tries = frame[2] < len(frame[1])
            if tries and frame[2] > frame[4]:
                cut, tries = True, False
            if tries and steps < SEARCH_STEPS:
                ranks, tokens = frame[3] = frame[1][frame[2]]
                frame[2] += 1
                steps += 1
                room[list(ranks)] -= tokens
                chosen[order[pos]] = ranks
                pos += 1
                continue
            if steps < SEARCH_STEPS:
                failed[frame[0]] = max(failed.get(frame[0], -1), frame[4])
            frames.pop()
            pos -= 1
            if pos < 0:
                break
        else:
            return chosen
        if steps >= SEARCH_STEPS or not cut:
            return None
    return None


def _candidates(room: np.ndarray, length: int, cap: int, world: int,
                tight_rings_first: bool) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """(ranks in ring order, tokens each takes), most promising first."""
    out = []
    fits = np.nonzero(room >= length)[0]
    if len(fits):
        # Whole on one rank: the tightest fit, then the roomiest (distinct rooms only).
        tight, roomy = int(fits[np.argmin(room[fits])]), int(fits[np.argmax(room[fits])])
        out += [((r,), np.array([length])) for r in dict.fromkeys((tight, roomy))]
    by_room = np.argsort(-room, kind="stable")
    widest = min(world, length // 2)
    # The smallest ring sizes that fit (up to five placements), then the
    # widest ring: spreading a sequence thin over every rank is what lets
    # some nearly full batches close.
    sizes = list(range(max(2, min_ring_size(length, cap)), widest + 1))
    for k in sizes:
        if len(out) >= 5 and k != widest:
            continue
        shards = zigzag_shard_tokens(length, k)
        big_first = np.argsort(-shards, kind="stable")
        # Roomiest ranks take the largest shards: fits iff it fits sorted.
        if (room[by_room[:k]] < shards[big_first]).any():
            continue
        roomy = np.empty(k, dtype=np.int64)
        roomy[big_first] = by_room[:k]
        orders = (_tightest(room, shards, big_first), tuple(roomy.tolist()))
        out += [(ranks, shards) for ranks in dict.fromkeys(orders if tight_rings_first else orders[::-1])]
    return out


def _tightest(room: np.ndarray, shards: np.ndarray, big_first: np.ndarray) -> tuple[int, ...]:
    """Ring order giving each shard, largest first, the rank with the least room
    that still holds it (best fit: keeps large free room for later sequences)."""
    free = room.astype(np.float64)
    ranks = [0] * len(shards)
    for i in big_first.tolist():
        r = int(np.argmin(np.where(free >= shards[i], free, np.inf)))
        ranks[i] = r
        free[r] = -1.0      # taken: a ring's ranks are distinct
    return tuple(ranks)
