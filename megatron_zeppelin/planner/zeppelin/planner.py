"""ZeppelinPlanner: runs the packing passes and builds the chosen Plan."""

from __future__ import annotations

import dataclasses
import functools
import gc
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode, Plan
from megatron_zeppelin.planner.base import PlanContext, same_layout_linear
from megatron_zeppelin.planner.fastest import fastest
from megatron_zeppelin.planner.linear_layout import balance_linear, linear_targets
from megatron_zeppelin.planner.plan_arrays import MODE_CODE, PlanArrays, Placements, layout_arrays
from megatron_zeppelin.planner.surrogate import StepSurrogate
from megatron_zeppelin.planner.zeppelin.exact import exact_fill
from megatron_zeppelin.planner.zeppelin.loads import _Assign, _Loads, _TierTimes, min_ring_size
from megatron_zeppelin.planner.zeppelin.packer import _Packer
from megatron_zeppelin.planner.zeppelin.settings import LIGHT_TIME, LIGHT_TOKENS, PASS_BUDGET, PASSES, _Pass

class ZeppelinPlanner:
    """Hierarchical sequence partitioning: local / intra-node ring / inter-node ring,
    and Ulysses groups where the cost model prefers them."""

    name = "zeppelin"

    def __init__(self) -> None:
        #: The last batch's passes' drafts by assignment: the decision plans a
        #: batch under several contexts (remap on and off, routed and direct
        #: crossings), and the routed and direct ones mostly place it alike
        #: (every batch of ``benchmarks/planner_latency.py`` at 64 GPUs): each
        #: plan is laid out, and built, once.
        self._drafts: tuple[tuple, dict[tuple, PassDraft]] = ((), {})
        #: The last batch's passes that asked nothing across nodes, by what they ran under (see _pass_drafts).
        self._within_nodes: tuple[tuple[int, ...], dict[tuple, list[_Result]]] = ((), {})
        #: The last batch's packers by what they pack under: the decision's
        #: contexts with and without the remap share one, and its memos of
        #: tier times and shard sizes.
        self._packers: tuple[tuple[int, ...], dict[tuple, _Packer]] = ((), {})

    def plan(self, seq_lens: Sequence[int], ctx: PlanContext) -> Plan:
        # The passes' plans compared by the project's clock (the replay's step,
        # through its certified surrogate): ties keep the first pass.
        with gc_paused():
            plans = [d.plan() for d in self._pass_drafts(seq_lens, ctx)]
            return plans[0] if len(plans) == 1 else fastest(plans, StepSurrogate(ctx.cost).step_s)

    def pass_plans(self, seq_lens: Sequence[int], ctx: PlanContext) -> list[Plan]:
        """The plans of the packing passes the batch allows, in pass order (the
        last resort's alone when every pass stranded a sequence): :meth:`plan`
        keeps the one of least surrogate step."""
        return [d.plan() for d in self.pass_drafts(seq_lens, ctx)]

    def pass_drafts(self, seq_lens: Sequence[int], ctx: PlanContext) -> list[PassDraft]:
        """:meth:`pass_plans` before they are built: the per-batch decision
        bounds each by its layout and builds only those it prices."""
        # A plan allocates tens of thousands of small objects (placements,
        # spans) and none of them forms a cycle: the cyclic collector's passes
        # over the whole heap would be pure overhead (on the main thread; see
        # gc_paused for why not elsewhere).
        with gc_paused():
            return self._pass_drafts(seq_lens, ctx)

    def _pass_drafts(self, seq_lens: Sequence[int], ctx: PlanContext) -> list[PassDraft]:
        topo = ctx.topology
        w, cap = topo.world_size, ctx.tokens_per_gpu
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        check_feasible(lens, w, cap)
        lens_t = tuple(lens.tolist())
        packer = self._packer(lens_t, lens, ctx)
        times = packer.times
        order = np.argsort(-lens, kind="stable")
        local_s = packer.local_s
        mean_s = max(float(local_s.sum()) / w, 1e-12)
        light = (lens <= LIGHT_TOKENS * cap) & (local_s <= LIGHT_TIME * mean_s)
        heavy = order[~light[order]].tolist()
        light_seqs = order[light[order]]
        light_work = float(local_s[light].sum())

        # The remap layer promises a token-balanced linear layout; without it
        # the attention layout is the linear one and is balanced with it.  A
        # nearly full batch can strand a sequence in every pass of the run's
        # layout; the other layout's passes place it differently, and their plan
        # is valid either way (its linear layout is then its attention layout:
        # a remap moves nothing).  Only then the last resort's token-only
        # packing: on a 99.95 %-full batch of 9 python-dirs sequences at 32 GPUs
        # it ran 3.5x slower than the one remap-off pass that held the batch.
        # Costs that differ only in routing answer every question within a node
        # alike (NVLink, compute): passes that never asked about a crossing
        # run the same under either, so the decision's direct-crossings context
        # takes them from its routed one.
        run = (lens_t, topo, cap, ctx.local_heads, ctx.remap_enabled, ctx.cost.routed(False), times.intra,
               packer.linear_per_token)
        if self._within_nodes[0] != lens_t:
            self._within_nodes = (lens_t, {})
        results = self._within_nodes[1].get(run)
        if results is None:
            times.crossed = False
            budget = max(1, PASS_BUDGET // max(len(heavy), 1))
            results = []
            for layout in (ctx.remap_enabled, not ctx.remap_enabled):
                for setting in [p for p in PASSES if p.remap == layout][:budget]:
                    try:
                        results.append(_one_pass(packer, heavy, light_seqs, light_work, mean_s, setting))
                    except InfeasibleError:
                        continue
                if results:
                    break
            if not times.crossed:
                self._within_nodes[1][run] = results
        if not results:
            return [self._draft_of(lens_t, _last_resort(packer, order), ctx.remap_enabled, ctx)]
        return [self._draft_of(lens_t, r.assign, r.remap and ctx.remap_enabled, ctx) for r in results]

    def _packer(self, lens_t: tuple[int, ...], lens: np.ndarray, ctx: PlanContext) -> _Packer:
        if self._packers[0] != lens_t:
            self._packers = (lens_t, {})
        key = (ctx.topology, ctx.tokens_per_gpu, ctx.local_heads, ctx.cost)
        packer = self._packers[1].get(key)
        if packer is None:
            times = _TierTimes(ctx.cost, ctx.topology.gpus_per_node, ctx.topology.nodes)
            other = next(iter(self._packers[1].values()), None)
            packer = self._packers[1][key] = _Packer(lens, ctx, times, memo_of=other)
        return packer

    def _draft_of(self, seq_lens: tuple[int, ...], out: _Assign, remap: bool, ctx: PlanContext) -> PassDraft:
        """The :class:`PassDraft` of an assignment, once per batch."""
        batch = (seq_lens, ctx.topology.world_size, ctx.topology.gpus_per_node, ctx.tokens_per_gpu)
        if self._drafts[0] != batch:
            self._drafts = (batch, {})
        known = self._drafts[1]
        key = (out.local.tobytes(), tuple(sorted(out.groups.items())), remap)
        draft = known.get(key)
        if draft is None:
            layout = _layout(out)
            draft = known[key] = PassDraft(layout, seq_lens, ctx.topology.world_size, remap,
                                           functools.partial(_built, self.name, seq_lens, layout, remap, ctx))
        return draft


@dataclass
class PassDraft:
    """One packing pass's plan before it is built: its layout, what the per-batch
    decision bounds it by (``planner/fastest.py``), and its build."""

    layout: Placements
    """Every sequence's placement, in sequence order."""
    seq_lens: tuple[int, ...]
    """The batch."""
    world_size: int
    """Ranks."""
    remap: bool
    """Whether the linear layout is token-balanced (else the attention layout)."""
    build: Callable[[], Plan]
    """Builds the Plan."""
    built: dict[bool, Plan] = field(default_factory=dict, repr=False)
    """The Plan as built (True) and as run direct (False), once asked for."""
    read: PlanArrays | None = field(default=None, repr=False)
    """The attention layout's arrays, once read."""

    def plan(self, routed: bool = True) -> Plan:
        """The Plan; ``routed=False``: a copy that runs every crossing direct."""
        if routed not in self.built:
            self.built[routed] = (self.build() if routed
                                  else dataclasses.replace(self.plan(), routed=False))
        return self.built[routed]

    def arrays(self) -> PlanArrays:
        """The arrays of the attention layout (``plan_arrays.layout_arrays`` of no linear layout)."""
        if self.read is None:
            self.read = layout_arrays(self.world_size, self.seq_lens, self.layout, None)
        return self.read

    def linear_tokens(self) -> np.ndarray:
        """Every rank's tokens in the linear layout (balance_linear's targets with the remap)."""
        held = self.arrays().linear_tokens
        if not self.remap:
            return held
        return np.asarray(linear_targets(held.astype(np.int64), int(sum(self.seq_lens))), np.float64)


def _layout(out: _Assign) -> Placements:
    """An assignment's placements in sequence order, as columns (most sequences
    are local: one vectorised row each)."""
    local, split = out.local, sorted(out.groups.items())
    size = np.ones(len(local), np.int64)
    mode = np.zeros(len(local), np.int8)
    for i, (ranks, ulysses) in split:
        size[i], mode[i] = len(ranks), MODE_CODE[Mode.ULYSSES if ulysses else Mode.RING]
    flat = np.repeat(local, size)
    starts = np.cumsum(size) - size
    for i, (ranks, _) in split:
        flat[starts[i]:starts[i] + size[i]] = ranks
    return Placements(np.arange(len(local)), mode, size, flat)


def _built(name: str, seq_lens: tuple[int, ...], layout: Placements, remap: bool, ctx: PlanContext) -> Plan:
    """The Plan of a pass's layout (its linear layout token-balanced when ``remap``)."""
    topo = ctx.topology
    w, g, cap = topo.world_size, topo.gpus_per_node, ctx.tokens_per_gpu
    attention = layout.build(seq_lens)
    lens = np.asarray(seq_lens, dtype=np.int64)
    return Plan(strategy=name, world_size=w, gpus_per_node=g, seq_lens=seq_lens, attention=attention,
                linear=(balance_linear(attention, lens, w, g, cap) if remap
                        else same_layout_linear(w, attention)), token_cap=cap)


def _last_resort(packer: _Packer, order: np.ndarray) -> _Assign:
    """Every balanced pass stranded a sequence: place by tokens alone, greedily,
    else by the backtracking search of :mod:`.exact`."""
    try:
        return packer.tokens_only(order)
    except InfeasibleError as exc:
        out = exact_fill(packer.lens, packer.cap, packer.w)
        if out is None:
            raise InfeasibleError(f"zeppelin: no placement of the batch {_brief(packer.lens)} under "
                                  f"tokens_per_gpu={packer.cap} on {packer.w} GPUs was found ({exc})") from None
        return out


def _brief(lens: np.ndarray) -> str:
    shown = ", ".join(str(int(n)) for n in lens[:8])
    return f"[{shown}{', ...' if len(lens) > 8 else ''}] ({int(lens.sum())} tokens)"


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting still frees
    everything) while a plan is built on the main thread; restore it only if it
    was on, so nested callers never leave it off.

    The collector is the interpreter's, not the thread's: a pause on the
    trainer's planning thread (``integration/hooks.py``'s prefetch) would stop
    it for the training thread too, and re-enabling it at the end would undo a
    ``gc.disable()`` the training thread made meanwhile (Megatron's
    ``--manual-gc``).  So off the main thread the collector keeps running: the
    plan costs more CPU there (docs/planner.md measures it), off the training
    loop's critical path."""
    if not gc.isenabled() or threading.current_thread() is not threading.main_thread():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass(frozen=True)
