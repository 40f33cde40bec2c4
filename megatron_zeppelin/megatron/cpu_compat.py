"""Megatron-Core's tensor/sequence/pipeline-parallel code on CPU ranks (gloo), unchanged.

Why this exists: the project tests tensor, sequence and pipeline parallelism and
MoE on machines without a GPU, one gloo process per simulated GPU.  gloo has the
collectives sequence parallelism needs (``all_gather_into_tensor``,
``reduce_scatter_tensor``), but Megatron-Core 0.16.1 cannot reach them on CPU
for these reasons only:

1. **Allocation device.**  Its gather/scatter buffers are allocated with
   ``device=torch.cuda.current_device()``: ``tensor_parallel/mappings.py``
   (``_gather_along_first_dim``, ``_reduce_scatter_along_first_dim``,
   ``_gather_along_last_dim``, ``_AllToAll``), ``tensor_parallel/layers.py`` (the
   sequence-parallel reduce-scatter of the input gradient in
   ``LinearWithGradAccumulationAndAsyncCommunication.backward``) and
   ``utils.py`` (``GlobalMemoryBuffer.get_tensor``, the all-gathered input of a
   sequence-parallel column-parallel linear).  Without CUDA the call raises.
2. **Streams of the all-to-all MoE dispatcher.**  ``MoEAlltoAllTokenDispatcher``
   (``transformer/moe/token_dispatcher.py``, expert parallelism > 1) opens a
   ``torch.cuda.Stream`` for the device-to-host copy of its split sizes and waits
   on an event of it; and its ``maybe_move_tensor_to_cpu`` leaves a tensor that is
   already on the CPU a tensor, although the dispatcher asked for a NumPy array:
   gloo's ``all_to_all_single`` (which has uneven splits) then refuses tensor
   split sizes.
3. **Uneven gathers.**  Under expert parallelism with TP > 1 the all-to-all
   dispatcher gathers each TP rank's token count over the expert TP group with
   ``torch.distributed.all_gather`` into pieces of different sizes, and its
   backward reduce-scatters them with ``torch.distributed.reduce_scatter``; gloo
   takes equal pieces only (and has no list ``reduce_scatter``).
4. **Pipeline p2p and schedules.**  ``pipeline_parallel/p2p_communication.py``
   allocates the received activations and the exchanged shapes (``variable_seq_lengths``)
   on ``torch.cuda.current_device()`` and calls ``torch.cuda.synchronize()`` after
   ``batch_isend_irecv``; ``pipeline_parallel/schedules.py`` counts the loss tokens
   in ``torch.zeros([], device="cuda")``.
5. **RNG tracker.**  Under ``sequence_parallel`` the embedding and the
   transformer block run inside ``get_cuda_rng_tracker().fork()``, whose states
   are CUDA generator states seeded by ``model_parallel_cuda_manual_seed``
   (which Megatron-LM skips when no GPU is present).

What it redirects, and nothing else:

- In exactly the modules of :data:`ALLOCATING_MODULES`, the module-global name
  ``torch`` is replaced by a view of torch whose ``cuda.current_device()``
  answers ``torch.device("cpu")``; every other attribute is torch's own.  So
  Megatron's own functions run -- the same collectives, splits, autograd
  functions and buffers -- with their buffers on the CPU.  Its
  ``cuda.synchronize()`` returns at once (CPU ops and gloo's waited requests are
  done when they return), and its ``zeros(..., device="cuda")`` allocates on the CPU.
- In the dispatcher module (:data:`STREAM_MODULES`) the same view also answers
  ``torch.cuda.Stream``/``current_stream``/``stream`` with a CPU stream whose
  events are already done (CPU ops run in order), and its
  ``maybe_move_tensor_to_cpu`` is wrapped to return the NumPy array it was asked
  for.  Megatron's own dispatcher runs: the same permutations and all-to-alls.
- The same view's ``distributed`` answers ``all_gather`` and ``reduce_scatter``
  with pieces of different sizes by padding every piece to the largest and
  running gloo's equal-size ``all_gather`` / ``reduce_scatter_tensor`` (the
  padding rows are dropped; they add zeros to nothing kept); calls with equal
  pieces go to torch's own unchanged.
- Megatron's RNG tracker is replaced by :class:`CpuRNGStatesTracker`, a
  ``CudaRNGStatesTracker`` whose named states are states of torch's CPU
  generator (the one CPU dropout draws from), seeded like
  ``model_parallel_cuda_manual_seed`` seeds the CUDA ones (model-parallel:
  ``seed + 2718 + tp_rank``; expert-parallel: ``seed + 1024 + 100 * ep_rank +
  etp_rank``), without reseeding the default generator.

:func:`apply_cpu_compat` refuses to run where CUDA is available: on GPUs
Megatron-Core runs untouched.  Callers apply it in CPU (gloo) ranks only, after
the model-parallel state exists and before the model is built.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
import warnings

import torch

#: Megatron-Core modules whose buffers are allocated on ``torch.cuda.current_device()``
#: on the sequence-parallel, MoE and pipeline paths this project runs (see the module docstring).
ALLOCATING_MODULES = ("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers",
                      "megatron.core.utils", "megatron.core.pipeline_parallel.p2p_communication",
                      "megatron.core.pipeline_parallel.schedules")


#: Megatron-Core modules that open CUDA streams on the MoE path (expert parallelism > 1).
STREAM_MODULES = ("megatron.core.transformer.moe.token_dispatcher",)


class _DoneEvent:
    """An event of a CPU stream: the work it marks has already run."""

    def synchronize(self) -> None:
        pass


class _CpuStream:
    """A CUDA stream as seen from the dispatcher: CPU work runs in order, so there is
    nothing to wait for."""

    def wait_stream(self, other: "_CpuStream") -> None:
        pass

    def record_event(self) -> _DoneEvent:
        return _DoneEvent()


_CURRENT_STREAM = _CpuStream()


class _CudaOnCpu:
    """``torch.cuda`` as seen from a redirected module: the current device is the CPU,
    streams are :class:`_CpuStream`."""

    Stream = _CpuStream

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def current_stream() -> _CpuStream:
        return _CURRENT_STREAM

    @staticmethod
    def stream(stream: _CpuStream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize() -> None:
        """Nothing to wait for: gloo's p2p requests were waited on before it is called."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]) if t.shape[0] < rows else t


