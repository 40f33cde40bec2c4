"""``flexsp``: FlexSP (Wang et al., ASPLOS'25) -- heterogeneous Ulysses SP groups per batch.

Per batch, FlexSP chooses a multiset of power-of-two sequence-parallel groups
and assigns every sequence to one of them by a MILP (PKU-DAIR/Hetu-Galvatron,
branch ``flexsp``, ``solve_flexSP_bucket_seqs``):

    min C  s.t.  sum_k x[k,p] = n_k                   every sequence in one group
                 sum_k mem(B_k, d_p) x[k,p] <= E u_p   per-GPU memory of group p
                 sum_k t(B_k, d_p) x[k,p]   <= C       per-group time
                 sum_p d_p u_p <= N                    devices
                 x integer, u binary

over length buckets ``k`` (``n_k`` sequences, upper boundary ``B_k``, cut by a
DP that minimises padding) and candidate group slots ``p`` (``N / d`` slots of
each size ``d``, fewer below the size the longest sequences need).  Here
``t(s, d)`` is Ulysses attention + all-to-alls + linear work of one sequence
from the cost model (FlexSP fits ``(a1 s^2 + a2 s)/d + beta + volume/(d bw)``
to measurements; the constant ``beta`` shifts every group alike and is
dropped), ``mem(B, d) = ceil(B / d)`` tokens per GPU and ``E`` the token cap.
Differences: HiGHS replaces SCIP; ``d`` must divide the KV-head count (Ulysses
scatters heads); slots of one size are ordered (used first, heavier first) to
break symmetry; groups are laid out as aligned consecutive rank blocks, largest
first.  Solved under ``ctx.time_limit_s`` from a greedy start (first fit under a
bisected makespan); the best incumbent is used, or the greedy grouping when the
solver has none or the greedy models faster on the real (unpadded) lengths.
Under a time limit the incumbent depends on machine speed: compute on one rank
and broadcast, as FlexSP does (its solver runs ahead, overlapped with training,
so the simulator charges no planning time to the step).  A batch that does not
fit in one pass is split into micro-batches first ("sequence blaster"), each
solved alone; gradients accumulate over them.  The group's sequences share
one all-to-all per layer (packed), so ``t`` leaves out the per-collective
latency and the timeline charges it once per group.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from typing import Callable, Sequence

import highspy
import numpy as np

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode, Plan, SeqPlacement
from megatron_zeppelin.planner.base import PlanContext
from megatron_zeppelin.planner.greedy_fit import bisect_first_fit
from megatron_zeppelin.planner.packing import check_lengths
from megatron_zeppelin.planner.plan_arrays import MODE_CODE, Placements
from megatron_zeppelin.planner.rounds import RoundsPlan, build_rounds

logger = logging.getLogger(__name__)

#: FlexSP's default bucket count (``bucket_num=16``).
NUM_BUCKETS = 16
#: Relative MIP gap at which HiGHS stops: 1 %, below the cost model's own accuracy.
MIP_REL_GAP = 1e-2


@dataclass(frozen=True)
class Bucket:
    """Sequences whose lengths fall in ``(previous boundary, boundary]``."""

    boundary: int
    """Longest length in the bucket (the MILP plans with it)."""
    shortest: int
    """Shortest length (Ulysses over ``d`` ranks needs ``>= 2d`` tokens)."""
    seqs: tuple[int, ...]
    """Sequence indices, longest first."""


def bucket_lengths(lens: Sequence[int], capacity: int, min_buckets: int = NUM_BUCKETS) -> list[Bucket]:
    """FlexSP's bucketing: contiguous buckets of the sorted lengths minimising the
    padding ``sum(boundary - L)``; start at ``min_buckets`` and add buckets until
    the padded batch is at most halfway between the real one and ``capacity``
    tokens (``bucket_seqs``).  Exact DP per bucket count, with a convex-hull
    trick over distinct lengths: O(buckets x distinct lengths)."""
    values = sorted(set(lens))
    counts = {v: 0 for v in values}
    for L in lens:
        counts[L] += 1
    u = len(values)
    C = [0] * (u + 1)  # C[j]: sequences among the j shortest distinct lengths
    P = [0] * (u + 1)  # P[j]: their tokens
    for j, v in enumerate(values):
        C[j + 1], P[j + 1] = C[j] + counts[v], P[j] + counts[v] * v
    total, inf = P[u], float("inf")
    prev: list[float] = [0] + [inf] * u
    args: list[list[int]] = []
    for k in range(1, u + 1):
        cur, arg = _pad_layer(prev, values, C, P)
        args.append(arg)
        prev = cur
        if k >= min(min_buckets, u) and (2 * (total + cur[u]) <= total + capacity or k == u):
            break
    cuts, j = [], u
    for arg in reversed(args):
        cuts.append(j)
        j = arg[j]
    cuts.reverse()
    by_len: dict[int, list[int]] = {}
    for seq in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        by_len.setdefault(lens[seq], []).append(seq)
    buckets, lo = [], 0
    for hi in cuts:
        seqs = [s for v in reversed(values[lo:hi]) for s in by_len[v]]
        buckets.append(Bucket(values[hi - 1], values[lo], tuple(seqs)))
        lo = hi
    return buckets


def _pad_layer(prev: list[float], v: list[int], C: list[int], P: list[int]) -> tuple[list[float], list[int]]:
    """One DP layer: ``cur[j] = min_i prev[i] + v[j-1] (C[j]-C[i]) - (P[j]-P[i])``.
    Lines ``y = -C[i] x + prev[i] + P[i]`` arrive with falling slopes and are
    queried at rising ``x = v[j-1]``, so a deque keeps the lower envelope."""
    u = len(v)
    cur: list[float] = [float("inf")] * (u + 1)
    arg = [0] * (u + 1)
    hull: list[tuple[int, float, int]] = []  # (slope, intercept, i)
    head = 0

    def y(line: tuple[int, float, int], x: int) -> float:
        return line[0] * x + line[1]

    for j in range(1, u + 1):
        i = j - 1
        if prev[i] != float("inf"):
            new = (-C[i], prev[i] + P[i], i)
            while len(hull) - head >= 2:
                (m1, b1, _), (m2, b2, _) = hull[-2], hull[-1]
                # Middle line useless if the new one overtakes line 1 no later than line 2 does.
                if (new[1] - b1) * (m1 - m2) <= (b2 - b1) * (m1 - new[0]):
                    hull.pop()
                else:
                    break
            hull.append(new)
        if not hull:  # fewer distinct lengths than buckets so far
            continue
        x = v[j - 1]
        while len(hull) - head >= 2 and y(hull[head + 1], x) <= y(hull[head], x):
            head += 1
        cur[j] = v[j - 1] * C[j] - P[j] + y(hull[head], x)
        arg[j] = hull[head][2]
    return cur, arg


def ulysses_sizes(world_size: int, kv_heads: int) -> list[int]:
    """Group sizes FlexSP may use: powers of two up to the world dividing the KV heads."""
    sizes, d = [], 1
    while d <= world_size:
        if kv_heads % d == 0:
            sizes.append(d)
        d *= 2
    return sizes


class SeqTime:
    """``t(L, d)``: seconds of one sequence on an aligned Ulysses group of ``d`` ranks
    (attention on ``heads/d``, all-to-alls, and ``1/d`` of the linear work) under
    one cost model.  :meth:`column` answers for many lengths at once (FlexSP's
    greedy asks it for every distinct length of a batch and every group size:
    one Python call each was most of its time in the per-batch decision); a
    single ``t(L, d)`` is that column's one element, its answers kept across
    batches."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._link = lru_cache(maxsize=None)(lambda d: cost.alltoall_link(range(d)))   # one per group size
        self._one = lru_cache(maxsize=1 << 17)(self._scalar)

    def column(self, lengths: np.ndarray, d: int) -> np.ndarray:
        """``t(L, d)`` of every ``L`` in ``lengths`` (integers)."""
        lens = np.asarray(lengths, dtype=np.int64)
        linear = np.array([self.cost.linear_s(L) for L in lens.tolist()], dtype=np.float64)
        return self.cost.ulysses_alone_s(lens, d, self._link(d)) + linear / d

    def __call__(self, length: int, d: int) -> float:
        return self._one(length, d)

    def _scalar(self, length: int, d: int) -> float:
        return float(self.column(np.array([length]), d)[0])


