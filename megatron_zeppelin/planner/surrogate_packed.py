"""The surrogate's price of packed rings (``Plan.packed_rings``: TransformerEngine's
THD ring as the engine runs it, ``attention/packed_ring.py``).

A packed ring is one ring to the replay (``schedule/attention.py``): per step
one message per link holding every member's rows of the owner's shard, and one
kernel per position whose pairs are the members' summed and whose block is
their blocks' mean rows (``schedule/packed.py: ring_work``).  So it is priced
as one ring of the surrogate's (``StepSurrogate._ring_batch``) over a sequence
as long as the members together -- its messages then carry the members' rows
up to rounding (chunk boundaries of the sum, not of each member: at most one
token per member and chunk) -- whose kernels are replaced by the packed ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_zeppelin.plan.shards import causal_pairs, chunk_sizes
from megatron_zeppelin.planner.plan_arrays import PlanArrays
from megatron_zeppelin.schedule.packed import ring_work

if TYPE_CHECKING:
    from megatron_zeppelin.planner.surrogate import StepSurrogate
    from megatron_zeppelin.planner.surrogate_rings import RingBatch


def packed_ring_batches(clock: "StepSurrogate", layout: PlanArrays, backward: bool, routed: bool,
                        w: int) -> list["RingBatch"]:
    """The packed rings of ``layout`` as the surrogate's ring batches, one per ring size."""
    out = []
    for k, rings in _by_size(layout).items():
        batch = clock._ring_batch(k, np.stack([r for r, _ in rings]), np.array([lens.sum() for _, lens in rings]),
                                  backward, routed, w)
        batch.comp = np.stack([_kernels(clock, lens, k, backward) for _, lens in rings])
        out.append(batch)
    return out


def _by_size(layout: PlanArrays) -> dict[int, list[tuple[np.ndarray, np.ndarray]]]:
    """The packed rings of ``layout`` by ring size, in order."""
    by_size: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for ranks, lens in layout.packed:
        by_size.setdefault(len(ranks), []).append((ranks, lens))
    return by_size


def _kernels(clock: "StepSurrogate", lens: np.ndarray, k: int, backward: bool) -> np.ndarray:
    """(position, step) kernel seconds of one packed ring of members ``lens``."""
    sizes = chunk_sizes(lens, 2 * k)
    pairs, rows = (np.asarray(x, np.float64) for x in ring_work(sizes[:, :k], sizes[:, ::-1][:, :k]))
    pos, step = np.arange(k)[:, None], np.arange(k)[None, :]
    owner = (pos - step) % k          # step s's kernel on position p meets owner p - s's K/V
    return clock._attn_s(pairs[pos, owner], rows[pos, owner]) * clock.attn_share[backward]


def packed_floor_pairs(layout: PlanArrays, half: float, w: int) -> np.ndarray:
    """Per rank, its packed rings' causal pairs each times the slowdown
    ``1 + half / block`` at the largest block a step's kernel can have (all the
    position's rows of every member): ``surrogate.layout_floor``'s share of them.
    The rings of one size at once (a static CP layout's are all of one size)."""
    pairs = np.zeros(w)
    for k, rings in _by_size(layout).items():
        L = np.concatenate([lens for _, lens in rings])                # every member, ring after ring
        starts = np.cumsum([0] + [len(lens) for _, lens in rings[:-1]])
        b = np.arange(2 * k + 1) * L[:, None] // (2 * k)              # (members, chunk bounds)
        # Position i holds chunks i and 2k - 1 - i (slices: views, not copies).
        first, second = (b[:, :k], b[:, 1:k + 1]), (b[:, 2 * k - 1:k - 1:-1], b[:, 2 * k:k:-1])
        held = np.add.reduceat(causal_pairs(*first) + causal_pairs(*second), starts, axis=0)
        rows = np.add.reduceat(first[1] - first[0] + second[1] - second[0], starts, axis=0)
        pairs += np.bincount(np.stack([r for r, _ in rings]).ravel(), weights=(held * (1 + half / rows)).ravel(),
                             minlength=w)
    return pairs
