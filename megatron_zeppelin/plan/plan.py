"""The Plan: what runs where in one training step.

A Plan holds, for every sequence of the global batch, its attention placement
(``local`` on one rank, a zigzag ``ring``, or a ``ulysses`` group; rings on the
same ranks may run as one packed ring, Ulysses sequences on the same ranks as
one packed group) and, for every
rank, the token spans it holds in the *linear* layout (projections and MLP).
The remap schedule between the two layouts is derived from them.  Plans are
plain data: JSON round trip, ``validate()``, no torch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from megatron_zeppelin.errors import PlanError
from megatron_zeppelin.plan.columns import PlacementColumns, Placements, RankSpans, SpanColumns
from megatron_zeppelin.plan.placement import MODES, Mode, SeqPlacement, Span, canonical_shards
from megatron_zeppelin.plan.shards import causal_pairs


@dataclass(frozen=True)
class Transfer:
    """One remap message: tokens ``[start, end)`` of ``seq`` move ``src -> dst``."""

    src: int
    dst: int
    seq: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TierCounts:
    """How many sequences run in each tier (the trainer's ``plan`` JSON field)."""

    local: int = 0
    intra: int = 0
    inter: int = 0
    ulysses: int = 0


@dataclass(frozen=True)
class Plan:
    """Attention and linear layouts of one global batch."""

    strategy: str
    """Planner that produced it."""
    world_size: int
    """Number of ranks."""
    gpus_per_node: int
    """Ranks per node (ranks are numbered node-major)."""
    seq_lens: tuple[int, ...]
    """Token count of every sequence in the global batch."""
    attention: Sequence[SeqPlacement]
    """One placement per sequence (any order): a tuple where a planner builds
    the Plan, :class:`~megatron_zeppelin.plan.columns.Placements` (the same
    items, made when read) where it was received from a planning child."""
    linear: Sequence[Sequence[Span]]
    """``linear[r]``: token spans rank ``r`` holds for projections and MLP, in
    order (a tuple of tuples, or :class:`~megatron_zeppelin.plan.columns.RankSpans`
    as ``attention``)."""
    token_cap: int | None = None
    """Per-rank token cap both layouts must respect (None: unchecked)."""
    routed: bool = True
    """Whether the run's routing layer may route this plan's cross-node messages
    (Zeppelin decides per batch: routing's dispatch and combine legs share
    NVLink with the other traffic and may cost more than they save).  False:
    every message goes direct, whatever the run's routing threshold."""
    packed_rings: tuple[tuple[int, ...], ...] = ()
    """Sets of ring sequences (by index into ``seq_lens``) on the same ranks, in
    the same order, that run as ONE packed ring, as TransformerEngine's THD ring
    runs a CP group's sequences: each ring step sends all members' K/V chunks in
    one message (members in plan order, back to back) and computes all their
    blocks at once.  Ring sequences in none of them run one ring each."""
    packed_ulysses: tuple[tuple[int, ...], ...] = ()
    """Sets of Ulysses sequences (by index into ``seq_lens``) on the same ranks,
    in the same order, that run as ONE packed group, as FlexSP and
    DeepSpeed-Ulysses run a group's sequences: one all-to-all carrying every
    member's rows (members in plan order, back to back) each way, and the
    members' attention in one varlen call.  Ulysses sequences in none of them
    run one group each."""

    # ------------------------------------------------------------------ views
    def attention_spans(self, rank: int) -> list[Span]:
        """Rank's tokens in the attention layout, in buffer order: placements in
        plan order, each placement's shards in order.  Built for the rank asked
        (cached): a training process holds one rank's tokens, and every rank's
        spans would be one object per token range of the batch kept with the Plan."""
        cached = self._cache("_attn_spans", dict)
        spans = cached.get(rank)
        if spans is None:
            spans = cached[rank] = []
            for index, pos in self.placements_of(rank):
                p = self.attention[index]
                spans.extend(Span(p.seq, s, e) for s, e in p.shards[pos])
        return spans

    def placements_of(self, rank: int) -> list[tuple[int, int]]:
        """``(index into attention, rank's position in its ranks)`` of every
        placement ``rank`` takes part in, in plan order (found in the columns:
        the other placements are not read)."""
        return self.placement_columns().of_rank(rank)

    def shared_indices(self) -> list[int]:
        """Indices of the ring and Ulysses placements (on more than one rank),
        in plan order: with a rank's own placements, all that its attention
        schedule reads."""
        return self._cache("_shared_indices",
                           lambda: np.flatnonzero(self.placement_columns().mode != MODES.index(Mode.LOCAL)).tolist())

    def placement_columns(self) -> PlacementColumns:
        """The attention layout as columns (a received Plan's own; else made once)."""
        if isinstance(self.attention, Placements):
            return self.attention.columns
        return self._cache("_placement_columns", lambda: PlacementColumns.of(self.attention))

    def span_columns(self) -> SpanColumns:
        """The linear layout as columns (a received Plan's own; else made once)."""
        if isinstance(self.linear, RankSpans):
            return self.linear.columns
        return self._cache("_span_columns", lambda: SpanColumns.of(self.linear))

    def _cache(self, name: str, build):
        """``self.<name>``, built by ``build()`` on first use (the Plan is frozen;
        its derived data is not a field: not compared, not in the JSON; a
        received Plan arrives with some already set, ``plan/compact.py``)."""
        value = self.__dict__.get(name)
        if value is None:
            value = build()
            object.__setattr__(self, name, value)
        return value

    def packed_leads(self) -> dict[int, int]:
        """Placement index of every packed ring's or packed Ulysses group's member
        -> the index of its pack's first member in plan order (the pack's name in
        the schedule); members of no pack are absent."""
        def build() -> dict[int, int]:
            leads: dict[int, int] = {}
            if self.packed_rings or self.packed_ulysses:
                index_of = self.placement_columns().index_of_seq()
                for members in (*self.packed_rings, *self.packed_ulysses):
                    indices = sorted(int(index_of[s]) for s in members)
                    leads.update((i, indices[0]) for i in indices)
            return leads

        return self._cache("_packed_leads", build)

    def attention_tokens_per_rank(self) -> list[int]:
        tokens = self._per_local_rank(lambda n: n)
        for index in self.shared_indices():
            p = self.attention[index]
            for r, ranges in zip(p.ranks, p.shards):
                tokens[r] += sum(e - s for s, e in ranges)
        return tokens.tolist()

    def linear_tokens_per_rank(self) -> list[int]:
        lin = self.span_columns()
        tokens = np.zeros(self.world_size, dtype=np.int64)
        np.add.at(tokens, lin.owner(), lin.spans[:, 2] - lin.spans[:, 1])
        return tokens.tolist()

    def attn_pairs_per_rank(self) -> list[int]:
        """Causal (query, key) pairs each rank computes.  A Ulysses rank computes
        all pairs of ``1/d`` of the heads; it is counted as ``pairs / d``."""
        pairs = self._per_local_rank(lambda n: n * (n + 1) // 2)      # causal_pairs(0, n)
        for index in self.shared_indices():
            p = self.attention[index]
            if p.mode is Mode.ULYSSES:
                share = causal_pairs(0, self.seq_lens[p.seq]) // p.size
                for r in p.ranks:
                    pairs[r] += share
            else:
                for r, ranges in zip(p.ranks, p.shards):
                    pairs[r] += sum(causal_pairs(s, e) for s, e in ranges)
        return pairs.tolist()

    def _per_local_rank(self, of_length) -> np.ndarray:
        """``[world]`` int64: the sum of ``of_length(L)`` over each rank's local
        sequences (most of a batch, summed from the columns; the rings and
        Ulysses groups are the caller's to add)."""
        c = self.placement_columns()
        local = np.flatnonzero(c.mode == MODES.index(Mode.LOCAL))
        lengths = np.asarray(self.seq_lens, dtype=np.int64)[c.seq[local]]
        sums = np.zeros(self.world_size, dtype=np.int64)
        np.add.at(sums, c.ranks[c.starts[local]], of_length(lengths))
        return sums

    def tier_of(self, placement: SeqPlacement) -> str:
        """``local``, ``intra``, ``inter`` or ``ulysses``."""
        if placement.mode is Mode.ULYSSES:
            return "ulysses"
        if placement.mode is Mode.LOCAL:
            return "local"
        nodes = {r // self.gpus_per_node for r in placement.ranks}
        return "intra" if len(nodes) == 1 else "inter"

    def tier_counts(self) -> TierCounts:
        c = Counter(self.tier_of(self.attention[i]) for i in self.shared_indices())
        return TierCounts(local=len(self.attention) - len(self.shared_indices()), intra=c["intra"],
                          inter=c["inter"], ulysses=c["ulysses"])

    def remap_schedule(self) -> list[Transfer]:
        """Messages that turn the attention layout into the linear layout (reverse
        each for the way back).  Tokens whose owner is the same in both layouts do
        not appear.  Sorted by (src, dst, seq, start)."""
        owners = {p.seq: _owners(p) for p in self.attention}
        return _moves(owners, ((dst, sp) for dst, spans in enumerate(self.linear) for sp in spans))

    def remap_moves(self, rank: int) -> list[Transfer]:
        """The moves of :meth:`remap_schedule` from or to ``rank``, in its order,
        without making the other ranks' (what one rank's switch reads): one pass
        over the placements and the linear spans, which looks up a sequence only
        when ``rank`` holds it."""
        held: dict[int, list[tuple[int, int, int]]] = {}
        for index, pos in self.placements_of(rank):
            p = self.attention[index]
            held[p.seq] = sorted((s, e, rank) for s, e in p.shards[pos])
        index_of = self.placement_columns().index_of_seq()
        mine = self.linear[rank]
        to_me = {seq: _owners(self.attention[int(index_of[seq])]) for seq in {sp.seq for sp in mine}}
        moves = _moves(to_me, ((rank, sp) for sp in mine))
        # The other ranks' spans of the sequences ``rank`` holds, found in the columns.
        lin = self.span_columns()
        owner = lin.owner()
        rows = np.flatnonzero(np.isin(lin.spans[:, 0], list(held)) & (owner != rank))
        moves += _moves(held, ((dst, Span(q, s, e)) for dst, (q, s, e)
                               in zip(owner[rows].tolist(), lin.spans[rows].tolist())))
        moves.sort(key=lambda t: (t.src, t.dst, t.seq, t.start))
        return moves

    def remap_pairs(self) -> tuple[tuple[int, int, int], ...]:
        """``(src, dst, tokens)`` of :meth:`remap_schedule`, one per pair in its
        order: the switch's messages, numbered by position.  Cached (a planning
        child sends it with the Plan: at 1,024 GPUs every rank's moves cost the
        training thread tens of ms)."""
        def build() -> tuple[tuple[int, int, int], ...]:
            tokens: dict[tuple[int, int], int] = {}
            for t in self.remap_schedule():
                tokens[(t.src, t.dst)] = tokens.get((t.src, t.dst), 0) + t.length
            return tuple((s, d, n) for (s, d), n in tokens.items())

        return self._cache("_remap_pairs", build)

    # ------------------------------------------------------------- validation
    def validate(self) -> "Plan":
        """Check every invariant; raise :class:`PlanError` naming the first offender.

        * every sequence has exactly one placement; ranks exist and are distinct;
        * shards: ``local`` holds ``[0, L)``, ``ring`` the zigzag chunks (2k chunks,
          rank i holds i and 2k-1-i), ``ulysses`` contiguous equal chunks;
        * the linear layout covers every token of every sequence exactly once;
        * both layouts respect ``token_cap``.
        """
        w = self.world_size
        if w < 1 or self.gpus_per_node < 1 or w % self.gpus_per_node:
            raise PlanError(f"plan: world size {w} is not a multiple of gpus_per_node "
                            f"{self.gpus_per_node}")
        seen: set[int] = set()
        local = Mode.LOCAL
        for p in self.attention:
            L = self._seq_len(p.seq, "attention")
            if p.seq in seen:
                raise PlanError(f"plan: sequence {p.seq} is placed twice in the attention layout")
            seen.add(p.seq)
            if p.mode is local and len(p.ranks) == 1 and 0 <= p.ranks[0] < w and p.shards == (((0, L),),):
                continue    # a valid local placement (most of a batch): the checks below would pass
            if not p.ranks or len(set(p.ranks)) != len(p.ranks) or any(not 0 <= r < w for r in p.ranks):
                raise PlanError(f"plan: sequence {p.seq} has invalid ranks {list(p.ranks)} "
                                f"(must be distinct, in 0..{w - 1})")
            if len(p.shards) != len(p.ranks):
                raise PlanError(f"plan: sequence {p.seq} lists {len(p.shards)} shards for "
                                f"{len(p.ranks)} ranks")
            expected = _expected_shards(p.mode, L, p.size)
            if expected is None:
                raise PlanError(f"plan: sequence {p.seq} (length {L}) is in mode {p.mode.value} "
                                f"with {p.size} ranks; local takes 1 rank, ring/ulysses need "
                                f"2 or more ranks and enough tokens for 2k chunks")
            got = tuple(tuple(tuple(r) for r in ranges) for ranges in p.shards)
            if got != expected:
                raise PlanError(f"plan: sequence {p.seq} (length {L}, {p.mode.value} on "
                                f"{p.size} ranks) has shards {got}, expected {expected}")
        missing = set(range(len(self.seq_lens))) - seen
        if missing:
            raise PlanError(f"plan: sequence {min(missing)} has no attention placement")
        packed: set[int] = set()
        self._validate_packed(self.packed_rings, Mode.RING, "packed ring", packed)
        self._validate_packed(self.packed_ulysses, Mode.ULYSSES, "packed Ulysses group", packed)
        if len(self.linear) != w:
            raise PlanError(f"plan: linear layout lists {len(self.linear)} ranks, world size is {w}")
        by_seq: dict[int, list[tuple[int, int]]] = {}
        for rank, spans in enumerate(self.linear):
            for sp in spans:
                self._seq_len(sp.seq, "linear")
                if not sp.start < sp.end:
                    raise PlanError(f"plan: rank {rank} holds empty or reversed span "
                                    f"[{sp.start}, {sp.end}) of sequence {sp.seq}")
                by_seq.setdefault(sp.seq, []).append((sp.start, sp.end))
        for seq, L in enumerate(self.seq_lens):
            pos = 0
            for s, e in sorted(by_seq.get(seq, [])):
                if s != pos:
                    what = "overlaps" if s < pos else "misses"
                    raise PlanError(f"plan: the linear layout {what} tokens of sequence {seq} "
                                    f"at offset {min(s, pos)} (every token must be held exactly once)")
                pos = e
            if pos != L:
                raise PlanError(f"plan: the linear layout covers sequence {seq} up to {pos} "
                                f"of {L} tokens (every token must be held exactly once)")
        if self.token_cap is not None:
            for name, counts in (("attention", self.attention_tokens_per_rank()),
                                 ("linear", self.linear_tokens_per_rank())):
                rank = max(range(w), key=counts.__getitem__)
                if counts[rank] > self.token_cap:
                    seqs = sorted({sp.seq for sp in (self.attention_spans(rank) if name == "attention"
                                                     else self.linear[rank])})
                    raise PlanError(f"plan: rank {rank} holds {counts[rank]} tokens in the {name} "
                                    f"layout, over the cap of {self.token_cap} (sequences {seqs[:8]})")
        return self

    def _validate_packed(self, packs: tuple[tuple[int, ...], ...], mode: Mode, what: str,
                         packed: set[int]) -> None:
        """Every pack: at least two sequences, each in one pack only (``packed``:
        the sequences of the packs checked so far), each placed in ``mode``, all
        on the same ranks in the same order."""
        by_seq = {p.seq: p for p in self.attention}
        for n, members in enumerate(packs):
            if len(members) < 2:
                raise PlanError(f"plan: {what} {n} lists {len(members)} sequence(s); a {what} "
                                f"needs 2 or more (run a single sequence unpacked)")
            ranks = None
            for seq in members:
                self._seq_len(seq, f"{what} {n} of the attention")
                if seq in packed:
                    raise PlanError(f"plan: sequence {seq} is in two packs (or twice in one)")
                packed.add(seq)
                p = by_seq[seq]
                if p.mode is not mode:
                    raise PlanError(f"plan: {what} {n} lists sequence {seq}, placed {p.mode.value}; "
                                    f"only {mode.value} placements can be packed there")
                if ranks is None:
                    ranks = p.ranks
                elif p.ranks != ranks:
                    raise PlanError(f"plan: {what} {n} mixes ranks {list(ranks)} and {list(p.ranks)} "
                                    f"(sequence {seq}); its members must share one group, ranks in the same order")

    def _seq_len(self, seq: int, where: str) -> int:
        if not 0 <= seq < len(self.seq_lens):
            raise PlanError(f"plan: {where} layout names sequence {seq}, but the batch has "
                            f"{len(self.seq_lens)} sequences")
        return self.seq_lens[seq]

    # -------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The Plan JSON (``--dump-plans``): stable keys, readable outside the project."""
        out = {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "token_cap": self.token_cap,
            "seq_lens": list(self.seq_lens),
            "attention": [{"seq": p.seq, "mode": p.mode.value, "ranks": list(p.ranks),
                           "shards": [[list(r) for r in ranges] for ranges in p.shards]}
                          for p in self.attention],
            "linear": [[[sp.seq, sp.start, sp.end] for sp in spans] for spans in self.linear],
            "remap": [[t.src, t.dst, t.seq, t.start, t.end] for t in self.remap_schedule()],
            "routed": self.routed,
        }
        if self.packed_rings:       # absent when none: such a plan's JSON is as before packed rings
            out["packed_rings"] = [list(members) for members in self.packed_rings]
        if self.packed_ulysses:     # likewise
            out["packed_ulysses"] = [list(members) for members in self.packed_ulysses]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        try:
            return cls(
                strategy=str(d["strategy"]), world_size=int(d["world_size"]),
                gpus_per_node=int(d["gpus_per_node"]), token_cap=d.get("token_cap"),
                seq_lens=tuple(int(x) for x in d["seq_lens"]),
                attention=tuple(SeqPlacement(int(a["seq"]), Mode(a["mode"]), tuple(a["ranks"]),
                                             tuple(tuple((int(s), int(e)) for s, e in ranges)
                                                   for ranges in a["shards"]))
                                for a in d["attention"]),
                linear=tuple(tuple(Span(int(q), int(s), int(e)) for q, s, e in spans)
                             for spans in d["linear"]),
                routed=_flag(d.get("routed", True), "routed"),
                packed_rings=tuple(tuple(int(s) for s in members) for members in d.get("packed_rings", ())),
                packed_ulysses=tuple(tuple(int(s) for s in members) for members in d.get("packed_ulysses", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"plan JSON is malformed ({exc!r}); see 'The Plan' in docs/architecture.md") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def fingerprint(self) -> int:
        """63-bit hash of the layouts; ranks all-reduce it to prove they agree.
        Cached (a planning child sends it with the Plan: at 1,024 GPUs the JSON
        it hashes costs the training thread 70 ms)."""
        def build() -> int:
            digest = hashlib.blake2b(self.to_json().encode(), digest_size=8).digest()
            return int.from_bytes(digest, "little") >> 1

        return self._cache("_fingerprint", build)


def _owners(p: SeqPlacement) -> list[tuple[int, int, int]]:
    """``(start, end, rank)`` of every shard range of ``p``, sorted."""
    return sorted((s, e, r) for r, ranges in zip(p.ranks, p.shards) for s, e in ranges)


def _moves(owners: dict[int, list[tuple[int, int, int]]], targets) -> list[Transfer]:
    """Moves of the tokens of ``targets`` (``(dst, span)`` pairs of the linear
    layout) from their ``owners`` in the attention layout (sequence -> sorted
    ``(start, end, src)``) where the two differ, sorted by (src, dst, seq, start)."""
    moves = []
    for dst, sp in targets:
        pieces = owners[sp.seq]
        i = max(bisect.bisect_right(pieces, (sp.start, float("inf"), 0)) - 1, 0)
        while i < len(pieces) and pieces[i][0] < sp.end:
            s, e, src = pieces[i]
            lo, hi = max(s, sp.start), min(e, sp.end)
            if lo < hi and src != dst:
                moves.append(Transfer(src, dst, sp.seq, lo, hi))
            i += 1
    moves.sort(key=lambda t: (t.src, t.dst, t.seq, t.start))
    return moves


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{key!r} must be true or false, got {value!r}")
    return value


def attention_buffers(world_size: int, attention: Sequence[SeqPlacement]) -> list[list[Span]]:
    """Every rank's tokens in the attention layout, in buffer order: placements
    in order, each placement's shards in order (``Plan.attention_spans``)."""
    buffers: list[list[Span]] = [[] for _ in range(world_size)]
    for p in attention:
        if len(p.ranks) == 1 and len(p.shards[0]) == 1:
            # Local sequences (most of a batch): one span, no inner loops.
            (s, e), = p.shards[0]
            buffers[p.ranks[0]].append(Span(p.seq, s, e))
            continue
        seq = p.seq
        for rank, ranges in zip(p.ranks, p.shards):
            buffer = buffers[rank]
            for s, e in ranges:
                buffer.append(Span(seq, s, e))
    return buffers


def _expected_shards(mode: Mode, length: int, size: int) -> tuple | None:
    if mode is Mode.LOCAL:
        return (((0, length),),) if size == 1 else None
    if size < 2 or length < 2 * size:
        return None
    return canonical_shards(mode, length, size)


def placement(seq: int, length: int, mode: Mode, ranks: Sequence[int]) -> SeqPlacement:
    """The canonical placement of a sequence in ``mode`` over ``ranks``."""
    ranks = tuple(ranks)
    return SeqPlacement(seq, mode, ranks, canonical_shards(mode, length, len(ranks)))


def rings_by_ranks(attention: Sequence[SeqPlacement]) -> tuple[tuple[int, ...], ...]:
    """``Plan.packed_rings`` that pack every ring rank tuple's sequences into one
    ring, as TransformerEngine's THD ring runs a CP group (tuples holding one
    ring sequence stay ordinary rings)."""
    return _packs_by_ranks(attention, Mode.RING)


def ulysses_by_ranks(attention: Sequence[SeqPlacement]) -> tuple[tuple[int, ...], ...]:
    """``Plan.packed_ulysses`` that pack every Ulysses rank tuple's sequences into
    one group, as FlexSP and DeepSpeed-Ulysses run a group (tuples holding one
    sequence stay ordinary groups)."""
    return _packs_by_ranks(attention, Mode.ULYSSES)


def _packs_by_ranks(attention: Sequence[SeqPlacement], mode: Mode) -> tuple[tuple[int, ...], ...]:
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for p in attention:
        if p.mode is mode:
            by_ranks.setdefault(p.ranks, []).append(p.seq)
    return tuple(tuple(seqs) for seqs in by_ranks.values() if len(seqs) > 1)