class _DistributedOnGloo(types.ModuleType):
    """``torch.distributed`` whose ``all_gather`` and ``reduce_scatter`` take pieces
    of different lengths on gloo; everything else is torch's."""

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or all(t.shape == tensor.shape for t in tensor_list):
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = [tensor.new_empty((rows, *tensor.shape[1:])) for _ in tensor_list]
        torch.distributed.all_gather(padded, _padded(tensor.contiguous(), rows), group=group)
        for out, piece in zip(tensor_list, padded):
            out.copy_(piece[:out.shape[0]])
        return None

    @staticmethod
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if async_op:
            return torch.distributed.reduce_scatter(output, input_list, op=op, group=group, async_op=True)
        rows = max(t.shape[0] for t in input_list)
        stacked = torch.cat([_padded(t, rows) for t in input_list])
        piece = output.new_empty((rows, *output.shape[1:]))
        torch.distributed.reduce_scatter_tensor(piece, stacked.contiguous(), op=op, group=group)
        output.copy_(piece[:output.shape[0]])
        return None

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` with :class:`_CudaOnCpu` as its ``cuda`` and :class:`_DistributedOnGloo`
    as its ``distributed``; everything else is torch's."""

    cuda = _CudaOnCpu()
    distributed = _DistributedOnGloo("torch.distributed")

    @staticmethod
    def zeros(*size, device=None, **kwargs) -> torch.Tensor:
        """``torch.zeros`` with a ``"cuda"`` device meaning the CPU (the schedules' token count)."""
        return torch.zeros(*size, device="cpu" if str(device).startswith("cuda") else device, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


_TORCH_ON_CPU = _TorchOnCpu("torch")


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker with torch's CPU generator in place of the GPU's:
        ``fork(name)`` runs its body on the named CPU generator state and restores the
        caller's state after it, the way the CUDA tracker swaps CUDA states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            caller_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(caller_state)

    return CpuRNGStatesTracker


def _seed_cpu_tracker(seed: int) -> None:
    """Install a :class:`CpuRNGStatesTracker` seeded like ``model_parallel_cuda_manual_seed``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _cpu_tracker_class()()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + mpu.get_tensor_model_parallel_rank())
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * mpu.get_expert_model_parallel_rank() + mpu.get_expert_tensor_parallel_rank())
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def apply_cpu_compat(seed: int) -> None:
    """Let Megatron-Core's tensor/sequence-parallel code run in this CPU (gloo) rank;
    call after ``initialize_model_parallel``.  Idempotent for the allocation sites;
    the RNG tracker is re-seeded on every call.  Raises where CUDA is available."""
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_compat is for CPU ranks only; on GPUs Megatron-Core runs unchanged")
    for name in ALLOCATING_MODULES + STREAM_MODULES:
        importlib.import_module(name).torch = _TORCH_ON_CPU
    for name in STREAM_MODULES:
        module = importlib.import_module(name)
        if not getattr(module.maybe_move_tensor_to_cpu, "host_copy_as_asked", False):
            module.maybe_move_tensor_to_cpu = _host_copy_as_asked(module.maybe_move_tensor_to_cpu)
    _seed_cpu_tracker(seed)
    # Megatron-Core 0.16.1 calls the collectives by names torch 2.13 deprecates; every
    # call would print the same warning once per rank.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def _host_copy_as_asked(move):
    """Megatron's ``maybe_move_tensor_to_cpu`` that also returns a CPU tensor as the
    NumPy array asked for with ``as_numpy=True`` (it only converts CUDA tensors)."""
    @functools.wraps(move)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        tensor = move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    maybe_move_tensor_to_cpu.host_copy_as_asked = True
    return maybe_move_tensor_to_cpu


def cpu_compat_applied() -> bool:
    """Whether :func:`apply_cpu_compat` redirected this process's allocation sites."""
    return all(importlib.import_module(name).torch is _TORCH_ON_CPU for name in ALLOCATING_MODULES + STREAM_MODULES)
