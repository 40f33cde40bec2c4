"""One item ahead on a background thread: plan the next batch while this one trains.

Used by the trainer (micro-batch i + 1 planned while i computes) and by the
Megatron-LM loader (``integration.hooks.ZeppelinLoader``, ``--zeppelin-prefetch``).

Sampling and planning are pure host code (Python + numpy), so they can run on a
worker thread while the main thread runs the model; collectives stay on the
main thread.  The worker releases nothing it does not own: it only advances the
iterator it was given.

Planning shares the interpreter lock with the thread that launches the step's
kernels.  Each torch op releases the lock while it runs, and taking it back waits
for the worker to give it up: up to the interpreter's switch interval, 5 ms by
default, per op in the worst case.  While the worker produces an item the
interval is :data:`PLANNING_SWITCH_INTERVAL_S` instead
(``benchmarks/planning_interference.py`` measures both).
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")

_DONE = object()

PLANNING_SWITCH_INTERVAL_S = 1e-3
"""Interpreter switch interval while a worker plans: a launching thread waits at
most this long for the lock after each op (the default 5 ms let a planning thread
slow a launch-bound loop several times over; shorter intervals cost switching)."""

_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


@contextmanager
def planning_switch_interval():
    """Shorten the interpreter's switch interval (process-wide) while in the
    block; the first of overlapping blocks saves the caller's, the last restores it."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, PLANNING_SWITCH_INTERVAL_S))
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)


class Prefetcher(Generic[T]):
    """Iterates ``items``, computing item ``k + 1`` on a worker thread while the
    caller works on item ``k``.  An exception raised while producing an item is
    raised by the ``next()`` that would have returned it."""

    def __init__(self, items: Iterator[T], name: str = "zeppelin-prefetch") -> None:
        self._items = items
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._next: Future | None = None

    def _pull(self) -> object:
        with planning_switch_interval():
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
