"""Sampler state across Megatron checkpoints: a resumed run trains every piece once.

Megatron-LM checkpoints record ``iteration`` and, in ``state_dict['args']``, the
whole argument namespace.  The hand-off stores :func:`data_state` on
``args.zeppelin_data_state`` whenever it hands out a training batch, so every
checkpoint carries the sampler's position (epoch, first piece not yet drawn,
pieces deferred to the next step) and the fingerprint of its data inside
Megatron's own ``args`` entry (readable with ``torch.load(...)['args']``) -- no
patch to ``checkpointing.py``.

On ``--load`` :func:`restore_sampler` puts a fresh sampler where the saved one
stood.  The pieces' order is a pure function of the data, ``--seq-length`` and
the seed, not of the batch size, so a run that changed the global batch in
tokens (``--zeppelin-tokens-per-gpu``, ``--global-batch-size``,
``--zeppelin-batch-fill``, the data-parallel size) continues exactly at the
first piece not yet trained (only the batch boundaries from there on differ);
other data, another ``--seq-length`` or another seed is refused in one line.
A checkpoint without the state (written without ``--zeppelin``) resumes at
batch ``iteration`` of this run's batches, walked from batch boundaries alone.
"""

from __future__ import annotations

from typing import Any

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler import TokenBudgetSampler
from megatron_zeppelin.sampler.deferral import DeferringSampler

#: Bumped when the meaning of the saved state changes.
STATE_VERSION = 1


def data_state(sampler_state: dict[str, Any], batches_consumed: int, tokens_per_batch: int) -> dict[str, Any]:
    """What a checkpoint carries for the data path after ``batches_consumed`` global batches
    of ``tokens_per_batch`` tokens."""
    return {"version": STATE_VERSION, "batches_consumed": int(batches_consumed),
            "tokens_per_batch": int(tokens_per_batch), "sampler": dict(sampler_state)}


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


#: The sampler state's fingerprint keys, in ``pretrain_gpt.py``'s terms.
SAME_PIECES = {"seed": "seed (--zeppelin-seed, else --seed)", "max_seq_len": "--seq-length",
               "datasets": "documents (--data-path, --split)", "weights": "blend weights (--data-path)",
               "shuffle": "shuffle"}

#: Keys of a sampler state that say where it stands, not what it draws from.
POSITION = ("epoch", "offset", "index", "carried")


def check_same_pieces(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Raise ConfigError unless the sampler states ``saved`` (a checkpoint's) and
    ``now`` (this run's) order the same pieces: same documents, ``--seq-length`` and seed."""
    for key, what in SAME_PIECES.items():
        if saved.get(key) != now.get(key):
            raise ConfigError(f"the --load checkpoint drew its batches with {what} = {saved.get(key)}, this run "
                              f"has {now.get(key)}: its position means nothing in this run's order of pieces, "
                              "so a resume would skip or repeat data; resume with the same value, or train "
                              "from scratch with another --save")


def restore_sampler(sampler: DeferringSampler, batches_consumed: int,
                    saved: dict[str, Any] | None = None) -> str | None:
    """Move a freshly built ``sampler`` to where the checkpoint's stood after
    ``batches_consumed`` global batches (Megatron's ``iteration``).

    ``saved``: the checkpoint's :func:`data_state` (None: it has none; the position
    is walked from this run's batch boundaries).  Returns a one-line note when the
    global batch changed since the save (the run goes on at the first piece not yet
    trained); raises :class:`ConfigError` when the checkpoint cannot be continued
    exactly.
    """
    if saved is None:
        sampler.load_state_dict(sampler_state_at(sampler.sampler, batches_consumed))
        return None
    if saved.get("version") != STATE_VERSION:
        raise ConfigError(f"the --load checkpoint's Zeppelin data state has version {saved.get('version')}, this "
                          f"megatron-zeppelin reads version {STATE_VERSION}; resume with the release that wrote it")
    if saved.get("batches_consumed") != batches_consumed:
        raise ConfigError(f"the --load checkpoint's Zeppelin data state is after global batch "
                          f"{saved.get('batches_consumed')}, but its iteration is {batches_consumed}; the "
                          "checkpoint is damaged: load an earlier one (--ckpt-step)")
    state = saved["sampler"]
    check_same_pieces(state, sampler.sampler.state_dict())
    sampler.load_state_dict(state)
    old, new = saved.get("tokens_per_batch"), sampler.sampler.tokens_per_batch
    if old is None or old == new:
        return None
    return (f"zeppelin: resuming at iteration {batches_consumed} with {new} tokens per global batch (the "
            f"checkpoint's run drew {old}): training goes on at the checkpoint's first untrained piece (epoch "
            f"{state['epoch']}, piece {state['offset']}, {len(state.get('carried', []))} deferred), no piece is "
            "skipped or repeated; batch boundaries from here on differ from the old run's")
