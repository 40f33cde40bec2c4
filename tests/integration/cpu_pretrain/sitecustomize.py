"""Megatron-LM's own ``pretrain()`` on CPU gloo ranks, for test_pretrain_gpt_cpu.py only.

Put this folder first on ``PYTHONPATH`` of ``torchrun ... pretrain_gpt.py
--distributed-backend gloo``: Python imports it at start-up in every process.  It
guards the CUDA calls Megatron-LM core_v0.16.1's training path makes
unconditionally.  Each guard places memory or answers a bookkeeping question; none
changes what the model computes (the model, loss, optimizer, checkpoints and data
path are Megatron's and Zeppelin's own; Megatron-Core's tensor-parallel buffers and
RNG tracker go to the CPU through ``megatron_zeppelin/megatron/cpu_compat.py``, which
the patched model builder applies on any rank without CUDA):

* ``initialize_megatron``'s ``assert torch.cuda.is_available()``: it is called with
  ``allow_no_cuda=True`` (Megatron's own switch for CPU processes).
* ``_initialize_distributed`` builds Megatron's model-parallel groups only where
  ``torch.cuda.device_count() > 0``: inside that call each rank has one device
  (its CPU), and ``torch.cuda.set_device`` does nothing.
* ``fused_kernels.load`` (nvcc builds of the fused softmax): nothing to build.
* A tensor asked for on a CUDA device (``device="cuda"`` or
  ``torch.cuda.current_device()``, ``.cuda()``) is made on the CPU;
  ``Tensor.type()`` answers the CUDA name of its dtype (Megatron asserts its fp32
  grads are ``torch.cuda.FloatTensor``): :class:`CudaMeansCpu`.
* ``torch.cuda`` functions that raise where torch finds no GPU: :data:`CUDA_ON_CPU`.

So a CPU run does not exercise: CUDA streams and kernels, NCCL, Megatron's fused
kernels, device memory, or the CUDA generator's state (dropout here is 0).

Each process prints at exit which guards it used and how often
(``cpu_pretrain: rank R guarded ...``).
"""

import atexit
import collections
import importlib.abc
import importlib.machinery
import os
import sys
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_CPU_STREAM = SimpleNamespace(wait_stream=lambda other: None)
USED: collections.Counter = collections.Counter()


def _means_cuda(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class CudaMeansCpu(TorchFunctionMode):
    """A tensor asked for on a CUDA device is made on the CPU; nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            USED["Tensor.cuda()"] += 1
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            USED["Tensor.type()"] += 1
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _means_cuda(kwargs.get("device")):
            USED[f"{getattr(func, '__name__', func)}(device=cuda)"] += 1
            kwargs = {**kwargs, "device": _CPU}
        return func(*args, **kwargs)


def _counted(name, answer):
    def guarded(*args, **kwargs):
        USED[f"torch.cuda.{name}"] += 1
        return answer(*args, **kwargs)
    return guarded


#: torch.cuda functions that raise where torch finds no GPU, as Megatron-LM's pretrain() path calls them.
CUDA_ON_CPU = {
    "current_device": lambda: _CPU,  # as megatron/cpu_compat.py answers it
    "synchronize": lambda *a, **k: None,  # CPU ops run in order: nothing is pending
    # The DDP set-up's side stream: CPU work runs in order, there is nothing to wait for
    # (torch.cuda.stream(s) is already a no-op without CUDA).
    "Stream": lambda *a, **k: _CPU_STREAM,
    "current_stream": lambda *a, **k: _CPU_STREAM,
    # There is no CUDA generator: its state is empty, and restoring it sets nothing.
    "get_rng_state": lambda *a, **k: torch.empty(0, dtype=torch.uint8),
    "set_rng_state": lambda *a, **k: None,
}


def _initialize_on_cpu(module) -> None:
    initialize, distributed = module.initialize_megatron, module._initialize_distributed

    def initialize_megatron(*args, **kwargs):
        USED["initialize_megatron(allow_no_cuda=True)"] += 1
        return initialize(*args, **{**kwargs, "allow_no_cuda": True})

    def _initialize_distributed(*args, **kwargs):
        USED["_initialize_distributed: device_count() 1 and set_device no-op"] += 1
        count, set_device = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda device: None)
        try:
            return distributed(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = count, set_device

    module.initialize_megatron, module._initialize_distributed = initialize_megatron, _initialize_distributed


def _no_cuda_kernels(module) -> None:
    def load(args):
        USED["fused_kernels.load skipped"] += 1

    module.load = load


#: Megatron modules patched right after they are imported.
AFTER_IMPORT = {"megatron.training.initialize": _initialize_on_cpu,
                "megatron.legacy.fused_kernels": _no_cuda_kernels}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in AFTER_IMPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            AFTER_IMPORT[name](module)

        spec.loader.exec_module = exec_then_patch
        return spec


def _report() -> None:
    if USED:
        used = ", ".join(f"{name} x{n}" for name, n in sorted(USED.items()))
        print(f"cpu_pretrain: rank {os.environ.get('RANK', '?')} guarded {used}", file=sys.stderr, flush=True)


def _install() -> None:
    for name, answer in CUDA_ON_CPU.items():
        setattr(torch.cuda, name, _counted(name, answer))
    sys.meta_path.insert(0, _PatchAfterImport())
    CudaMeansCpu().__enter__()  # for the whole process (its main thread)
    atexit.register(_report)


if "RANK" in os.environ and not torch.cuda.is_available():  # the ranks torchrun starts, not torchrun itself
    _install()
