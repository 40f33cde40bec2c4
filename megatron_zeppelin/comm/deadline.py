"""Every blocking wait on a peer has a deadline, and its failure is one line.

Gloo's point-to-point ``work.wait()`` without an argument waits forever, so a
stalled peer (SIGSTOP, a stuck GPU) would hang every rank that waits on it,
and a caller blocked on a worker thread's future would hang behind it.  A
:class:`Deadline` bounds both, and turns whatever the backend raised (a
timeout, a closed connection) into a :class:`CommTimeoutError` whose message
names this rank, the operation and the peer -- the one line the launcher
prints.  Communicators take a Deadline and call it at their wait sites.
"""

from __future__ import annotations

import concurrent.futures
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

from megatron_zeppelin.errors import brief

#: Seconds a wait on a peer may block when nobody says otherwise (the
#: trainer's ``--timeout`` default; well under NCCL's 10 minutes).
DEFAULT_TIMEOUT_S = 90.0
#: Extra seconds a caller waits on a worker thread beyond the worker's own
#: deadline, so that the worker's more precise error (which hop) wins the race.
WORKER_GRACE_S = 2.0


class CommTimeoutError(RuntimeError):
    """A wait on a peer passed its deadline or the peer's connection failed
    (a peer died, stalled, or the ranks disagree on the communication)."""


@dataclass(frozen=True)
class Deadline:
    """How long one wait on a peer may block (``--timeout``)."""

    seconds: float | None
    """Seconds before a wait fails (the trainer's ``--timeout``).  None on NCCL:
    there a wait only orders streams, and a wait with a timeout would block the
    CPU; the process group's timeout and its watchdog bound the transfer."""

    @property
    def timedelta(self) -> timedelta | None:
        return None if self.seconds is None else timedelta(seconds=self.seconds)

    def wait(self, work: Any, what: Callable[[], str]) -> None:
        """Wait on a ``torch.distributed`` work object; ``what()`` describes the
        operation for the error ("rank 2: receive from rank 3 (round 7)")."""
        try:
            work.wait() if self.seconds is None else work.wait(self.timedelta)
        except RuntimeError as exc:
            raise CommTimeoutError(self._message(what(), exc)) from None

    def result(self, future: concurrent.futures.Future, what: Callable[[], str]) -> Any:
        """The result of a worker thread's ``future``; its own errors pass through."""
        try:
            return future.result(timeout=None if self.seconds is None else self.seconds + WORKER_GRACE_S)
        except concurrent.futures.TimeoutError:
            raise CommTimeoutError(f"{what()} did not complete {self._within}: a peer stalled or died (check "
                                   "the other ranks)") from None

    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Around a collective whose timeout is the process group's: its
        backend error becomes one line naming ``what``."""
        try:
            yield
        except CommTimeoutError:
            raise
        except RuntimeError as exc:
            raise CommTimeoutError(self._message(what, exc)) from None

    @property
    def _within(self) -> str:
        return "(process group timeout)" if self.seconds is None else f"within --timeout {self.seconds:g} s"

    def _message(self, what: str, exc: BaseException) -> str:
        return (f"{what} did not complete {self._within} ({brief(exc)}): a peer stalled or died, or the "
                "ranks disagree on the communication (check the other ranks)")
