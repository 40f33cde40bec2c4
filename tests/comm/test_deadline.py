"""Deadline: every wait on a peer is bounded and fails as one line naming the operation."""

from __future__ import annotations

import concurrent.futures
import time
from datetime import timedelta

import pytest

from megatron_zeppelin.comm import deadline as deadline_mod
from megatron_zeppelin.comm.deadline import CommTimeoutError, Deadline


class StuckWork:
    """A work whose wait honours only an explicit timeout (gloo's p2p without one waits forever)."""

    def __init__(self):
        self.timeouts = []

    def wait(self, timeout: timedelta | None = None):
        self.timeouts.append(timeout)
        raise RuntimeError("[gloo] Timed out waiting 1000ms for recv operation to complete\nsecond line")


def test_wait_passes_the_deadline_and_names_the_operation():
    work = StuckWork()
    with pytest.raises(CommTimeoutError) as exc:
        Deadline(1.5).wait(work, lambda: "rank 2: receive from rank 3")
    assert work.timeouts == [timedelta(seconds=1.5)]
    message = str(exc.value)
    assert message.startswith("rank 2: receive from rank 3 did not complete within --timeout 1.5 s")
    assert "Timed out waiting" in message and "\n" not in message


def test_a_stuck_worker_future_fails_after_the_deadline(monkeypatch):
    monkeypatch.setattr(deadline_mod, "WORKER_GRACE_S", 0.1)
    never = concurrent.futures.Future()
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match="rank 1: routed round 4 did not complete within --timeout 0.2 s"):
        Deadline(0.2).result(never, lambda: "rank 1: routed round 4")
    assert time.monotonic() - start < 5


def test_a_worker_error_passes_through_unchanged():
    failed = concurrent.futures.Future()
    failed.set_exception(CommTimeoutError("rank 0 could not send to rank 1"))
    with pytest.raises(CommTimeoutError, match="^rank 0 could not send to rank 1$"):
        Deadline(1).result(failed, lambda: "unused")


def test_collective_errors_become_one_line():
    with pytest.raises(CommTimeoutError, match="rank 3: gradient all-reduce of step 2 did not complete"):
        with Deadline(5).collective("rank 3: gradient all-reduce of step 2"):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\n  more")
    with pytest.raises(ValueError):
        with Deadline(5).collective("not a comm error"):
            raise ValueError("passes through")


def test_without_seconds_the_wait_is_the_backends_own():
    # NCCL: a wait with a timeout would block the CPU; the group's watchdog bounds it instead.
    work = StuckWork()
    with pytest.raises(CommTimeoutError, match=r"rank 0: round 1 did not complete \(process group timeout\)"):
        Deadline(None).wait(work, lambda: "rank 0: round 1")
    assert work.timeouts == [None]
