"""Hand the planner batches it can place: defer a piece to the next step, never drop one.

A global batch that fills the token cap (nearly) exactly can have no placement
for a strategy even though every piece alone fits: zigzag shards come in fixed
sizes, and whole-sequence packers need a rank with room for each sequence.
Failing the run there would lose it to a batch the sampler chose; dropping the
piece would lose data silently.  Instead the last piece of the batch (in
sampling order) is carried into the next step, ahead of that step's own pieces,
until the strategy finds a plan.  The carried pieces are part of the sampler's
state, so a checkpoint resumes exactly (no piece lost or repeated).

Pure Python: ``make_plan`` is whatever turns lengths into a plan and raises
:class:`~megatron_zeppelin.errors.InfeasibleError` when it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

from megatron_zeppelin.errors import ConfigError, InfeasibleError, brief
from megatron_zeppelin.sampler.batch_sampler import GlobalBatch, Piece, TokenBudgetSampler

P = TypeVar("P")


@dataclass
class DeferringSampler(Generic[P]):
    """Batches of ``sampler`` with pieces no plan could hold carried to the next step."""

    sampler: TokenBudgetSampler
    """The token-budget sampler whose batches are handed out (its own state advances as usual)."""
    carried: list[Piece] = field(default_factory=list)
    """Pieces deferred by earlier steps, in sampling order: they open the next batch."""
    _batches: Iterator[GlobalBatch] | None = field(default=None, init=False, repr=False)

    def next_planned(self, make_plan: Callable[[Sequence[int]], P],
                     note: Callable[[str], None]) -> tuple[GlobalBatch, P]:
        """The next batch (carried pieces first) and its plan; ``note`` hears of
        every deferral.  Raises the planner's error only for a batch of a single
        piece, which no deferral can help (the piece itself does not fit)."""
        if self._batches is None:
            self._batches = iter(self.sampler)
        batch = next(self._batches)
        pieces = self.carried + list(batch.pieces)
        self.carried = []
        # Carried pieces first; whatever then exceeds the budget waits (in order).
        budget, kept = self.sampler.tokens_per_batch, 0
        for n, piece in enumerate(pieces):
            if kept + piece.length > budget and n:
                self.carried, pieces = pieces[n:], pieces[:n]
                break
            kept += piece.length
        while True:
            lens = [p.length for p in pieces]
            try:
                plan = make_plan(lens)
                return GlobalBatch(batch.index, batch.epoch, tuple(pieces)), plan
            except InfeasibleError as exc:
                if len(pieces) == 1:
                    raise
                last = pieces.pop()
                self.carried.insert(0, last)
                note(f"step {batch.index}: deferred a piece of {last.length} tokens (document {last.doc}, "
                     f"dataset {last.dataset}) to the next step: no plan for {len(lens)} sequences of "
                     f"{sum(lens)} tokens ({brief(exc, 160)})")

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state plus the carried pieces (``[doc, start, end, dataset]`` each)."""
        return {**self.sampler.state_dict(),
                "carried": [[p.doc, p.start, p.end, p.dataset] for p in self.carried]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ConfigError(f"sampler checkpoint: a {type(state).__name__}, not a state; the checkpoint is damaged")
        carried = state.get("carried", [])
        try:
            pieces = [Piece(int(d), int(s), int(e), int(ds)) for d, s, e, ds in carried]
        except (TypeError, ValueError):
            raise ConfigError("sampler checkpoint: 'carried' must be a list of [doc, start, end, "
                              "dataset] rows; the checkpoint is damaged") from None
        if any(p.length <= 0 for p in pieces):
            raise ConfigError("sampler checkpoint: a carried piece is empty; the checkpoint is damaged")
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "carried"})
        self.carried, self._batches = pieces, None
