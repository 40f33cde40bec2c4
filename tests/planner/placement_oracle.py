"""Exact answer to 'does any Plan hold this batch under the token cap?' (tests only).

A complete search over every placement a Plan can hold (``Plan.validate``):
each sequence local on one rank, a zigzag ring of ``k`` ranks or a Ulysses
group of ``d`` ranks (``d`` dividing the heads), its shards on distinct ranks
in any order, every rank's attention tokens at most the cap.  The linear
layout never binds: with remap the token-balanced layout fits whenever the
batch does, without it the layout is the attention one.

Ranks are interchangeable, so what a placed prefix leaves for the rest is the
multiset of free room: sequences go longest first, each tries every distinct
multiset its placements can leave (shards of one size spread over ranks of
one room are counted, not enumerated), and a (position, multiset) that failed
once is never tried again.  A found placement is returned concretely, so the
caller can build and validate the Plan.  An integer program (HiGHS) over the
same space needed 2-12 s of CPU to find placements at 16 ranks and did not prove a
12-rank batch either way in 60 s; this search answers each in under 0.1 s.
"""

from __future__ import annotations

from typing import Sequence

from megatron_zeppelin.plan import Mode, Plan, placement
from megatron_zeppelin.plan.shards import contiguous_shards
from megatron_zeppelin.planner.base import same_layout_linear
from megatron_zeppelin.plan.shards import zigzag_shard_tokens


class Undecided(Exception):
    """The search ran out of states before it could answer."""


def shard_choices(length: int, cap: int, world: int,
                  ulysses_sizes: Sequence[int]) -> list[tuple[Mode, tuple[int, ...]]]:
    """(mode, tokens of each shard) of every placement of one sequence whose shards fit the cap."""
    out = [(Mode.LOCAL, (length,))] if length <= cap else []
    for k in range(2, min(world, length // 2) + 1):
        out.append((Mode.RING, tuple(zigzag_shard_tokens(length, k).tolist())))
        if k in ulysses_sizes:
            out.append((Mode.ULYSSES, tuple(e - s for ((s, e),) in contiguous_shards(length, k))))
    return [(mode, shards) for mode, shards in out if max(shards) <= cap]


def find_placement(lens: Sequence[int], cap: int, world: int, ulysses_sizes: Sequence[int] = (),
                   max_states: int = 100_000) -> list[tuple[Mode, tuple[int, ...]]] | None:
    """(mode, ranks in shard order) of every sequence, or None when no placement
    exists; raises :class:`Undecided` after ``max_states`` states."""
    order = sorted(range(len(lens)), key=lambda i: -int(lens[i]))
    choices = {int(n): shard_choices(int(n), cap, world, ulysses_sizes) for n in set(lens)}
    room = [cap] * world
    chosen: list[tuple[Mode, tuple[int, ...]]] = [(Mode.LOCAL, ())] * len(lens)
    failed: set[tuple[int, tuple[int, ...]]] = set()

    def place(pos: int) -> bool:
        if pos == len(order):
            return True
        key = (pos, tuple(sorted(room)))
        if key in failed:
            return False
        if len(failed) >= max_states:
            raise Undecided(f"placement oracle: no answer after {max_states} states")
        seq = order[pos]
        moves: dict[tuple[int, ...], tuple[Mode, tuple[int, ...], tuple[int, ...]]] = {}
        for mode, shards in choices[int(lens[seq])]:
            for ranks in _spreads(room, shards):
                left = room[:]
                for r, n in zip(ranks, shards):
                    left[r] -= n
                moves.setdefault(tuple(sorted(left, reverse=True)), (mode, shards, ranks))
        # The smallest largest room first: keeping the free room even finds
        # placements of full batches sooner (20,000 states did not find the
        # 16-rank example in insertion order; this order takes 28).
        for _, (mode, shards, ranks) in sorted(moves.items()):
            for r, n in zip(ranks, shards):
                room[r] -= n
            chosen[seq] = (mode, ranks)
            found = place(pos + 1)
            for r, n in zip(ranks, shards):
                room[r] += n
            if found:
                return True
        failed.add(key)
        return False

    return chosen if place(0) else None


def _spreads(room: list[int], shards: tuple[int, ...]) -> list[tuple[int, ...]]:
    """One rank per shard (distinct, room enough) for every different way to
    spread the shard sizes over the room values: ranks of equal room are
    interchangeable, so only how many shards of each size go to each room
    value is chosen."""
    by_room: dict[int, list[int]] = {}
    for r, n in enumerate(room):
        by_room.setdefault(n, []).append(r)
    values = sorted(by_room, reverse=True)
    sizes = sorted(set(shards), reverse=True)
    out = []
    free = {v: list(by_room[v]) for v in values}
    picked: dict[int, list[int]] = {s: [] for s in sizes}

    def spread(i: int, j: int, count: int) -> None:
        if count == 0:
            if i + 1 < len(sizes):
                spread(i + 1, 0, shards.count(sizes[i + 1]))
                return
            queues = {s: list(picked[s]) for s in sizes}
            out.append(tuple(queues[n].pop() for n in shards))
            return
        if j == len(values) or values[j] < sizes[i]:
            return
        ranks = free[values[j]]
        for n in range(min(count, len(ranks)), -1, -1):
            took, free[values[j]] = ranks[:n], ranks[n:]
            picked[sizes[i]].extend(took)
            spread(i, j + 1, count - n)
            del picked[sizes[i]][len(picked[sizes[i]]) - n:]
            free[values[j]] = ranks

    spread(0, 0, shards.count(sizes[0]))
    return out


def as_plan(lens: Sequence[int], cap: int, world: int, gpus_per_node: int,
            found: list[tuple[Mode, tuple[int, ...]]]) -> Plan:
    """The oracle's placement as a Plan (linear layout = attention layout)."""
    attention = tuple(placement(i, int(n), mode, ranks) for i, (n, (mode, ranks)) in enumerate(zip(lens, found)))
    return Plan(strategy="oracle", world_size=world, gpus_per_node=gpus_per_node, seq_lens=tuple(int(n) for n in lens),
                attention=attention, linear=same_layout_linear(world, attention), token_cap=cap)
