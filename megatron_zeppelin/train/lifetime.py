"""Ranks never outlive their launcher, and a signal stops the whole run cleanly.

A launcher killed with SIGKILL runs no cleanup, so its ranks must notice by
themselves: on Linux the kernel sends them SIGKILL when the launcher dies
(``prctl(PR_SET_PDEATHSIG)``); everywhere a watchdog thread checks every half
second that the parent is still the one that started the rank (the fallback,
and a guard against the race where the parent died before the ``prctl``).
A launcher stopped by SIGTERM or Ctrl-C raises :class:`Interrupted`, stops its
ranks in its ``finally`` and exits with one line.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

#: ``prctl`` option: signal to deliver to this process when its parent dies.
PR_SET_PDEATHSIG = 1
#: Seconds between the watchdog's checks of the parent.
WATCH_INTERVAL_S = 0.5


class Interrupted(Exception):
    """The launcher got SIGINT or SIGTERM; its ranks have been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; every rank was stopped")
        self.signum = signum


def die_with_parent(parent_pid: int) -> None:
    """Make this process (a rank) die as soon as ``parent_pid`` (its launcher) does."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still covers it
    if os.getppid() != parent_pid:   # the parent died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while True:
            threading.Event().wait(WATCH_INTERVAL_S)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zeppelin-parent-watchdog", daemon=True).start()


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise :class:`Interrupted` (so the
    caller's ``finally`` stops the ranks); the old handlers come back after."""
    def raise_interrupted(signum: int, _frame) -> None:
        raise Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield   # only the main thread may set handlers; the caller's finally still runs
        return

    old = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def rank_signals() -> None:
    """In a forked rank: Ctrl-C reaches the whole foreground process group, but
    only the launcher acts on it (it stops the ranks; a rank would print a
    traceback); SIGTERM, the launcher's stop, ends the rank at once (a fork
    inherits the launcher's :func:`signals_interrupt` handlers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
