"""prefetch.py: items in order one ahead, errors where they belong, and the
shorter switch interval only while the worker produces an item."""

from __future__ import annotations

import sys
import threading

import pytest

from megatron_zeppelin.prefetch import PLANNING_SWITCH_INTERVAL_S, Prefetcher, planning_switch_interval


def test_items_come_in_order_and_an_error_at_the_item_that_raised():
    def items():
        yield from (1, 2)
        raise ValueError("batch 3 cannot be planned")

    pre = Prefetcher(items())
    assert [next(pre), next(pre)] == [1, 2]
    with pytest.raises(ValueError, match="batch 3"):
        next(pre)
    pre.close()


def test_the_worker_plans_under_the_short_interval_and_the_callers_comes_back():
    before = sys.getswitchinterval()
    seen = []

    def items():
        for _ in range(3):
            seen.append(sys.getswitchinterval())
            yield len(seen)

    pre = Prefetcher(items())
    assert list(pre) == [1, 2, 3]
    pre.close()
    assert seen == [PLANNING_SWITCH_INTERVAL_S] * 3
    assert sys.getswitchinterval() == before


def test_overlapping_planners_restore_the_interval_once_both_are_done():
    before = sys.getswitchinterval()
    inside, release = threading.Event(), threading.Event()

    def other_planner():
        with planning_switch_interval():
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=other_planner)
    worker.start()
    inside.wait(5)
    with planning_switch_interval():
        assert sys.getswitchinterval() == PLANNING_SWITCH_INTERVAL_S
    # The other planner is still inside: its interval holds.
    assert sys.getswitchinterval() == PLANNING_SWITCH_INTERVAL_S
    release.set()
    worker.join()
    assert sys.getswitchinterval() == before
