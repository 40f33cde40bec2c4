"""A whole training step as one schedule: every layer, forward and backward.

Per layer, forward: attention (``schedule/attention.py``), the layout switch
attention -> linear (one message per (src, dst) pair of ``Plan.remap_schedule``),
the rank's linear work (projections, MLP; output layer folded into the last
layer), and the switch back.  Backward runs the layers in reverse with every
segment mirrored.  Each segment's ops on a rank start after that rank's
previous segment (its *frontier*): ranks never wait for the world, only for the
transfers they receive.

Segments keep the relative order they have on their own, so the engine, which
runs one layer's attention or one layout switch at a time, numbers its ops
exactly as their segment here (``segment_offsets``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_zeppelin.plan.plan import Plan
from megatron_zeppelin.schedule.attention import AttnShape, Transport, _Segment, add_attention
from megatron_zeppelin.schedule.ops import Schedule, ScheduleBuilder


@dataclass(frozen=True)
class StepShape:
    """What sizes a step's ops besides the Plan."""

    num_layers: int
    """Transformer layers."""
    attn: AttnShape
    """Head shapes and dtypes of attention."""
    hidden_size: int
    """Elements per token of the hidden state (what a layout switch moves)."""
    remap: bool = True
    """Whether the linear modules run on the Plan's linear layout (layout switches in the step)."""


def remap_messages(plan: Plan) -> list[tuple[int, int, int]]:
    """``(src, dst, tokens)`` of the attention -> linear switch, one per pair, in the
    order the remap exchange numbers them (``remap/exchange.py``)."""
    return list(plan.remap_pairs())


def add_switch(b: ScheduleBuilder, prefix: tuple, messages: list[tuple[int, int, int]], transport: Transport,
               row_numel: int, itemsize: int, backward: bool, entry: dict[int, list[int]],
               reverse: bool = False) -> dict[int, list[int]]:
    """One layout switch: every message ``src -> dst`` of ``tokens`` rows (each way
    reversed when ``reverse``); the engine's ``Communicator.start_round`` runs the
    same ops for the same message list."""
    seg = _Segment(b, prefix, entry)
    for mid, (src, dst, tokens) in enumerate(messages):
        a, c = (dst, src) if reverse else (src, dst)
        seg.transfer((mid,), transport, ("remap", mid), a, c, tokens * row_numel, itemsize, [],
                     tier="remap", name="remap", backward=backward)
    return seg.frontier()


def add_linear(b: ScheduleBuilder, prefix: tuple, tokens: list[int], backward: bool,
               entry: dict[int, list[int]]) -> dict[int, list[int]]:
    seg = _Segment(b, prefix, entry)
    for rank, n in enumerate(tokens):
        seg.compute((rank,), rank, [], tier="linear", name="linear_bwd" if backward else "linear_fwd",
                    backward=backward, tokens=n, key=("linear",))
    return seg.frontier()


@dataclass
class StepSchedule:
    """The step's schedule plus where each engine-run segment starts."""

    schedule: Schedule
    """All ops of the step."""
    segment_offsets: dict[tuple, int] = field(default_factory=dict)
    """``(layer, backward, part)`` -> id of the segment's first op; ``part`` is
    ``attn``, ``to_linear``, ``linear`` or ``to_attn``."""


def step_schedule(plan: Plan, shape: StepShape, transport: Transport) -> StepSchedule:
    """Every op of one training step of ``plan``."""
    b = ScheduleBuilder(plan.world_size)
    messages = remap_messages(plan) if shape.remap else []
    row_numel, isz = shape.hidden_size, shape.attn.itemsize
    tokens = plan.linear_tokens_per_rank()
    entry: dict[int, list[int]] = {}
    order: list[tuple] = []
    passes = [(layer, False) for layer in range(shape.num_layers)]
    passes += [(layer, True) for layer in reversed(range(shape.num_layers))]
    for n, (layer, backward) in enumerate(passes):
        parts = ["attn", "to_linear", "linear", "to_attn"]
        for part in (reversed(parts) if backward else parts):
            prefix = (n, len(order))
            order.append((layer, backward, part))
            if part == "attn":
                entry = add_attention(b, prefix, plan, shape.attn, transport, backward, entry)
            elif part == "linear":
                entry = add_linear(b, prefix, tokens, backward, entry)
            elif messages:
                # Backward moves gradients the other way: the forward to_linear's
                # gradient goes linear -> attention, like the forward to_attn.
                entry = add_switch(b, prefix, messages, transport, row_numel, isz, backward, entry,
                                   reverse=(part == "to_attn") != backward)
    schedule = b.build(call=lambda key: key[1])         # the segment number of its prefix
    offsets: dict[tuple, int] = {}
    for op_id, seg in enumerate(schedule.calls):
        offsets.setdefault(order[seg], op_id)
    return StepSchedule(schedule, offsets)
