"""ZeppelinRemap: switch hidden states between the attention and the linear layout.

The attention layout balances quadratic attention work, so ranks can hold very
different token counts; projections and the MLP cost the same per token and
want equal counts.  :func:`remap_tokens` moves a ``[t, ...]`` tensor from one
layout to the other in one communicator round (an all-to-all-v of the Plan's
remap schedule); its backward moves the gradient the opposite way, which is the
exact adjoint because a layout switch is a permutation of rows.

Padding: a rank holding no token in a layout holds one zero row instead,
because Megatron's layers cannot run on an empty tensor (the trainer pads the
attention buffer the same way).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Literal

import torch

from megatron_zeppelin.comm.base import ByteCounters, Communicator, Message
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.remap.exchange import RemapExchange, build_exchange
from megatron_zeppelin.remap.sequence_parallel import sequence_parallel_mlp
from megatron_zeppelin.step_context import RemapCounters, UsesStepContext

Direction = Literal["to_linear", "to_attention"]


def pad_rows(tokens: int) -> int:
    """Zero rows after a layout's tokens: one for a rank that holds none."""
    return 0 if tokens else 1


def remap_tokens(x: torch.Tensor, *, plan: Plan, rank: int, comm: Communicator,
                 direction: Direction, counters: RemapCounters | None = None,
                 max_buffer_bytes: int | None = None, cache: dict | None = None) -> torch.Tensor:
    """Move ``x`` (``[t, ...]``: this rank's tokens in the source layout's buffer
    order, any trailing dims) to the other layout; differentiable.  ``cache``: a
    dict living as long as ``plan`` (the step context's) keeps the exchange maps
    for the step's next switches.

    Collective: every rank calls it with the same plan and direction."""
    move = layout_move(plan=plan, rank=rank, comm=comm, direction=direction, device=x.device, counters=counters,
                       max_buffer_bytes=max_buffer_bytes, cache=cache)
    return _RemapFunction.apply(x, move)


def layout_move(*, plan: Plan, rank: int, comm: Communicator, direction: Direction, device: torch.device,
                counters: RemapCounters | None = None, max_buffer_bytes: int | None = None,
                cache: dict | None = None) -> "_Move":
    """One switch as a plain callable ``move(x) -> y`` (``move.reversed()`` is the
    gradient's way), for callers that run several ranks in one process without
    autograd; :func:`remap_tokens` wraps it."""
    if direction not in ("to_linear", "to_attention"):
        raise ValueError(f"direction must be 'to_linear' or 'to_attention', got {direction!r}")
    key = ("remap_exchange", rank, device)
    ex = cache.get(key) if cache is not None else None
    if ex is None:
        ex = build_exchange(plan, rank).to(device)
        if cache is not None:
            cache[key] = ex
    return _Move(ex, comm, rank, direction == "to_linear", counters, max_buffer_bytes, plan.routed)


