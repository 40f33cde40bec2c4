"""Sampler state across Megatron checkpoints: a resumed run sees the same batches.

Megatron-LM checkpoints record ``iteration`` and ``consumed_{train,valid}_samples``
and, in ``state_dict['args']``, the whole argument namespace.  Zeppelin's sampler
is a pure function of its configuration (data, seed, ``--seq-length``, token
budget) and the number of global batches drawn, and every Megatron iteration
consumes exactly one global batch (``--global-batch-size / DP`` packed
micro-batches per rank, split from one sampler draw).  So:

* **save**: nothing extra to write.  The hand-off stores :func:`data_state` on
  ``args.zeppelin_data_state`` so every checkpoint carries the sampler's position
  and the fingerprint of its data inside Megatron's own ``args`` entry (readable
  with ``torch.load(...)['args'].zeppelin_data_state``) -- no patch to
  ``checkpointing.py``;
* **restore**: after Megatron loaded the checkpoint, :func:`restore_sampler` moves a
  fresh sampler to the state it had after ``args.iteration`` batches, by walking
  batch boundaries (a ``searchsorted`` per batch, no pieces materialised).
"""

from __future__ import annotations

from typing import Any

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler import TokenBudgetSampler

#: Bumped when the meaning of the saved state changes.
STATE_VERSION = 1


def data_state(sampler_state: dict[str, Any], batches_consumed: int) -> dict[str, Any]:
    """What a checkpoint carries for the data path after ``batches_consumed`` global batches."""
    return {"version": STATE_VERSION, "batches_consumed": int(batches_consumed), "sampler": dict(sampler_state)}


def sampler_state_at(sampler: TokenBudgetSampler, batches: int) -> dict[str, Any]:
    """The ``state_dict()`` of ``sampler``'s configuration after it yielded ``batches``
    batches from the start, computed from batch boundaries alone."""
    if batches < 0:
        raise ConfigError(f"cannot resume at a negative batch count ({batches})")
    epoch, remaining = 0, batches
    while True:
        bounds = sampler.batch_bounds(epoch)
        if not bounds:
            raise ConfigError(f"epoch {epoch} of the sampler holds no batch; the data is smaller than "
                              "one global batch with drop_last")
        if remaining < len(bounds):
            # After batch j - 1 of an epoch the sampler stands at batch j's first piece;
            # after an epoch's last batch it stands at the next epoch's start (j = 0).
            offset = bounds[remaining][0]
            break
        remaining -= len(bounds)
        epoch += 1
    return {**sampler.state_dict(), "epoch": epoch, "offset": offset, "index": batches}


def restore_sampler(sampler: TokenBudgetSampler, batches_consumed: int,
                    saved: dict[str, Any] | None = None) -> None:
    """Move a freshly built ``sampler`` to where it stood after ``batches_consumed`` batches.

    ``saved`` (a :func:`data_state` read back from a checkpoint, when the caller has
    it) must agree: same data fingerprint and the same position.
    """
    state = sampler_state_at(sampler, batches_consumed)
    if saved is not None:
        if saved.get("version") != STATE_VERSION:
            raise ConfigError(f"checkpoint data state has version {saved.get('version')}, this megatron-zeppelin "
                              f"reads version {STATE_VERSION}; resume with the release that wrote it")
        if saved.get("batches_consumed") != batches_consumed or saved.get("sampler") != state:
            raise ConfigError(f"checkpoint data state {saved.get('sampler')} does not match this run's sampler "
                              f"after {batches_consumed} batches ({state}); resume with the same --data-path, "
                              "--split, --seq-length, --zeppelin-tokens-per-gpu, data-parallel size and seed")
    sampler.load_state_dict(state)
