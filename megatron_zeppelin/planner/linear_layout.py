"""Token-balanced linear layout: which tokens each rank holds for projections and MLP.

Between attention and the token-linear modules the remap switches every rank
from its attention buffer to an equal share of the batch's tokens.  The layout
chosen here fixes what the remap moves, so it is built to move little:

* every rank's target is ``floor(N / W)`` or ``ceil(N / W)`` tokens; the extra
  tokens go to ranks that hold the most (they would have to send them anyway);
* a rank keeps ``min(held, target)`` tokens, the *prefix* of its attention buffer,
  so its kept tokens stay contiguous in memory and only the tail is sent;
* surplus tails go to deficit ranks on the same node first (NVLink), and only
  each node's net surplus crosses nodes.

That moves exactly ``sum(max(0, held - target))`` tokens -- the least any
balanced layout can move -- and exactly each node's net surplus across nodes,
the least any layout with these targets can send over the NICs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import SeqPlacement, Span, attention_buffers


def linear_targets(held: Sequence[int], total: int) -> list[int]:
    """Tokens each rank holds in the linear layout: ``floor`` or ``ceil`` of the
    mean; the ``total % W`` extra tokens go to the ranks holding the most (ties:
    lower rank), which turns a token each of them would send into one it keeps."""
    w = len(held)
    base, extra = divmod(total, w)
    targets = [base] * w
    # Stable argsort of -held: most-loaded first, lower rank first among equals.
    for r in np.argsort(-np.asarray(held, dtype=np.int64), kind="stable")[:extra]:
        targets[int(r)] += 1
    return targets


def _cut_tail(spans: list[Span], count: int) -> tuple[list[Span], list[Span]]:
    """Split a buffer into (prefix, tail) where the tail holds ``count`` tokens,
    both in buffer order."""
    prefix = list(spans)
    tail: list[Span] = []
    while count > 0:
        sp = prefix.pop()
        if sp.length <= count:
            tail.append(sp)
            count -= sp.length
        else:
            cut = sp.end - count
            prefix.append(Span(sp.seq, sp.start, cut))
            tail.append(Span(sp.seq, cut, sp.end))
            count = 0
    tail.reverse()
    return prefix, tail


def _append_merged(dst: list[Span], spans: Sequence[Span]) -> None:
    """Append spans, fusing a span with its predecessor when they are adjacent
    pieces of one sequence (fewer, larger spans for the remap and the kernels)."""
    for sp in spans:
        if dst and dst[-1].seq == sp.seq and dst[-1].end == sp.start:
            dst[-1] = Span(sp.seq, dst[-1].start, sp.end)
        else:
            dst.append(sp)


def balance_linear(attention: Sequence[SeqPlacement], seq_lens: Sequence[int], world_size: int,
                   gpus_per_node: int, token_cap: int | None = None) -> tuple[tuple[Span, ...], ...]:
    """The linear layout for an attention layout: equal token counts, fewest moves.

    ``attention`` gives every rank's attention buffer (placements in order, each
    placement's shards in order, as :meth:`Plan.attention_spans`).  Returns
    ``linear[r]``: rank ``r``'s spans, its kept prefix first (attention-buffer
    order), then what it receives, intra-node senders before inter-node ones."""
    w, g = world_size, gpus_per_node
    buffers = attention_buffers(w, attention)
    held = [sum(sp.end - sp.start for sp in buf) for buf in buffers]
    total = int(sum(seq_lens))
    if sum(held) != total:
        raise InfeasibleError(f"linear layout: the attention layout holds {sum(held)} tokens but the "
                              f"batch has {total}; place every sequence exactly once")
    targets = linear_targets(held, total)
    if token_cap is not None and max(targets) > token_cap:
        raise InfeasibleError(f"linear layout: {total} tokens over {w} ranks need {max(targets)} "
                              f"tokens on some rank, over the cap of {token_cap}; lower the batch's "
                              f"token budget or raise tokens_per_gpu")

    linear: list[list[Span]] = [[] for _ in range(w)]
    senders: list[_Tail] = []        # rank order
    receivers: list[list[int]] = []  # [rank, tokens still missing], rank order
    for r in range(w):
        if held[r] > targets[r]:
            linear[r], tail = _cut_tail(buffers[r], held[r] - targets[r])
            senders.append(_Tail(r, tail, held[r] - targets[r]))
            continue
        linear[r] = buffers[r]
        if held[r] < targets[r]:
            receivers.append([r, targets[r] - held[r]])

    def match(pools: list[_Tail], needs: list[list[int]]) -> None:
        # Two pointers in rank order: each sender and receiver is split at most
        # once per partner, so the message count stays below senders + receivers.
        i = j = 0
        while i < len(pools) and j < len(needs):
            pool, need = pools[i], needs[j]
            n = min(pool.left, need[1])
            _append_merged(linear[need[0]], pool.take(n))
            need[1] -= n
            i += pool.left == 0
            j += need[1] == 0

    # Intra-node level first: each node's senders fill its own receivers.
    by_node: dict[int, tuple[list[_Tail], list[list[int]]]] = {}
    for s in senders:
        by_node.setdefault(s.rank // g, ([], []))[0].append(s)
    for d in receivers:
        by_node.setdefault(d[0] // g, ([], []))[1].append(d)
    for node in sorted(by_node):
        match(*by_node[node])
    # Inter-node level: only each node's net surplus is left to cross the NICs.
    match([s for s in senders if s.left], [d for d in receivers if d[1] > 0])
    return tuple(tuple(spans) for spans in linear)


@dataclass(frozen=True)
class RemapVolume:
    """What :func:`balance_linear` moves for given per-rank token counts, from the
    counts alone (a planner prices the remap of a candidate before building it)."""

    intra_sent: np.ndarray
    """Tokens each rank sends to ranks of its own node."""
    intra_received: np.ndarray
    """Tokens each rank receives from ranks of its own node."""
    inter_sent: np.ndarray
    """Tokens each rank sends to other nodes."""
    inter_received: np.ndarray
    """Tokens each rank receives from other nodes."""
    peers: np.ndarray
    """Distinct ranks each rank exchanges tokens with (one message each)."""


def remap_volume(held: Sequence[int], gpus_per_node: int) -> RemapVolume:
    """Per-rank volumes of :func:`balance_linear`'s matching (same targets, same
    two-pointer order: intra-node first, then each node's net surplus in rank
    order), vectorised: O(W g) instead of building spans."""
    held = np.asarray(held, dtype=np.int64)
    g = gpus_per_node
    targets = np.asarray(linear_targets(held, int(held.sum())), dtype=np.int64)
    surplus, deficit = np.maximum(held - targets, 0), np.maximum(targets - held, 0)
    # Intra-node: per node, the first min(surplus, deficit) tokens of each side
    # in rank order are matched.
    s, d = surplus.reshape(-1, g), deficit.reshape(-1, g)
    moved = np.minimum(s.sum(axis=1), d.sum(axis=1))[:, None]
    s_hi, d_hi = np.minimum(np.cumsum(s, axis=1), moved), np.minimum(np.cumsum(d, axis=1), moved)
    s_lo, d_lo = np.minimum(np.cumsum(s, axis=1) - s, moved), np.minimum(np.cumsum(d, axis=1) - d, moved)
    # Sender i and receiver j exchange a message when their intervals overlap.
    pairs = (s_lo[:, :, None] < d_hi[:, None, :]) & (d_lo[:, None, :] < s_hi[:, :, None]) \
        & (s_hi > s_lo)[:, :, None] & (d_hi > d_lo)[:, None, :]
    peers = (pairs.sum(axis=2) + pairs.sum(axis=1)).reshape(-1)
    intra_sent, intra_received = (s_hi - s_lo).reshape(-1), (d_hi - d_lo).reshape(-1)
    # Inter-node: the leftovers, one global two-pointer pass in rank order.
    out, inn = surplus - intra_sent, deficit - intra_received
    out_hi, in_hi = np.cumsum(out), np.cumsum(inn)
    out_lo, in_lo = out_hi - out, in_hi - inn
    senders, receivers = out > 0, inn > 0
    starts, ends = in_lo[receivers], in_hi[receivers]
    # Partners of an interval [lo, hi): those starting before hi minus those ending by lo.
    peers[senders] += np.searchsorted(starts, out_hi[senders]) \
        - np.searchsorted(ends, out_lo[senders], "right")
    starts, ends = out_lo[senders], out_hi[senders]
    peers[receivers] += np.searchsorted(starts, in_hi[receivers]) \
        - np.searchsorted(ends, in_lo[receivers], "right")
    return RemapVolume(intra_sent, intra_received, out, inn, peers)


class _Tail:
    """A sender's surplus tail, handed out front to back."""

    def __init__(self, rank: int, spans: list[Span], left: int) -> None:
        self.rank, self.spans, self.left, self.pos = rank, spans, left, 0

    def take(self, count: int) -> list[Span]:
        """Remove the next ``count`` tokens, splitting the last span taken if needed."""
        self.left -= count
        taken: list[Span] = []
        while count > 0:
            sp = self.spans[self.pos]
            if sp.length <= count:
                taken.append(sp)
                count -= sp.length
                self.pos += 1
            else:
                taken.append(Span(sp.seq, sp.start, sp.start + count))
                self.spans[self.pos] = Span(sp.seq, sp.start + count, sp.end)
                count = 0
        return taken
