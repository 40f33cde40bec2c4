"""Run test cases on N gloo processes spawned ONCE per test module.

Spawning processes and building a process group costs seconds on a small CPU
machine, so a module spawns its world once and runs many cases in it::

    from tests.distributed import world_fixture

    world = world_fixture(4)                  # module-scoped pytest fixture

    def _case(rank, world_size, n):           # module-level: sent by reference
        ...                                   # torch.distributed is initialised (gloo)
        return something_picklable

    def test_it(world):
        results = world.run(_case, 3)         # one result per rank, rank order

A case that raises on any rank fails the test with that rank's traceback; a
case that hangs past ``timeout_s`` kills the world (later cases then fail fast).

One freshly *spawned* launcher imports torch and the test module, then *forks*
the ranks: each rank costs a fork, not an import (which is what dominates on a
busy 2-core machine), and no rank inherits the thread pools of the pytest
process.  Each rank runs with one intra-op thread.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import pytest


def _launcher(world_size: int, store_path: str, timeout_s: float, modules: Sequence[str],
              owner_pid: int, tasks, results) -> None:
    import torch  # imported once here, inherited by every rank

    # The first backward with an explicit gradient lazily imports sympy via
    # torch.fx (seconds per process on a busy machine): pay it once, before forking.
    torch.ones(1, requires_grad=True).backward(torch.ones(1))
    for name in modules:
        importlib.import_module(name)
    ctx = mp.get_context("fork")
    ranks = [ctx.Process(target=_worker, args=(r, world_size, store_path, timeout_s, owner_pid,
                                               tasks[r], results))
             for r in range(world_size)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()


def _worker(rank: int, world_size: int, store_path: str, timeout_s: float, owner_pid: int,
            tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if _alive(owner_pid):
                continue
            return                                      # pytest died: do not linger
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # report every failure to the parent, keep serving
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


class World:
    """``world_size`` gloo processes serving :meth:`run` calls.  ``modules`` are
    imported once before the ranks fork (the test module, so that its functions
    and their imports are already loaded in every rank)."""

    def __init__(self, world_size: int, timeout_s: float = 60.0, modules: Sequence[str] = ()) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.timeout_s = timeout_s
        fd, self._store = tempfile.mkstemp(prefix="zeppelin-pg-")
        os.close(fd)
        os.unlink(self._store)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        # not a daemon: daemonic processes may not fork the ranks
        self._launcher = ctx.Process(target=_launcher, args=(world_size, self._store, timeout_s, tuple(modules),
                                                             os.getpid(), self._tasks, self._results))
        self._launcher.start()
        self._broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order."""
        if self._broken:
            pytest.fail("the process world was killed by an earlier hanging case")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: list[Any] = [None] * self.world_size
        errors = []
        for _ in range(self.world_size):
            rank, ok, value = self._next_result(fn.__name__)
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            pytest.fail(f"{fn.__name__} failed:\n" + "\n".join(sorted(errors)), pytrace=False)
        return out

    def _next_result(self, name: str) -> tuple[int, bool, Any]:
        waited, step = 0.0, 2.0
        while True:
            try:
                return self._results.get(timeout=step)
            except queue.Empty:
                waited += step
            if not self._launcher.is_alive() or waited >= self.timeout_s + 30:
                why = (f"the launcher died (exit code {self._launcher.exitcode})"
                       if not self._launcher.is_alive() else f"it hung for {waited:.0f} s")
                self._broken = True
                self.close()
                pytest.fail(f"{name} got no result from some rank: {why}")

    def close(self) -> None:
        if not self._broken:
            for q in self._tasks:
                q.put(None)
        self._launcher.join(timeout=10)
        if self._launcher.is_alive():
            # a hung world: kill the ranks (the launcher's children), then the launcher
            for pid in _children(self._launcher.pid):
                os.kill(pid, 9)
            self._launcher.kill()
        if os.path.exists(self._store):
            os.unlink(self._store)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def world_fixture(world_size: int, timeout_s: float = 60.0):
    """A module-scoped pytest fixture yielding a :class:`World` of ``world_size``
    ranks, with the requesting test module preloaded."""

    @pytest.fixture(scope="module")
    def world(request):
        w = World(world_size, timeout_s, modules=[request.module.__name__])
        yield w
        w.close()

    return world
