"""Shared pieces of the attention tests: hand-built plans, an independent
reference (PyTorch SDPA on whole sequences) and the expected byte counts of a
plan, derived in closed form rather than from the engine's own schedule."""

from __future__ import annotations

import random
from typing import Sequence

import torch
import torch.nn.functional as F

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.plan import Mode, Plan, SeqPlacement, placement
from megatron_zeppelin.planner.base import same_layout_linear
from megatron_zeppelin.topology import Topology


def make_plan(world: int, gpus_per_node: int, seq_lens: Sequence[int],
              placements: Sequence[SeqPlacement]) -> Plan:
    att = tuple(placements)
    return Plan("test", world, gpus_per_node, tuple(seq_lens), att,
                same_layout_linear(world, att)).validate()


def random_plan(rng: random.Random, topo: Topology, n_seqs: int, ulysses: bool = True) -> Plan:
    """Random mix of local sequences, intra-node rings, inter-node rings (and
    Ulysses groups), in random plan order with random ring orders."""
    world, gpn = topo.world_size, topo.gpus_per_node
    lens, places = [], []
    for seq in range(n_seqs):
        kind = rng.choice(["local", "intra", "inter"] + (["ulysses"] if ulysses else []))
        if kind == "local":
            ranks = [rng.randrange(world)]
        elif kind == "intra":
            node = rng.randrange(topo.nodes)
            ranks = rng.sample(topo.node_ranks(node), rng.randint(2, gpn))
        elif kind == "inter":
            ranks = rng.sample(range(world), rng.randint(2, world))
            if len({r // gpn for r in ranks}) == 1:       # force a node boundary
                ranks.append(rng.choice([r for r in range(world) if r // gpn != ranks[0] // gpn]))
        else:
            ranks = rng.sample(range(world), 2)
        mode = {"local": Mode.LOCAL, "ulysses": Mode.ULYSSES}.get(kind, Mode.RING)
        length = rng.randint(2 * len(ranks), 2 * len(ranks) + 9) if mode is not Mode.LOCAL else rng.randint(1, 9)
        lens.append(length)
        places.append(placement(seq, length, mode, ranks))
    rng.shuffle(places)
    return make_plan(world, gpn, lens, places)


def random_sequences(plan: Plan, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int):
    """(q, k, v, dout) per sequence, identical on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(L, h, d, generator=g, dtype=torch.float64).to(dtype)
                  for h in (hq, hk, hk, hq)) for L in plan.seq_lens]


def reference(seqs) -> list[tuple[torch.Tensor, ...]]:
    """(out, dq, dk, dv) of plain causal attention on every whole sequence,
    computed in float32 at least (bf16 inputs are compared at bf16 precision)."""
    refs = []
    for q, k, v, dout in seqs:
        acc = torch.promote_types(q.dtype, torch.float32)
        dout = dout.to(acc)
        q, k, v = (x.detach().to(acc).requires_grad_() for x in (q, k, v))
        # [L, h, d] -> [1, h, L, d]
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                                             is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        out.backward(dout)
        refs.append((out.detach(), q.grad, k.grad, v.grad))
    return refs


def expected_bytes(plan: Plan, topo: Topology, rank: int, hq: int, hk: int, d: int, itemsize: int,
                   backward: bool, grad_itemsize: int = 4) -> ByteCounters:
    """Bytes ``rank`` sends in one forward (or backward) pass of ``plan``.

    Ring of k, position j, next position j+1, shard sizes n_i, length L: forward
    passes on every K/V block but the next position's own, ``2*hk*d*(L - n_{j+1})``
    elements; backward does the same plus every owner's dK/dV once,
    ``2*hk*d*L`` elements of ``grad_itemsize`` bytes.  Ulysses group of g, position a: Q/K/V of its rows to the other
    heads' owners, outputs of their rows back (``hq/g`` heads per owner); backward
    mirrors it (dO out, dQ/dK/dV back)."""
    c = ByteCounters()

    def add(dst: int, nbytes: int) -> None:
        if topo.same_node(rank, dst):
            c.intra_node += nbytes
        elif nbytes:
            nic = topo.nic_of(rank)
            c.inter_node_per_nic[nic] = c.inter_node_per_nic.get(nic, 0) + nbytes

    for p in plan.attention:
        if rank not in p.ranks or p.mode is Mode.LOCAL:
            continue
        j, k, L = p.ranks.index(rank), p.size, plan.seq_lens[p.seq]
        n = [sum(e - s for s, e in shard) for shard in p.shards]
        if p.mode is Mode.RING:
            nxt = p.ranks[(j + 1) % k]
            add(nxt, 2 * hk * d * (L - n[(j + 1) % k]) * itemsize)
            if backward:
                add(nxt, 2 * hk * d * L * grad_itemsize)
        else:
            qh, kh = hq // k, hk // k
            for b, dst in enumerate(p.ranks):
                if b != j:
                    first, second = (qh, qh + 2 * kh) if backward else (qh + 2 * kh, qh)
                    add(dst, (n[j] * first + n[b] * second) * d * itemsize)
    return c
