"""Packed Ulysses groups (``Plan.packed_ulysses``, FlexSP's and DeepSpeed's
packing) against plain causal attention on 8 gloo ranks (2 nodes x 4 GPUs):
outputs and q/k/v gradients, exact byte counts, one all-to-all message per peer
and direction holding every member's rows, the members' heads in one varlen
call, and the schedule FlexSP's packing builds (``add_attention(pack=True)``)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_zeppelin.attention import build_schedule
from megatron_zeppelin.attention.backends import TorchBackend
from megatron_zeppelin.plan import Mode, placement
from megatron_zeppelin.schedule import COMM, AttnShape
from megatron_zeppelin.schedule.attention import Transport, add_attention
from megatron_zeppelin.schedule.ops import ScheduleBuilder
from tests.attention.helpers import make_plan
from tests.attention.test_packed_ring import LoopedFused
from tests.attention.test_ring_ulysses import HK, HQ, TOPO, check_rank, run_plan
from tests.distributed import world_fixture

world = world_fixture(8)

#: (length, mode, ranks) per sequence, the packed Ulysses groups and packed rings (sequence indices).
CASES = {
    # Uneven lengths (positions hold different row counts), three members.
    "intra-uneven": ([(9, Mode.ULYSSES, [2, 3]), (14, Mode.ULYSSES, [2, 3]), (5, Mode.ULYSSES, [2, 3])],
                     [[0, 1, 2]], []),
    # A packed group of 4 across nodes beside an unpacked group on its ranks,
    # a group on the same ranks in another order, a packed ring, a ring and a
    # local sequence in one layer.
    "mixed-inter": ([(19, Mode.ULYSSES, [4, 0, 7, 2]), (6, Mode.LOCAL, [1]), (10, Mode.ULYSSES, [4, 0, 7, 2]),
                     (12, Mode.ULYSSES, [4, 0, 7, 2]), (11, Mode.ULYSSES, [0, 4, 7, 2]),
                     (8, Mode.ULYSSES, [4, 0, 7, 2]), (13, Mode.RING, [1, 5]), (9, Mode.RING, [1, 5]),
                     (7, Mode.RING, [3, 6])],
                    [[3, 0, 5]], [[6, 7]]),
}


def packed_plan(name: str):
    spec, groups, rings = CASES[name]
    plan = make_plan(8, 4, [L for L, _, _ in spec], [placement(i, L, m, r) for i, (L, m, r) in enumerate(spec)])
    return dataclasses.replace(plan, packed_ulysses=tuple(map(tuple, groups)),
                               packed_rings=tuple(map(tuple, rings))).validate()


class CountingTorch(TorchBackend):
    """The PyTorch kernels, recording the lengths of every varlen call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []

    def varlen_forward(self, q, k, v, **kwargs):
        self.calls.append(tuple(kwargs["lengths"]))
        return super().varlen_forward(q, k, v, **kwargs)

    def varlen_backward(self, dout, q, k, v, out, lse, **kwargs):
        self.calls.append(tuple(kwargs["lengths"]))
        return super().varlen_backward(dout, q, k, v, out, lse, **kwargs)


def _run(rank, world_size, plan, seed, fused):
    """This rank's run with the fused THD path (on CPU) or the counted torch kernels."""
    kernels = LoopedFused() if fused else CountingTorch()
    return (*run_plan(rank, plan, TOPO, seed, backend=kernels), None if fused else kernels.calls)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("fused", [False, True])
def test_packed_ulysses_match_single_rank_attention(world, name, fused):
    plan = packed_plan(name)
    groups = [[plan.seq_lens[s] for s in sorted(members)] for members in plan.packed_ulysses]   # plan order
    ranks = [set(plan.attention[plan.packed_leads()[members[0]]].ranks) for members in plan.packed_ulysses]
    results = world.run(_run, plan, seed=len(name), fused=fused)
    for rank, (*checked, calls) in enumerate(results):
        check_rank(plan, TOPO, rank, *checked, tol=1e-6)
        if not fused:
            # Forward and backward: each packed group's members (whole sequences, my heads) in one call.
            for lengths, on in zip(groups, ranks):
                assert calls.count(tuple(lengths)) == (2 if rank in on else 0), (rank, calls)


def test_a_packed_group_sends_one_message_per_peer_and_direction():
    """Every all-to-all message of the packed group of ``intra-uneven`` holds all
    three members' rows: hq (out, dq...) or hq + 2hk (in) heads / d x head dim x
    itemsize x rows, one per (peer, direction) -- as many as one unpacked group."""
    plan = packed_plan("intra-uneven")
    shape = AttnShape(HQ, HK, 4, 4, 4)
    members = [plan.attention[i] for i in range(3)]
    d = 2
    for backward in (False, True):
        sched = build_schedule(plan, shape, None).backward if backward else build_schedule(plan, shape, None).forward
        ops = [o for o in sched.ops if o.kind == COMM]
        assert len(ops) == 2 * d * (d - 1)
        for o in ops:
            kind, _, src, dst = sched.messages[o.key[0]][:4]
            rows = sum(e - s for s, e in (p.shards[src if kind == "a2a_in" else dst][0] for p in members))
            heads = {(False, "a2a_in"): HQ + 2 * HK, (False, "a2a_out"): HQ,
                     (True, "a2a_in"): HQ, (True, "a2a_out"): HQ + 2 * HK}[backward, kind] // d
            assert o.nbytes == heads * 4 * rows * 4, (backward, kind, src, dst)


def test_packed_groups_of_every_group_schedule_as_flexsps_packing():
    """A plan whose packed groups hold every Ulysses sequence of each rank tuple
    has the very schedule the simulator builds for FlexSP (``add_attention(pack=True)``)."""
    spec = [(16, Mode.ULYSSES, [0, 1, 2, 3]), (5, Mode.LOCAL, [4]), (11, Mode.ULYSSES, [0, 1, 2, 3]),
            (12, Mode.ULYSSES, [4, 5]), (9, Mode.ULYSSES, [4, 5]), (8, Mode.ULYSSES, [0, 1, 2, 3]),
            (10, Mode.ULYSSES, [6, 7])]
    plan = make_plan(8, 4, [L for L, _, _ in spec], [placement(i, L, m, r) for i, (L, m, r) in enumerate(spec)])
    packed = dataclasses.replace(plan, packed_ulysses=((0, 2, 5), (3, 4))).validate()
    shape, transport = AttnShape(HQ, HK, 4), Transport(TOPO)

    def ops(p, pack, backward):
        b = ScheduleBuilder(8)
        add_attention(b, (), p, shape, transport, backward, pack=pack)
        return [(o.kind, o.rank, o.peer, o.nbytes, o.pairs, o.block, o.deps, o.key) for o in b.build().ops]

    for backward in (False, True):
        assert ops(packed, False, backward) == ops(plan, True, backward)
        assert ops(plan, False, backward) != ops(plan, True, backward)
