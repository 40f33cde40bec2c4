"""Settings of the zeppelin planner's packing passes and its light/heavy split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

@dataclass(frozen=True)
class _Pass:
    """Settings of one greedy packing pass (the best pass's plan wins)."""

    level: float
    """Shards must fit under this multiple of the water level all unplaced work
    would reach: lower splits more (finer balance, more kernel-efficiency loss)."""
    density: float
    """Charge a rank's free token slots at this fraction of the remaining work's
    mean attention density, so a rank holding a dense shard keeps its room for
    light tokens (it matters when the batch nearly fills the token cap)."""
    share: float = np.inf
    """Cap a ring at this multiple of the sequence's proportional share of the
    ranks (beyond what the token cap forces): long sequences cannot crowd out
    the next ones."""
    spill: bool = True
    """Let the inter-node tier (searched only when no intra-node group fits)
    use rings (off: only when the token cap forces more ranks than a node has;
    Ulysses groups, whose all-to-alls are priced on the link they use, may
    still span nodes)."""
    remap: bool = True
    """Balance attention alone, then remap to a token-balanced linear layout
    (``PlanContext.remap_enabled``); off: the linear modules keep the attention
    layout, so attention plus linear time is balanced per rank."""


#: Passes, per linear layout in order of usefulness: greedy best subsets of a
#: grid of settings on six corpora at 64 GPUs (docs/planner.md; remap on
#: re-tuned for the all-to-all link fix, with a cheap first setting, the only
#: one large clusters run).
PASSES: tuple[_Pass, ...] = (
    _Pass(1.05, 0.0, spill=False), _Pass(1.0, 0.1), _Pass(1.05, 0.0), _Pass(1.1, 0.2),
    _Pass(1.0, 0.2, spill=False, remap=False), _Pass(0.9, 0.0, spill=False, remap=False),
    _Pass(1.0, 0.0, spill=False, remap=False), _Pass(1.1, 0.2, spill=False, remap=False))
#: A sequence is "light" when its local attention takes at most LIGHT_TIME of
#: the mean per-rank attention time and it holds at most LIGHT_TOKENS of the
#: token cap: it stays local and is placed after the heavy ones by a vectorised
#: LPT fill (too small to unbalance a rank's time or to strand its tokens).
LIGHT_TIME = 0.25
LIGHT_TOKENS = 0.25
#: Packing passes are tried in PASSES order while (heavy sequences x passes)
#: stays within this budget (at least one pass): large clusters get fewer.
PASS_BUDGET = 100
