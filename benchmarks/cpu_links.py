"""Measure what the ``cpu-sim`` cluster preset describes: gloo point-to-point
latency and bandwidth between two local processes, and the fp32 GEMM rate of one
process while another runs.

    python benchmarks/cpu_links.py

Copy the figures into ``configs/clusters/cpu-sim.yaml`` (with the date and load).
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping_pong(rank: int, t: torch.Tensor, reps: int) -> float:
    """Seconds per one-way message of ``t`` (median of 3 runs of ``reps`` round trips)."""
    runs = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        runs.append((time.perf_counter() - t0) / (2 * reps))
    return sorted(runs)[1]


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for numel, reps in ((1, 200), (1 << 18, 20), (1 << 22, 5)):
        s = _ping_pong(rank, torch.zeros(numel), reps)
        if rank == 0:
            print(f"gloo one-way {numel * 4:>9} bytes: {s * 1e6:9.1f} us  {numel * 4 / s / 1e9:6.2f} GB/s")
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    rate = 2 * 1024 ** 3 * 20 / (time.perf_counter() - t0) / 1e9
    if rank == 0:
        print(f"fp32 GEMM 1024^3: {rate:.1f} GFLOP/s per process (2 processes running)")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_worker, args=(_free_port(),), nprocs=2)
