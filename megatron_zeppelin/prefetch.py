"""One item ahead on a background thread: plan the next batch while this one trains.

Used by the trainer (micro-batch i + 1 planned while i computes) and by the
Megatron-LM loader (``integration.hooks.ZeppelinLoader``, ``--zeppelin-prefetch``).

Sampling and planning are pure host code (Python + numpy), so they can run on a
worker thread while the main thread runs the model; collectives stay on the
main thread.  The worker releases nothing it does not own: it only advances the
iterator it was given.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")

_DONE = object()


class Prefetcher(Generic[T]):
    """Iterates ``items``, computing item ``k + 1`` on a worker thread while the
    caller works on item ``k``.  An exception raised while producing an item is
    raised by the ``next()`` that would have returned it."""

    def __init__(self, items: Iterator[T], name: str = "zeppelin-prefetch") -> None:
        self._items = items
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._next: Future | None = None

    def _pull(self) -> object:
        return next(self._items, _DONE)

    def __iter__(self) -> "Prefetcher[T]":
        return self

    def __next__(self) -> T:
        item = (self._next or self._pool.submit(self._pull)).result()
        if item is _DONE:
            self._next = None
            raise StopIteration
        self._next = self._pool.submit(self._pull)
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Wait for the item in flight (if any) and stop the worker."""
        self._pool.shutdown(wait=True, cancel_futures=True)
