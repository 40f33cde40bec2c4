"""A rank's switch reads only its own moves: ``Plan.remap_moves(r)`` is
``remap_schedule()`` restricted to ``r``, ``Plan.remap_pairs()`` (carried by a
``CompactPlan`` from the planning child) numbers the messages as before, and
``build_exchange(plan, r)`` equals the maps made from every rank's moves; the
round that carries them is the rank's projection of every rank's round."""

from __future__ import annotations

import math
import pickle
import random

import torch
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.comm.rounds import _round_schedule
from megatron_zeppelin.plan import Plan, Span
from megatron_zeppelin.plan.compact import CompactPlan
from megatron_zeppelin.remap.exchange import build_exchange
from megatron_zeppelin.schedule.attention import Transport
from tests.plan.test_plan import make_plan, random_plan
from tests.schedule.test_rank_schedule import TOPOS, assert_projection


def random_linear(rng: random.Random, world: int, lens: list[int]) -> tuple:
    """Every sequence cut at random points, each piece on a random rank."""
    linear = [[] for _ in range(world)]
    for seq, L in enumerate(lens):
        cuts = sorted({0, L, *(rng.randrange(1, L) for _ in range(rng.randint(0, 3)) if L > 1)})
        for a, b in zip(cuts, cuts[1:]):
            linear[rng.randrange(world)].append(Span(seq, a, b))
    for spans in linear:
        rng.shuffle(spans)
    return tuple(map(tuple, linear))


def buffer_rows(spans) -> dict[tuple[int, int], int]:
    """(seq, token) -> its row in a buffer holding ``spans`` in order."""
    rows, offset = {}, 0
    for sp in spans:
        rows.update(((sp.seq, t), offset + t - sp.start) for t in range(sp.start, sp.end))
        offset += sp.end - sp.start
    return rows


def exchange_from_every_move(plan: Plan, rank: int):
    """The maps as made from ``remap_schedule()`` (every rank's moves), token by token: the oracle."""
    attn, linear = buffer_rows(plan.attention_spans(rank)), buffer_rows(plan.linear[rank])
    grouped: dict[tuple[int, int], list] = {}
    for t in plan.remap_schedule():
        grouped.setdefault((t.src, t.dst), []).append(t)
    pairs, send, recv = [], {}, {}
    for mid, ((src, dst), moves) in enumerate(grouped.items()):
        pairs.append((src, dst, sum(t.length for t in moves)))
        for mine, table, rows in ((src, send, attn), (dst, recv, linear)):
            if mine == rank:
                table[mid] = torch.tensor([rows[(t.seq, i)] for t in moves for i in range(t.start, t.end)],
                                          dtype=torch.long)
    return tuple(pairs), send, recv


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([(2, 1), (4, 2), (8, 4)]), st.integers(0, 2**31))
def test_a_ranks_moves_and_maps_are_its_part_of_every_ranks(data, topo, seed):
    world, gpn = topo
    lens, placements = random_plan(data.draw, world, gpn)
    plan = make_plan(lens, placements, linear=random_linear(random.Random(seed), world, lens),
                     world=world, gpn=gpn).validate()
    every = plan.remap_schedule()
    rebuilt = pickle.loads(pickle.dumps(CompactPlan.of(plan))).plan()
    assert rebuilt.remap_pairs() == plan.remap_pairs()          # carried, equal to the Plan's own
    for rank in range(world):
        assert plan.remap_moves(rank) == [t for t in every if rank in (t.src, t.dst)]
        pairs, send, recv = exchange_from_every_move(plan, rank)
        for p in (plan, rebuilt):
            ex = build_exchange(p, rank)
            assert ex.pairs == pairs
            assert ex.send_rows.keys() == send.keys() and ex.recv_rows.keys() == recv.keys()
            assert all(torch.equal(ex.send_rows[m], send[m]) for m in send)
            assert all(torch.equal(ex.recv_rows[m], recv[m]) for m in recv)
            attn, linear = buffer_rows(plan.attention_spans(rank)), buffer_rows(plan.linear[rank])
            kept = attn.keys() & linear.keys()                   # tokens the rank holds in both layouts
            assert ex.keep_attn.dtype == ex.keep_linear.dtype == torch.long
            assert sorted(zip(ex.keep_attn.tolist(), ex.keep_linear.tolist())) == sorted(
                (attn[tok], linear[tok]) for tok in kept)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(range(len(TOPOS))), st.booleans())
def test_a_ranks_round_is_its_projection_of_the_whole(seed, topo_index, routed):
    """A switch's round (``start_round``) on one rank: its projection of every
    rank's round, also on a proxy that relays pieces of others' messages."""
    topo = TOPOS[topo_index]
    rng, world = random.Random(seed), topo.world_size
    sizes = tuple((mid, rng.randrange(world), rng.randrange(world), rng.randint(0, 40), rng.choice([2, 4]))
                  for mid in rng.sample(range(100), rng.randint(1, 12)))
    transport = Transport(topo, 0 if routed else math.inf)
    full, ids = _round_schedule(sizes, transport, world)
    for rank in range(world):
        mine, my_ids = _round_schedule(sizes, transport, world, rank)
        assert_projection(full, mine, rank)
        assert my_ids == {m: ids[m] for m in mine.messages}
