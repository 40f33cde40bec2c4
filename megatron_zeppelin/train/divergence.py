"""A diverged run stops within the step it diverged in, on every rank.

After the gradient all-reduce every rank holds the same gradient norm and, once
the step's statistics are gathered, every rank's loss.  A NaN or infinite value
in either means the weights are about to be destroyed: Megatron-LM's own
``--check-for-nan-in-loss-and-grad`` stops the run there, and so does the
trainer, before the optimizer applies the step (so no checkpoint or later log
line holds a diverged value).  Every rank raises the same one-line error from
the same gathered values, so no rank waits on a peer that already stopped.
"""

from __future__ import annotations

import math
from typing import Sequence


class Diverged(RuntimeError):
    """The loss or the gradient norm of a step is not finite (one line: step, rank, value)."""


def check_finite(step: int, rank_losses: Sequence[float], grad_norm: float, lr: float) -> None:
    """Raise :class:`Diverged` when a rank's loss or the global gradient norm is
    NaN or infinite.  ``step`` is the step's number in the JSON log (0-based);
    ``rank_losses[r]`` is rank ``r``'s summed token loss of the step."""
    bad = next((r for r, loss in enumerate(rank_losses) if not math.isfinite(loss)), None)
    if bad is None and math.isfinite(grad_norm):
        return
    what = (f"rank {bad}'s loss is {rank_losses[bad]}" if bad is not None
            else f"the gradient norm is {grad_norm} (rank 0; every rank's loss is finite)")
    raise Diverged(f"training diverged at step {step}: {what}; the step was not applied and nothing after it "
                   f"was logged or saved -- lower --lr (now {lr:g}) or check the data")