class _Result:
    """One packing pass's assignment."""

    assign: _Assign
    """Where every sequence goes."""
    remap: bool
    """Whether the linear layout is token-balanced (else the attention layout)."""


def _one_pass(packer: _Packer, heavy: list[int], light: np.ndarray, light_work: float,
              mean_s: float, setting: _Pass) -> _Result:
    """Heavy placement, then the light fill."""
    per_token = 0.0 if setting.remap else packer.linear_per_token
    loads, out = _Loads.empty(packer.w, per_token), _Assign.empty(len(packer.lens))
    packer.place_heavy(heavy, setting, light_work, loads, out)
    filled, done = loads.copy(), out.copy()
    try:
        packer.fill_light(light, mean_s + per_token * packer.fill, filled, done)
    except InfeasibleError:
        # A nearly full batch can strand the last short sequences between
        # fragments of free room: fill again keeping the free room even.
        filled, done = loads.copy(), out.copy()
        packer.fill_light(light, None, filled, done)
    return _Result(done, setting.remap)


def check_feasible(lens: np.ndarray, world: int, cap: int) -> None:
    """Raise :class:`InfeasibleError` for batches no placement can hold."""
    if len(lens) and int(lens.min()) < 1:
        seq = int(np.argmin(lens))
        raise InfeasibleError(f"zeppelin: sequence {seq} has {int(lens[seq])} tokens; every "
                              f"sequence needs at least one token (drop empty documents)")
    for seq in np.nonzero(lens > cap)[0]:
        length = int(lens[seq])
        k = min_ring_size(length, cap)
        if k > world or 2 * k > length:
            raise InfeasibleError(
                f"zeppelin: sequence {int(seq)} has {length} tokens, more than the whole cluster "
                f"holds ({world} GPUs x tokens_per_gpu={cap}, zigzag shards of {k} ranks); lower "
                f"--max-seq-len to at most {world * cap}, raise tokens_per_gpu, or add GPUs")
    if int(lens.sum()) > cap * world:
        raise InfeasibleError(
            f"zeppelin: the batch has {int(lens.sum())} tokens, more than the cluster holds "
            f"({world} GPUs x tokens_per_gpu={cap} = {world * cap}); lower the batch's token budget")
