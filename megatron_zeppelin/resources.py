"""What this machine can hold: sizes are checked against it before work starts.

A size the user's inputs imply (a sampler's piece table, a rank per simulated
GPU) is compared with the memory the process may still take -- the smaller of
the kernel's ``MemAvailable`` and what an address-space limit
(``ulimit -v``, ``resource.setrlimit``) leaves -- and with the cores it may run
on, so an impossible run is one line with the number instead of an
out-of-memory kill minutes later.
"""

from __future__ import annotations

import os
import resource

from megatron_zeppelin.errors import ConfigError

#: Share of the available memory one sized structure may take (the rest is for
#: the model, the plans and whoever else runs on the machine).
MEMORY_SHARE = 0.5
#: Simulated GPUs (forked ranks) per core the trainer starts at most: beyond
#: that the ranks' collectives time out on a starved machine.
MAX_RANKS_PER_CORE = 16
#: Private memory one forked trainer rank takes at least (the tiny model's rank
#: measured about 350 MB resident, most of it shared with the launcher).
RANK_BYTES = 100 * 2**20


def available_memory_bytes() -> int:
    """Bytes this process may still allocate (``MemAvailable``, capped by ``RLIMIT_AS``)."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        available = min(available, max(limit - _address_space_bytes(), 0))
    return available


def _address_space_bytes() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return 0


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_memory(need_bytes: int, what: str, fix: str) -> None:
    """One line when ``need_bytes`` (for ``what``) exceeds :data:`MEMORY_SHARE` of
    what this machine has left."""
    available = available_memory_bytes()
    if need_bytes > MEMORY_SHARE * available:
        raise ConfigError(f"{what} would take about {_gib(need_bytes)} of memory, more than {MEMORY_SHARE:.0%} of "
                          f"the {_gib(available)} this machine has available; {fix}")


def check_forkable(world_size: int) -> None:
    """The trainer can fork ``world_size`` ranks here (cores and memory), or one line."""
    cores = usable_cores()
    if world_size > MAX_RANKS_PER_CORE * cores:
        raise ConfigError(f"--nodes x --gpus-per-node = {world_size} ranks is more than this machine's {cores} "
                          f"cores can run as forked processes (at most {MAX_RANKS_PER_CORE * cores}); simulate "
                          "fewer GPUs, or launch on real GPUs with torchrun/srun")
    check_memory(world_size * RANK_BYTES, f"forking {world_size} ranks",
                 "simulate fewer GPUs, or launch on real GPUs with torchrun/srun")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
