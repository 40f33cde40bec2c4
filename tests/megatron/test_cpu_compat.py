"""megatron/cpu_compat.py: what it redirects on a CPU rank, and nothing on a GPU one.

The distributed checks (Megatron-Core's sequence-parallel layers on gloo equal the
reference) are in tests/train/test_sequence_parallel.py; here the two redirections
are checked one by one in this process, and undone after each test; the uneven
gathers on 2 gloo ranks.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel import random as mrandom

from megatron_zeppelin.megatron import cpu_compat


@pytest.fixture
def undone(monkeypatch):
    """Everything apply_cpu_compat changes is restored after the test; TP rank 1."""
    for name in cpu_compat.ALLOCATING_MODULES + cpu_compat.STREAM_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "torch", torch)
    for name in cpu_compat.STREAM_MODULES:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "maybe_move_tensor_to_cpu", module.maybe_move_tensor_to_cpu)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", mrandom._CUDA_RNG_STATE_TRACKER)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_rank", lambda: 0)
    return monkeypatch


def test_refuses_where_cuda_is_available(undone):
    undone.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CPU ranks only"):
        cpu_compat.apply_cpu_compat(seed=5)
    assert not cpu_compat.cpu_compat_applied()


def test_allocation_sites_see_the_cpu_and_nothing_else_changes(undone):
    cpu_compat.apply_cpu_compat(seed=5)
    assert cpu_compat.cpu_compat_applied()
    from megatron.core import utils
    from megatron.core.tensor_parallel import layers, mappings

    for module in (mappings, layers, utils):
        assert module.torch.cuda.current_device() == torch.device("cpu")
        assert module.torch.cuda.is_available is torch.cuda.is_available  # the rest is torch's own
        assert module.torch.empty is torch.empty
        assert module.torch.distributed.all_reduce is torch.distributed.all_reduce
    # Megatron-Core's own global buffer now hands out CPU tensors.
    buffer = utils.GlobalMemoryBuffer().get_tensor([2, 3], torch.float32, "mpu")
    assert buffer.device.type == "cpu" and buffer.shape == (2, 3)
    assert torch.cuda.current_device is not mappings.torch.cuda.current_device  # torch itself untouched


def test_dispatcher_streams_are_cpu_streams_and_host_copies_are_as_asked(undone):
    cpu_compat.apply_cpu_compat(seed=5)
    cpu_compat.apply_cpu_compat(seed=5)   # idempotent: the host copy is wrapped once
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cuda = token_dispatcher.torch.cuda
    side = cuda.Stream()
    assert cuda.current_stream() != side and cuda.current_stream() is cuda.current_stream()
    with cuda.stream(side):
        side.wait_stream(cuda.current_stream())
    side.record_event().synchronize()
    splits = torch.tensor([3, 5])
    # Megatron's own copy leaves a CPU tensor a tensor; the dispatcher asked for NumPy
    # split sizes (gloo's all_to_all_single takes no tensor).
    assert torch.is_tensor(moe_utils.maybe_move_tensor_to_cpu(splits, as_numpy=True))
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True).tolist() == [3, 5]
    assert type(token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)).__module__ == "numpy"
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits) is splits
    assert token_dispatcher.maybe_move_tensor_to_cpu.__wrapped__ is moe_utils.maybe_move_tensor_to_cpu


def test_rng_tracker_forks_the_cpu_generator_per_tp_rank(undone):
    cpu_compat.apply_cpu_compat(seed=5)
    tracker = get_cuda_rng_tracker()
    torch.manual_seed(0)
    caller = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    # The model-parallel stream, seeded as model_parallel_cuda_manual_seed seeds TP rank 1's.
    stream = torch.Generator().manual_seed(5 + 2718 + 1)
    assert torch.equal(first, torch.rand(4, generator=stream))
    assert torch.equal(second, torch.rand(4, generator=stream))  # continues, never repeats
    assert torch.equal(torch.get_rng_state(), caller)  # the caller's generator is as it was
    with tracker.fork(mrandom.get_expert_parallel_rng_tracker_name()):
        expert = torch.rand(4)
    assert torch.equal(expert, torch.rand(4, generator=torch.Generator().manual_seed(5 + 1024)))
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("no-such-state"):
            pass


def _uneven_collectives(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    view = cpu_compat._DistributedOnGloo("torch.distributed")
    mine = torch.arange(3 * (rank + 1) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank  # 3 rows, 6 rows
    gathered = [torch.empty(3, 2), torch.empty(6, 2)]
    view.all_gather(gathered, mine)
    pieces = [torch.full((3, 2), 1.0 + rank), torch.full((6, 2), 10.0 * (rank + 1))]
    reduced = torch.empty(3 * (rank + 1), 2)
    view.reduce_scatter(reduced, pieces)
    torch.save({"gathered": gathered, "reduced": reduced}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_uneven_all_gather_and_reduce_scatter_on_gloo(tmp_path):
    """The dispatcher's gathers of different token counts per TP rank: gloo alone
    refuses them; through the view each rank gets every rank's rows, and the
    reduce-scatter sums each rank's piece over the ranks."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_uneven_collectives, args=(port, str(tmp_path)), nprocs=2, start_method="fork")
    expect = [torch.arange(6.0).view(3, 2), torch.arange(12.0).view(6, 2) + 100]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(torch.equal(g, e) for g, e in zip(got["gathered"], expect))
        assert torch.equal(got["reduced"], torch.full((3, 2), 3.0) if rank == 0 else torch.full((6, 2), 30.0))
