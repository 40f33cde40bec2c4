"""Which rows meet which, and which messages move, for rings and Ulysses groups.

Pure functions of a placement and the head shapes, shared by the schedule
(sizes and pair counts of every op) and the kernels that run the ops
(``attention/ring.py``, ``attention/ulysses.py``), so the two can never
disagree on a boundary.
"""

from __future__ import annotations

from megatron_zeppelin.plan.plan import SeqPlacement
from megatron_zeppelin.plan.shards import causal_pairs

Block = tuple[int, int, int, int, bool]
"""``(q_start, q_stop, k_start, k_stop, causal)``: rows of the query holder's
buffer against rows of the key owner's buffer, and whether the block is the
diagonal (causal) one."""


def shard_tokens(placement: SeqPlacement, pos: int) -> int:
    """Tokens position ``pos`` holds."""
    return sum(e - s for s, e in placement.shards[pos])


def ring_blocks(placement: SeqPlacement, pos: int, owner: int) -> list[Block]:
    """Blocks position ``pos`` computes against the K/V of position ``owner``.

    A ring of ``k`` ranks cuts the sequence into ``2k`` chunks; position ``i``
    holds chunks ``i`` and ``2k-1-i``.  Chunks may differ in length by one token,
    so pairs are classified by chunk index: query chunk after key chunk -> full
    block, same chunk -> causal block, before -> skipped.  Full blocks that share
    their key (or query) rows and touch are fused into one kernel call: against
    an earlier owner both query chunks see its first chunk, against a later
    owner the second query chunk sees both of its chunks -- one call per step
    except on the rank's own K/V."""
    blocks = []
    for qa, (qs, qe), qoff in _chunks(placement, pos):
        for kb, (ks, ke), koff in _chunks(placement, owner):
            if qa >= kb:
                blocks.append((qoff, qoff + qe - qs, koff, koff + ke - ks, qa == kb))
    if len(blocks) == 2 and not blocks[0][4] and not blocks[1][4]:
        (q0, q1, k0, k1, _), (r0, r1, l0, l1, _) = blocks
        if (k0, k1) == (l0, l1) and q1 == r0:
            return [(q0, r1, k0, k1, False)]
        if (q0, q1) == (r0, r1) and k1 == l0:
            return [(q0, q1, k0, l1, False)]
    return blocks


def _chunks(placement: SeqPlacement, pos: int) -> list[tuple[int, tuple[int, int], int]]:
    # (chunk index, token range, row offset in the rank's buffer) of both chunks;
    # validate() guarantees every chunk holds at least one token.
    a, b = placement.shards[pos]
    return [(pos, a, 0), (2 * placement.size - 1 - pos, b, a[1] - a[0])]


def block_pairs(blocks: list[Block]) -> int:
    """Exact causal (query, key) pairs of ``blocks``."""
    total = 0
    for q0, q1, k0, k1, causal in blocks:
        tq = q1 - q0
        total += tq * (tq + 1) // 2 if causal else tq * (k1 - k0)
    return total


def ring_messages(placement: SeqPlacement, step: int, backward: bool,
                  kv_numel_per_token: int) -> list[tuple[str, int, int, int]]:
    """``(kind, src pos, dst pos, numel)`` of a ring step: ``kv`` (K/V of owner
    ``src - step``, for the next step) and, in backward, ``dkv`` (the dK/dV of
    owner ``src - step + 1`` accumulated so far, travelling one step behind).

    Forward has ``k`` steps, backward ``k + 1`` (ring-flash-attention's zigzag
    backward: the last step hands each owner its complete dK/dV)."""
    k = placement.size
    out = []
    if step < k - 1:                    # the last step's K/V need not move on
        out += [("kv", j, (j + 1) % k, 2 * shard_tokens(placement, (j - step) % k) * kv_numel_per_token)
                for j in range(k)]
    if backward and step >= 1:
        out += [("dkv", j, (j + 1) % k,
                 2 * shard_tokens(placement, (j - step + 1) % k) * kv_numel_per_token)
                for j in range(k)]
    return out


def ring_steps(placement: SeqPlacement, backward: bool) -> int:
    return placement.size + 1 if backward else placement.size


def ring_message_count(k: int, backward: bool) -> int:
    """Messages of a ring of ``k`` over all its steps (:func:`ring_messages`):
    K/V on every step but the last, dK/dV on every backward step but the first."""
    return k * (k - 1) + (k * k if backward else 0)


def ulysses_message_count(d: int) -> int:
    """Messages of a Ulysses group of ``d``: both all-to-alls (:func:`ulysses_messages`)."""
    return 2 * d * (d - 1)


def ulysses_messages(placement: SeqPlacement, step: int, backward: bool, q_heads: int, kv_heads: int,
                     head_dim: int) -> list[tuple[int, int, int]]:
    """``(src pos, dst pos, numel)`` of a Ulysses all-to-all: step 0 moves rows of
    ``src`` to the head owner ``dst`` (Q/K/V forward, dO backward), step 2 moves
    them back (O forward, dQ/dK/dV backward); step 1 is the compute."""
    if step == 1:
        return []
    d = placement.size
    hq, hk = q_heads // d, kv_heads // d
    to_heads = step == 0
    heads = hq if to_heads == backward else hq + 2 * hk
    msgs = []
    for a in range(d):
        for b in range(d):
            if a != b:
                s, e = placement.shards[a if to_heads else b][0]
                msgs.append((a, b, (e - s) * heads * head_dim))
    return msgs


def ulysses_pairs(placement: SeqPlacement) -> int:
    """Pairs one position is credited with: the whole sequence on ``1/d`` of the
    heads (``Plan.attn_pairs_per_rank``'s rule)."""
    return causal_pairs(0, placement.shards[-1][0][1]) // placement.size
