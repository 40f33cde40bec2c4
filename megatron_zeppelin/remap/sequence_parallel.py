"""The remapped MLP under Megatron's sequence parallelism.

With sequence parallelism a layer's hidden states are split by rows over the
tensor-parallel ranks (``[T / tp, b, h]``, ``T`` the rank's attention-layout rows
padded to a multiple of ``tp``), but a layout switch moves a data-parallel rank's
*whole* buffer.  So around the MLP: gather the rows of the TP group (every TP rank
then holds the same ``[T, b, h]``), drop the padding, switch to the linear layout,
pad to a multiple of ``tp`` with zero rows and hand each TP rank its rows (the
MLP's own column-parallel layer gathers them again); the way back mirrors it, and
the attention layout's padding rows get a zero MLP output.

Gradients: every tensor between a gather and the next split is the same on all
TP ranks and so is its gradient (each split's backward gathers it), so a
gather's backward keeps this rank's rows (no sum over TP ranks).  Padding rows
are zero, stay zero through the bias-free MLP, and are dropped before the switch
back, so they carry no gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _rows_of_rank(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    rows = x.shape[0] // dist.get_world_size(group)
    start = rows * dist.get_rank(group)
    return x[start:start + rows].contiguous()


class _Rows(torch.autograd.Function):
    """``gather``: forward all-gathers the TP ranks' rows, backward keeps this rank's
    rows of the (identical on every TP rank) gradient; otherwise the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, gather: bool) -> torch.Tensor:
        ctx.group, ctx.gather = group, gather
        return _gather(x, group) if gather else _rows_of_rank(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _rows_of_rank(grad, ctx.group) if ctx.gather else _gather(grad, ctx.group), None, None


def _pad_to(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` followed by zero rows up to ``rows`` rows."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def sequence_parallel_mlp(mlp_forward: Callable[..., tuple], hidden: torch.Tensor,
                          to_linear: Callable[[torch.Tensor], torch.Tensor],
                          to_attention: Callable[[torch.Tensor], torch.Tensor],
                          group: dist.ProcessGroup, attention_rows: int, *args: Any, **kwargs: Any) -> tuple:
    """``mlp_forward`` (SP: rows split over ``group``) on the linear layout.

    hidden: ``[T / tp, b, h]``, this TP rank's rows of the attention-layout buffer,
    whose first ``attention_rows`` rows are what the layout switch moves (the
    plan's tokens and its padding row) -> (``[T / tp, b, h]``, bias)."""
    tp = dist.get_world_size(group)
    full = _Rows.apply(hidden, group, True)  # [T, b, h], the same on every TP rank
    linear = to_linear(full[:attention_rows])  # [t', b, h]
    rows = linear.shape[0]
    out, bias = mlp_forward(_Rows.apply(_pad_to(linear, rows + -rows % tp), group, False), *args, **kwargs)
    back = to_attention(_Rows.apply(out, group, True)[:rows])
    return _Rows.apply(_pad_to(back, full.shape[0]), group, False), bias