class _Move:
    """One direction of a switch; ``reversed()`` is the gradient's way."""

    def __init__(self, ex: RemapExchange, comm: Communicator, rank: int, to_linear: bool,
                 counters: RemapCounters | None, limit: int | None, routed: bool) -> None:
        self.ex, self.comm, self.rank = ex, comm, rank
        self.to_linear, self.counters, self.limit = to_linear, counters, limit
        self.routed = routed
        """The plan's ``Plan.routed``: whether the round may route its messages."""

    def reversed(self) -> "_Move":
        return _Move(self.ex, self.comm, self.rank, not self.to_linear, self.counters, self.limit, self.routed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ex = self.ex
        if self.to_linear:
            n_in, n_out, gather, scatter = ex.attn_tokens, ex.linear_tokens, ex.send_rows, ex.recv_rows
            keep_in, keep_out = ex.keep_attn, ex.keep_linear
        else:
            n_in, n_out, gather, scatter = ex.linear_tokens, ex.attn_tokens, ex.recv_rows, ex.send_rows
            keep_in, keep_out = ex.keep_linear, ex.keep_attn
        layout = "attention" if self.to_linear else "linear"
        if x.shape[0] != n_in + pad_rows(n_in):
            raise ValueError(f"rank {self.rank}: remap input has {x.shape[0]} rows, the plan's {layout} "
                             f"layout gives this rank {n_in} tokens (+{pad_rows(n_in)} padding row)")
        trailing = x.shape[1:]
        row = math.prod(trailing)
        nbytes = (n_out + pad_rows(n_out)) * row * x.element_size()
        if self.limit is not None and nbytes > self.limit:
            raise ConfigError(f"remap buffer of {nbytes} bytes ({n_out} tokens x {row} elements x "
                              f"{x.element_size()} B) exceeds the limit of {self.limit} bytes; raise the "
                              "remap buffer limit or lower the tokens per GPU")
        messages = self._messages(row)
        sends = {i: x.index_select(0, rows).reshape(-1) for i, rows in gather.items()}
        recvs = {i: x.new_empty(rows.numel() * row) for i, rows in scatter.items()}
        before = _sent(self.comm.counters)
        # Every rank holds the same message list, so all skip an empty round together.
        pending = self.comm.start_round(messages, sends, recvs, routed=self.routed) if messages else None
        out = x.new_zeros((n_out + pad_rows(n_out), *trailing))
        out.index_copy_(0, keep_out, x.index_select(0, keep_in))  # overlaps the round
        if pending is not None:
            pending.wait()
        for i, rows in scatter.items():
            out.index_copy_(0, rows, recvs[i].view(rows.numel(), *trailing))
        if self.counters is not None:
            # What the communicator counted during this round (no other round of
            # this rank runs between start and wait): the bytes that really moved,
            # routed hops included, not what the plan asked for.
            after = _sent(self.comm.counters)
            self.counters.remap_intra_node += after[0] - before[0]
            self.counters.remap_inter_node += after[1] - before[1]
        return out

    def _messages(self, row: int) -> tuple[Message, ...]:
        """The round's messages for rows of ``row`` elements (numel: tokens x row;
        every rank has the same trailing dims), built once per exchange, direction
        and row: the step's later switches pass the same tuple."""
        key = (self.to_linear, row)
        messages = self.ex.round_messages.get(key)
        if messages is None:
            pairs = self.ex.pairs if self.to_linear else ((d, s, n) for s, d, n in self.ex.pairs)
            messages = tuple(Message(i, s, d, n * row) for i, (s, d, n) in enumerate(pairs))
            self.ex.round_messages[key] = messages
        return messages


def _sent(counters: ByteCounters) -> tuple[int, int]:
    return counters.intra_node, sum(counters.inter_node_per_nic.values())


class _RemapFunction(torch.autograd.Function):
    """Layout switch whose backward is the reverse switch of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, move: _Move) -> torch.Tensor:
        ctx.move = move.reversed()
        return move(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.move(grad.contiguous()), None


class ZeppelinRemap(UsesStepContext, torch.nn.Module):
    """A layout switch as a module, run with the step's context (bound by
    ``ZeppelinGPTModel``); without one it raises rather than pass its input through."""

    def __init__(self, direction: Direction) -> None:
        super().__init__()
        if direction not in ("to_linear", "to_attention"):
            raise ValueError(f"direction must be 'to_linear' or 'to_attention', got {direction!r}")
        self.direction = direction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.require_step_context()
        return remap_tokens(x, plan=c.require_plan("ZeppelinRemap"), rank=c.rank, comm=c.communicator,
                            direction=self.direction, counters=c.remap_counters,
                            max_buffer_bytes=c.remap_buffer_limit, cache=c.cache)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Nothing to save: Megatron's ``MLP.sharded_state_dict`` asks every child
        module for its shards (``--ckpt-format torch_dist``)."""
        return {}

    def extra_repr(self) -> str:
        return self.direction


class RemapMLPMixin:
    """Runs an MLP class on the linear layout: its input switches there, its
    output switches back.  A mixin rather than a wrapper module so that
    parameter names stay those of the MLP (checkpoints load with remap on or off)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.to_linear = ZeppelinRemap("to_linear")
        self.to_attention = ZeppelinRemap("to_attention")

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        c = self.to_linear.step_context
        if c is not None and c.sequence_parallel_group is not None:
            tokens = sum(sp.length for sp in c.require_plan("ZeppelinRemap").attention_spans(c.rank))
            return sequence_parallel_mlp(super().forward, hidden_states, self.to_linear, self.to_attention,
                                         c.sequence_parallel_group, tokens + pad_rows(tokens), *args, **kwargs)
        # The MLP returns (output [t, b, h], bias [h] or None); the bias is per channel.
        out, bias = super().forward(self.to_linear(hidden_states), *args, **kwargs)
        return self.to_attention(out), bias


@functools.lru_cache(maxsize=None)
def with_remap(mlp_class: type) -> type:
    """``mlp_class`` with :class:`RemapMLPMixin` in front (one class per MLP class)."""
    return type(f"Remap{mlp_class.__name__}", (RemapMLPMixin, mlp_class), {"__module__": __name__})


def remap_module_spec(mlp_spec):
    """A Megatron-Core MLP spec whose module runs on the linear layout (no Megatron
    import here: only the MLP class changes).

    Megatron-Core 0.16-0.18 give a ``ModuleSpec``; 0.19 gives
    ``partial(MLP.as_mlp_submodule, submodules=...)``, a classmethod factory: the
    same factory is bound to the remapping subclass instead (and for MoE
    ``partial(MoELayer, submodules=...)``: the remapping subclass of that class)."""
    if isinstance(mlp_spec, functools.partial) and isinstance(mlp_spec.func, type):
        # 0.19's MoE: partial(MoELayer, submodules=...), the class itself.
        return functools.partial(with_remap(mlp_spec.func), *mlp_spec.args, **mlp_spec.keywords)
    if isinstance(mlp_spec, functools.partial):
        owner = getattr(mlp_spec.func, "__self__", None)
        if not isinstance(owner, type):
            raise ConfigError(f"cannot place the remapping layer around the MLP built by {mlp_spec.func!r} "
                              "(expected a classmethod of an MLP class); run with remap off")
        factory = getattr(with_remap(owner), mlp_spec.func.__name__)
        return functools.partial(factory, *mlp_spec.args, **mlp_spec.keywords)
    module = mlp_spec.module
    if isinstance(module, tuple):  # ModuleSpec allows (import path, class name)
        module = getattr(importlib.import_module(module[0]), module[1])
    return dataclasses.replace(mlp_spec, module=with_remap(module))