@lru_cache(maxsize=16)
def seq_time_fn(cost: CostModel) -> SeqTime:
    """The :class:`SeqTime` of ``cost``, one per cost model (batches repeat lengths)."""
    return SeqTime(cost)


def _min_size(length: int, cap: int, sizes: Sequence[int]) -> int | None:
    return next((d for d in sizes if -(-length // d) <= cap), None)


#: ``(size, members)`` of one SP group.
Group = tuple[int, list[int]]


def _fits(length: int, shortest: int, d: int, cap: int) -> bool:
    """Memory (``ceil(L/d)`` tokens per GPU) and Ulysses' ``2d``-token minimum."""
    return -(-length // d) <= cap and (d == 1 or shortest >= 2 * d)


def greedy_groups(lengths: Sequence[int], shortest: Sequence[int], sizes: Sequence[int], world: int,
                  cap: int, t: Callable[[np.ndarray, int], np.ndarray], steps: int = 12) -> list[Group] | None:
    """Heterogeneous greedy: bisect the makespan limit of a first fit (longest
    first, each sequence into the first open group it fits, else a new group of
    the smallest size that runs it within the limit) between the slowest
    sequence's best time and the first limit that fits
    (:func:`~megatron_zeppelin.planner.greedy_fit.bisect_first_fit`).  The
    MILP's start, and the plan when the MILP finds nothing.  ``t(lengths, d)``
    answers for an array of lengths at once (:meth:`SeqTime.column`)."""
    lens = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lens, kind="stable")    # longest first, ties by index
    d = np.asarray(sizes, dtype=np.int64)
    by_len = lens[order]
    tokens = -(-by_len[:, None] // d[None, :])
    fits = (tokens <= cap) & ((d == 1) | (np.asarray(shortest, dtype=np.int64)[order][:, None] >= 2 * d))
    # t once per distinct length and size any sequence of that length may fit
    # (shortest <= length): batches repeat lengths.
    distinct, row = np.unique(by_len, return_inverse=True)
    table = np.zeros((len(distinct), len(d)))
    for k, dk in enumerate(sizes):
        may_fit = (-(-distinct // dk) <= cap) & ((dk == 1) | (distinct >= 2 * dk))
        if may_fit.any():
            table[may_fit, k] = t(distinct[may_fit], dk)
    n_groups, group_size, group_of = bisect_first_fit(fits, table[row], tokens, d, world, cap, steps)
    if n_groups < 0:
        return None
    members: list[list[int]] = [[] for _ in range(n_groups)]
    for i, g in zip(order.tolist(), group_of.tolist()):
        members[g].append(i)
    return [(sizes[k], m) for k, m in zip(group_size.tolist(), members)]


@dataclass(frozen=True)
class _Milp:
    """FlexSP's bucketed MILP in HiGHS' terms: column 0 is C, then per slot ``u``
    and its ``x`` columns; rows as ``(lower, upper, columns, coefficients)``."""

    sizes: tuple[int, ...]
    """Group size of every slot."""
    u_col: tuple[int, ...]
    """Column of ``u_p``."""
    x_col: tuple[dict[int, int], ...]
    """``x_col[p][k]``: column of ``x[k,p]`` (absent: bucket k not allowed in p)."""
    lb: list[float]
    """Column lower bounds."""
    ub: list[float]
    """Column upper bounds."""
    rows: list[tuple[float, float, list[int], list[float]]]
    """Constraints."""


#: Times enter the MILP in milliseconds, which keeps coefficients near 1.
_MS = 1e3


def _slot_sizes(buckets: Sequence[Bucket], sizes: Sequence[int], world: int, cap: int) -> list[int]:
    """The group size of every candidate slot: ``N / d`` of each size ``d``,
    fewer below the size the longest sequences need (FlexSP's pruning: small
    groups share what the longest sequences leave)."""
    need = [_min_size(b.boundary, cap, sizes) for b in buckets]
    biggest = max(need)
    n_big = sum(len(b.seqs) for b, d in zip(buckets, need) if d == biggest)
    return [d for d in sizes for _ in range((world - (biggest * n_big if d < biggest else 0)) // d)]


def milp_columns(buckets: Sequence[Bucket], sizes: Sequence[int], world: int, cap: int) -> int:
    """Columns of :func:`build_milp`'s MILP (C, and per slot ``u`` and an ``x``
    per bucket it may hold), without building it."""
    return 1 + sum(1 + sum(_fits(b.boundary, b.shortest, d, cap) for b in buckets)
                   for d in _slot_sizes(buckets, sizes, world, cap))


def build_milp(buckets: Sequence[Bucket], sizes: Sequence[int], world: int, cap: int,
               t: Callable[[int, int], float]) -> _Milp:
    """Columns and rows of the MILP in the module docstring, plus two cuts and
    symmetry breaking."""
    slot_sizes = _slot_sizes(buckets, sizes, world, cap)
    # Cut: C is at least the slowest bucket's best single-sequence time.
    c_min = max(min(t(b.boundary, d) for d in sizes if _fits(b.boundary, b.shortest, d, cap))
                for b in buckets) * _MS
    lb, ub = [c_min], [np.inf]
    u_col, x_col = [], []
    for d in slot_sizes:
        u_col.append(len(lb))
        lb.append(0.0), ub.append(1.0)
        cols = {}
        for k, b in enumerate(buckets):
            if _fits(b.boundary, b.shortest, d, cap):
                cols[k] = len(lb)
                lb.append(0.0), ub.append(float(min(len(b.seqs), cap // -(-b.boundary // d))))
        x_col.append(cols)
    rows: list[tuple[float, float, list[int], list[float]]] = []
    for k, b in enumerate(buckets):
        idx = [cols[k] for cols in x_col if k in cols]
        rows.append((len(b.seqs), len(b.seqs), idx, [1.0] * len(idx)))
    times = []  # per slot: (x columns, milliseconds per sequence)
    for p, d in enumerate(slot_sizes):
        ks = sorted(x_col[p])
        cols = [x_col[p][k] for k in ks]
        rows.append((-np.inf, 0.0, cols + [u_col[p]],
                     [float(-(-buckets[k].boundary // d)) for k in ks] + [-float(cap)]))
        times.append((cols, [t(buckets[k].boundary, d) * _MS for k in ks]))
        rows.append((-np.inf, 0.0, cols + [0], times[p][1] + [-1.0]))
    rows.append((-np.inf, float(world), list(u_col), [float(d) for d in slot_sizes]))
    # Cut: GPU-seconds of all groups fit in N GPUs x C (each group's time <= C).
    rows.append((-np.inf, 0.0, [c for cols, _ in times for c in cols] + [0],
                 [v * d for (_, vals), d in zip(times, slot_sizes) for v in vals] + [-float(world)]))
    for p in range(len(slot_sizes) - 1):  # symmetry: same-size slots used first, heavier first
        if slot_sizes[p] == slot_sizes[p + 1]:
            rows.append((0.0, np.inf, [u_col[p], u_col[p + 1]], [1.0, -1.0]))
            rows.append((0.0, np.inf, times[p][0] + times[p + 1][0],
                         times[p][1] + [-c for c in times[p + 1][1]]))
    return _Milp(tuple(slot_sizes), tuple(u_col), tuple(x_col), lb, ub, rows)


def solve_milp(buckets: Sequence[Bucket], sizes: Sequence[int], world: int, cap: int,
               t: Callable[[int, int], float], time_limit_s: float,
               start: list[tuple[int, dict[int, int]]] | None = None
               ) -> list[tuple[int, dict[int, int]]] | None:
    """Solve FlexSP's bucketed MILP with HiGHS; returns the used groups as
    ``(size, {bucket: count})`` (the incumbent at the time limit), or None if
    HiGHS found no solution."""
    return solve_built(build_milp(buckets, sizes, world, cap, t), buckets, t, MilpLimits(time_limit_s), start)


@dataclass(frozen=True)
class MilpLimits:
    """How far a solve of FlexSP's MILP may go."""

    time_limit_s: float
    """HiGHS' time limit (FlexSP's own planner: ``PlanContext.time_limit_s``).
    Where it stops the solve, the incumbent depends on the machine's speed."""
    max_nodes: int | None = None
    """HiGHS' branch-and-bound node limit (None: none).  Single-threaded, HiGHS
    takes the same path on every machine, so a solve bounded by nodes alone
    gives every rank the same grouping (Zeppelin's decision plans on each rank)."""
    max_columns: int | None = None
    """Skip the solve of a MILP with more columns (None: any size)."""


def solve_built(m: _Milp, buckets: Sequence[Bucket], t: Callable[[int, int], float], limits: MilpLimits,
                start: list[tuple[int, dict[int, int]]] | None = None) -> list[tuple[int, dict[int, int]]] | None:
    """:func:`solve_milp` of the built MILP ``m`` under ``limits``."""
    n, rows = len(m.lb), m.rows
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(limits.time_limit_s))
    if limits.max_nodes is not None:
        h.setOptionValue("mip_max_nodes", int(limits.max_nodes))
    h.setOptionValue("mip_rel_gap", MIP_REL_GAP)
    h.setOptionValue("threads", 1)
    obj = np.zeros(n)
    obj[0] = 1.0
    h.addCols(n, obj, np.array(m.lb), np.array(m.ub), 0, np.zeros(n + 1, np.int32),
              np.zeros(0, np.int32), np.zeros(0))
    starts = np.cumsum([0] + [len(r[2]) for r in rows[:-1]]).astype(np.int32)
    h.addRows(len(rows), np.array([r[0] for r in rows], float), np.array([r[1] for r in rows], float),
              sum(len(r[2]) for r in rows), starts,
              np.array([i for r in rows for i in r[2]], np.int32),
              np.array([v for r in rows for v in r[3]], float))
    ints = np.arange(1, n, dtype=np.int32)  # every column but C
    h.changeColsIntegrality(len(ints), ints, np.full(len(ints), 1, np.uint8))
    if start is not None:
        h.setSolution(_start_vector(m, start, buckets, t))
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    if h.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        logger.debug("flexsp: HiGHS status %s, no incumbent", status)
        return None
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        logger.debug("flexsp: HiGHS stopped at %s; using its incumbent (gap %.3g)",
                     status, h.getInfo().mip_gap)
    x = np.rint(np.asarray(h.getSolution().col_value)).astype(int)
    groups = []
    for p, d in enumerate(m.sizes):
        counts = {k: int(x[c]) for k, c in m.x_col[p].items() if x[c] > 0}
        if counts:
            groups.append((d, counts))
    return groups


def _start_vector(m: _Milp, start: list[tuple[int, dict[int, int]]], buckets: Sequence[Bucket],
                  t: Callable[[int, int], float]) -> highspy.HighsSolution:
    """A MIP start from ``(size, {bucket: count})`` groups, heaviest first per size."""
    col = np.zeros(len(m.lb))

    def load(group: tuple[int, dict[int, int]]) -> float:
        return sum(t(buckets[k].boundary, group[0]) * c for k, c in group[1].items())

    free = {d: [p for p, s in enumerate(m.sizes) if s == d] for d in set(m.sizes)}
    for d, counts in sorted(start, key=lambda g: (-g[0], -load(g))):
        if not free.get(d):
            break
        p = free[d].pop(0)
        col[m.u_col[p]] = 1
        for k, c in counts.items():
            if k in m.x_col[p]:
                col[m.x_col[p][k]] = c
        col[0] = max(col[0], load((d, counts)) * _MS)
    sol = highspy.HighsSolution()
    sol.col_value = col.tolist()
    sol.value_valid = True
    return sol


class FlexSpPlanner:
    """Heterogeneous Ulysses SP groups chosen per batch by FlexSP's MILP; a batch
    that does not fit in one pass is split into micro-batches first."""

    name = "flexsp"

    def plan_rounds(self, seq_lens: Sequence[int], ctx: PlanContext) -> RoundsPlan:
        lens = check_lengths(seq_lens)
        return build_rounds(self.name, ctx.topology, lens, self._rounds(lens, ctx), ctx.tokens_per_gpu)

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        return self.plan_rounds(seq_lens, ctx).merged

    def _rounds(self, lens: tuple[int, ...], ctx: PlanContext) -> list[list[SeqPlacement]]:
        """FlexSP's sequence blaster: the fewest micro-batches, starting from
        ``tokens / (world x cap)``, whose every part the solver can place; parts
        are filled longest first onto the part with the fewest tokens."""
        cap, world = ctx.tokens_per_gpu, ctx.topology.world_size
        kv_heads = ctx.local_heads[1]
        sizes = ulysses_sizes(world, kv_heads)
        for seq, L in enumerate(lens):
            if _min_size(L, cap, sizes) is None:
                raise InfeasibleError(
                    f"flexsp: sequence {seq} ({L} tokens) needs an SP group of more than "
                    f"{sizes[-1]} GPUs at {cap} tokens per GPU, but Ulysses groups are limited to "
                    f"powers of two dividing both {kv_heads} KV heads and {world} GPUs; raise "
                    "--tokens-per-gpu or use a ring-based strategy")
        parts = max(1, -(-sum(lens) // (world * cap)))
        while parts <= len(lens):
            rounds = [self._solve(lens, part, sizes, ctx) for part in _split(lens, parts)]
            if all(r is not None for r in rounds):
                return rounds
            parts += 1
        raise InfeasibleError(
            f"flexsp: no SP grouping fits {sum(lens)} tokens in {world} GPUs x {cap} "
            "tokens per GPU even one sequence per micro-batch; raise --tokens-per-gpu")

    def _solve(self, lens: tuple[int, ...], seqs: list[int], sizes: list[int],
               ctx: PlanContext) -> list[SeqPlacement] | None:
        """Placements of the sequences ``seqs`` in one pass, or None."""
        members = one_pass_groups([lens[i] for i in seqs], sizes, ctx.topology.world_size, ctx.tokens_per_gpu,
                                  ctx.cost, MilpLimits(ctx.time_limit_s))
        return None if members is None else group_placements(members, seqs, lens)


def one_pass_groups(lens: Sequence[int], sizes: Sequence[int], world: int, cap: int, cost: CostModel,
                    limits: MilpLimits) -> list[Group] | None:
    """FlexSP's grouping of ``lens`` in one pass (members index into ``lens``):
    the MILP's, started from the greedy on the MILP's own data, or the greedy's
    on the real lengths where the MILP has none or the greedy models faster.
    None when neither holds the batch, or when the MILP has more than
    ``limits.max_columns`` columns."""
    t = seq_time_fn(cost)
    buckets = bucket_lengths(lens, world * cap)
    if limits.max_columns is not None and milp_columns(buckets, sizes, world, cap) > limits.max_columns:
        return None
    milp = build_milp(buckets, sizes, world, cap, t)
    # Start: the greedy on the MILP's own data (boundaries, bucket minima).
    padded = [(k, b.boundary, b.shortest) for k, b in enumerate(buckets) for _ in b.seqs]
    hint = greedy_groups([p[1] for p in padded], [p[2] for p in padded], sizes, world, cap, t.column)
    start = None if hint is None else [(d, dict(Counter(padded[i][0] for i in items)))
                                       for d, items in hint]
    groups = solve_built(milp, buckets, t, limits, start)
    greedy = greedy_groups(lens, lens, sizes, world, cap, t.column)
    members = None if groups is None else _assign(groups, buckets, lens, t)
    if members is None:
        logger.debug("flexsp: no MILP solution within %s; using the greedy grouping", limits)
        return greedy
    if greedy is not None and _makespan(greedy, lens, t) < _makespan(members, lens, t):
        # Bucket padding can make the MILP's optimum slightly worse on real lengths.
        logger.debug("flexsp: greedy grouping beats the MILP's on real lengths")
        return greedy
    return members


def group_placements(groups: list[Group], seqs: Sequence[int], lens: Sequence[int]) -> list[SeqPlacement]:
    """Placements of SP groups over ``seqs`` (group members index into it): the
    groups as aligned consecutive rank blocks, largest first."""
    return list(group_layout(groups, seqs).build(lens))


def group_layout(groups: list[Group], seqs: Sequence[int]) -> Placements:
    """:func:`group_placements` as columns (the per-batch decision builds the
    placements of only the candidates it runs)."""
    ordered = sorted(groups, key=lambda g: -g[0])
    sizes = np.array([d for d, _ in ordered], np.int64)
    count = [len(members) for _, members in ordered]
    size = np.repeat(sizes, count)
    first = np.repeat(np.cumsum(sizes) - sizes, count)
    seq = np.asarray(seqs, np.int64)[np.fromiter(chain.from_iterable(m for _, m in ordered), np.int64, sum(count))]
    return Placements.of_blocks(seq, np.where(size == 1, 0, MODE_CODE[Mode.ULYSSES]), first, size)


def _split(lens: Sequence[int], parts: int) -> list[list[int]]:
    """Sequence indices in ``parts`` micro-batches, longest first onto the part
    with the fewest tokens (ties: the lower part)."""
    out: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for seq in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        p = min(range(parts), key=lambda p: (tokens[p], p))
        out[p].append(seq)
        tokens[p] += lens[seq]
    return [sorted(p) for p in out if p]


def _makespan(groups: list[Group], lens: Sequence[int], t: Callable[[int, int], float]) -> float:
    return max((sum(t(lens[i], d) for i in members) for d, members in groups), default=0.0)


def _assign(groups: list[tuple[int, dict[int, int]]], buckets: Sequence[Bucket],
            lens: Sequence[int], t: Callable[[int, int], float]) -> list[tuple[int, list[int]]]:
    """Real sequences into the MILP's groups: each bucket's sequences, longest first,
    to the group with the least modeled time among those with quota left for that
    bucket.  Memory holds because every length is at most its bucket's boundary."""
    load = [0.0] * len(groups)
    members: list[tuple[int, list[int]]] = [(d, []) for d, _ in groups]
    for k, b in enumerate(buckets):
        quota = {g: counts[k] for g, (_, counts) in enumerate(groups) if counts.get(k)}
        for seq in b.seqs:
            g = min(quota, key=lambda g: (load[g], g))
            d = groups[g][0]
            members[g][1].append(seq)
            load[g] += t(lens[seq], d)
            quota[g] -= 1
            if not quota[g]:
                del quota[g]
    return members
