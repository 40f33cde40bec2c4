"""One global batch through Megatron-Core's own 1F1B pipeline schedule (``--pp P``).

``get_forward_backward_func()`` (non-interleaved 1F1B for ``P > 1``) calls
:func:`forward_step` once per micro-batch on every stage, in the schedule's
order; between stages Megatron-Core's p2p code sends the hidden states
``[t, 1, hidden]`` and, since the config sets ``variable_seq_lengths``, their
shape first: ``t`` is this rank's token count in the micro-batch's plan
(attention layout, padded as the non-pipelined trainer pads it; ``/ tp`` under
sequence parallelism).  The first stage reads the tokens, the last the labels
and loss mask; a middle stage only needs the plan's spans (positions for RoPE,
the token count).  The loss is the non-pipelined trainer's: ``sum(token
losses) / global label count`` per micro-batch (``calculate_per_token_loss``
keeps the schedule from dividing it by the micro-batch count), so the summed
gradients equal those of the same batches at ``--pp 1``.

Every rank agrees on every micro-batch's plan *before* the schedule starts: an
all-reduce inside a forward step would wait for stages that are still receiving.
The attention and remap functions keep their plan and communicator from their
forward, so a backward that 1F1B runs after a later micro-batch's forward
still runs its own plan.  On CPU ranks ``megatron/cpu_compat.py`` lets the p2p
code allocate on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from megatron_zeppelin.megatron import build_packed_seq_params
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.step_context import StepContext
from megatron_zeppelin.train.batch import build_rank_batch, num_label_tokens, padded_length
from megatron_zeppelin.train.micro import MicroBatch

if TYPE_CHECKING:
    from megatron_zeppelin.train.trainer import Run


def pipeline_forward_backward(run: "Run", micros: Sequence[MicroBatch],
                              context_of: Callable[[Plan], StepContext]) -> float:
    """Forward and backward of ``micros`` (one global batch, every plan already
    agreed on) through this rank's stage, each run under ``context_of(its plan)``;
    gradients accumulate in ``.grad``.  Returns this rank's summed token loss (0
    on every stage but the last)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    multiple_of = run.cfg.tp if run.cfg.sequence_parallel else 1

    def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        micro = next(data_iterator)
        spans = micro.plan.attention_spans(run.dp_rank)
        data = None
        if first or last:
            data = build_rank_batch(spans, micro.pieces, run.source, run.device, multiple_of=multiple_of)
            pad_tokens = data.pad_tokens
        else:   # shapes only: the hidden states arrive from the previous stage
            held = sum(sp.length for sp in spans)
            pad_tokens = padded_length(held, multiple_of) - held
        packed = build_packed_seq_params(spans, context=context_of(micro.plan), device=run.device,
                                         pad_tokens=pad_tokens)
        output = model(data.tokens[None] if first else None, packed.position_ids[None], None,
                       labels=data.labels[None] if last else None, packed_seq_params=packed)
        denominator = num_label_tokens(micro.batch.seq_lens)

        def loss_func(token_loss: torch.Tensor):
            loss_sum = (token_loss[0].float() * data.loss_mask).sum()
            # The schedule adds up the label count; no host copy (a sync on GPUs).
            return loss_sum / denominator, data.loss_mask.sum().int(), {"loss_sum": loss_sum.detach()}
        return output, loss_func

    # seq_length only fills Megatron's default shape: with variable_seq_lengths each
    # transfer's shape is exchanged before it.
    stored = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micros), model=run.model,
        num_microbatches=len(micros), seq_length=run.cfg.max_seq_len, micro_batch_size=1, forward_only=False)
    return sum(float(d["loss_sum"]) for d in stored) if last else 0.0
