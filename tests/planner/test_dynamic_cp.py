"""Megatron-LM dev's dynamic CP (``megatron_dynamic_cp``) and its ``dp_balanced`` baseline."""

from __future__ import annotations

import ast
import functools
import math
import os
import pathlib
import random
import types
from typing import Dict, List, Optional, Tuple

import pytest

from megatron_zeppelin.errors import InfeasibleError
from megatron_zeppelin.plan import Mode
from megatron_zeppelin.planner.base import get_planner
from megatron_zeppelin.planner.dp_balanced import dp_balanced_packs
from megatron_zeppelin.planner.dynamic_cp import WORKLOAD_CAP_DELTA, dynamic_cp_micro_batches
from tests.planner.test_baselines import make_ctx


def groups(micro_batches):
    return [[(g.first_rank, g.size, g.seqs) for g in mb] for mb in micro_batches]


def test_dynamic_cp_hand_example():
    """World 4, 4 tokens per rank, lengths 8 6 3 3 2 1, worked by hand from
    ``next_hdp_group_packing_aware``.  Micro-batch 1 (limit 8*4*1.05): 8 opens a
    group of 2 (work 32, 4 tokens per rank); 6 cannot join it (4 + 3 > 4) and opens
    the other 2 (work 18); both 3s fit nowhere (no free rank, both groups over 4
    tokens with 1.5 more) and wait; 2 joins the second group (3 + 1 = 4 tokens,
    work 20); 1 waits.  Micro-batch 2 (limit 3*4*1.05): 3 opens a group of 1
    (work 9); the other 3 opens another (joining would hold 6 tokens); 1 could
    join either (busiest 10) but a new group keeps the busiest at 9; the idle
    fourth rank is filled by doubling the first smallest group."""
    mbs = dynamic_cp_micro_batches([8, 3, 3, 2, 6, 1], 4, 4)
    assert groups(mbs) == [[(0, 2, [0]), (2, 2, [4, 3])],
                           [(0, 2, [1]), (2, 1, [2]), (3, 1, [5])]]
    assert [g.load for g in mbs[1]] == [4.5, 9.0, 1.0]


def test_dynamic_cp_falls_back_to_the_whole_world():
    """World 7 (not a power of two), cap 256, lengths 228 and 34: each opens a group of
    one (34 cannot join 228: 262 tokens); filling the 5 idle ranks doubles 228's group
    to 2, 34's to 2, 228's to 4; 34's cannot reach 4 (ranks 4-7 pass the last rank),
    so the micro-batch becomes one group of all 7 ranks holding both
    (``fill_with_full_dpxcp_group``)."""
    [[g]] = dynamic_cp_micro_batches([228, 34], 256, 7)
    assert (g.first_rank, g.size, g.seqs) == (0, 7, [0, 1])


def test_dynamic_cp_plans_cover_exactly_and_hold_the_cap():
    """Random batches: every sequence in exactly one micro-batch, every rank in
    exactly one power-of-two aligned group per micro-batch, a group's tokens per
    rank (Megatron's ``sum(L / cp)``) within the cap, every rank's work within
    ``tallest * cap * 1.05`` unless the micro-batch is one sequence, and the
    plans valid rings over those groups."""
    for trial in range(60):
        rng = random.Random(trial)
        world, cap = rng.choice([1, 2, 4, 8]), rng.choice([16, 64])
        lens = [max(1, int((cap * world) ** rng.random())) for _ in range(rng.randint(1, 30))]
        mbs = dynamic_cp_micro_batches(lens, cap, world)
        assert sorted(s for mb in mbs for g in mb for s in g.seqs) == list(range(len(lens)))
        for mb in mbs:
            assert sorted(r for g in mb for r in range(g.first_rank, g.first_rank + g.size)) == list(range(world))
            tallest = max(lens[s] for g in mb for s in g.seqs)
            for g in mb:
                assert g.size & (g.size - 1) == 0 and g.first_rank % g.size == 0
                assert sum(lens[s] / g.size for s in g.seqs) <= cap + 1e-9
                if len(g.seqs) > 1 and g.size < world:
                    assert sum(lens[s] ** 2 / g.size for s in g.seqs) <= tallest * cap * (1 + WORKLOAD_CAP_DELTA)
        rp = get_planner("megatron_dynamic_cp").plan_rounds(lens, make_ctx(1, world, cap))
        assert len(rp.rounds) == len(mbs) and rp.merged.seq_lens == tuple(lens)
        for plan, mb in zip(rp.rounds, mbs):
            plan.validate()
            by_seq = {s: g for g in mb for s in g.seqs}
            for p, seq in zip(plan.attention, [s for g in mb for s in g.seqs]):
                g = by_seq[seq]
                want = tuple(range(g.first_rank, g.first_rank + g.size))
                assert p.ranks == want if p.mode is Mode.RING else p.ranks == (g.first_rank,)


def test_dynamic_cp_refuses_a_sequence_over_the_world():
    with pytest.raises(InfeasibleError, match="megatron_dynamic_cp: sequence 1 .* needs 8 ranks"):
        get_planner("megatron_dynamic_cp").plan([10, 700], make_ctx(1, 4, 100))


def _megatron_dev(file: str, names: set[str], inside: str | None = None) -> dict:
    """Functions and constants ``names`` (methods of class ``inside``) compiled from
    a Megatron-LM dev checkout (``MEGATRON_LM_DEV_DIR``; never part of this repository)."""
    root = os.environ.get("MEGATRON_LM_DEV_DIR")
    path = pathlib.Path(root or "/nonexistent") / "megatron/core/datasets" / file
    if not path.exists():
        pytest.skip("MEGATRON_LM_DEV_DIR does not hold a Megatron-LM dev checkout with dynamic CP")
    tree = ast.parse(path.read_text())
    if inside is not None:
        tree = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == inside)
    body = [n for n in tree.body if getattr(n, "name", None) in names or
            any(getattr(t, "id", None) in names for t in getattr(n, "targets", []))]
    ns = {"ceil": math.ceil, "log2": math.log2, "lru_cache": functools.lru_cache, "List": List, "Tuple": Tuple,
          "Dict": Dict, "Optional": Optional}
    exec(compile(ast.Module(body, []), str(path), "exec"), ns)
    return ns


def test_dynamic_cp_matches_megatron_dev_scheduler():
    ns = _megatron_dev("data_schedule_utils.py",
                       {"next_hdp_group_packing_aware", "dcp_gpus_needed", "_DYNAMIC_CP_WORKLOAD_CAP_DELTA"})
    assert ns["_DYNAMIC_CP_WORKLOAD_CAP_DELTA"] == WORKLOAD_CAP_DELTA
    for trial in range(400):
        rng = random.Random(trial)
        # Powers of two, and worlds where filling idle ranks can fail (the whole-world
        # fallback) or overrun the last rank (Megatron raises; we refuse).
        world, cap = rng.choice([1, 2, 4, 8, 16, 6, 7, 12]), rng.choice([64, 256])
        lens = [max(1, int((cap * min(world, 4)) ** rng.random())) if rng.random() < 0.5 else rng.randint(1, cap)
                for _ in range(rng.randint(1, 40))]
        samples, want = sorted(enumerate(lens), key=lambda s: s[1], reverse=True), []
        try:
            while samples:
                _, samples, _, per_rank = ns["next_hdp_group_packing_aware"](samples, world, cap)
                want.append(sorted({(per_rank.count(ids), tuple(ids)) for ids in per_rank}))
        except IndexError:
            with pytest.raises(InfeasibleError, match="power of two"):
                dynamic_cp_micro_batches(lens, cap, world)
            continue
        got = [sorted((g.size, tuple(g.seqs)) for g in mb) for mb in dynamic_cp_micro_batches(lens, cap, world)]
        assert got == want, (world, cap, lens)


def test_dp_balanced_hand_example():
    """Lengths 5 3 4 2 6 1 1, packs of 2 x 4 tokens, 2 DP replicas: in order
    [5 3] [4 2] [6 1 1]; three packs are not a multiple of 2, so the last pack's
    last sequence moves to a pack of its own."""
    assert dp_balanced_packs([5, 3, 4, 2, 6, 1, 1], 8, 2) == [[0, 1], [2, 3], [4, 5], [6]]
    rp = get_planner("megatron_dp_balanced").plan_rounds([5, 3, 4, 2, 6, 1, 1], make_ctx(1, 4, 4, cp_size=2))
    # Replica 0 = ranks 0-1, replica 1 = ranks 2-3; a sequence under 2 x 2 tokens
    # cannot be cut in 4 chunks and runs on its replica's least-loaded rank
    # (5 leaves rank 0 with 3 tokens and rank 1 with 2).
    assert [[(p.seq, p.ranks) for p in r.attention] for r in rp.rounds] == [
        [(0, (0, 1)), (1, (1,)), (2, (2, 3)), (3, (2,))],
        [(0, (0, 1)), (1, (0,)), (2, (2,))]]


def test_dp_balanced_matches_megatron_dev_scheduler():
    scheduler = _megatron_dev("data_schedule.py", {"get_groups_and_subsamples"}, "DpBalancedScheduler")
    tree_fn = scheduler["get_groups_and_subsamples"]
    for trial in range(200):
        rng = random.Random(trial)
        cp, dp, cap = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([16, 64])
        lens = [rng.randint(1, cp * cap) for _ in range(rng.randint(dp, 30))]
        this = types.SimpleNamespace(max_seq_len_all_ranks=cp * cap, max_num_seqs=None, dp_size=dp, cp_size=cp,
                                     microbatch_group_size_per_vp_stage=None)
        try:
            want = tree_fn(this, list(enumerate(lens)))
        except AssertionError:   # too few sequences to fill every replica
            with pytest.raises(InfeasibleError):
                dp_balanced_packs(lens, cp * cap, dp)
            continue
        packs = dp_balanced_packs(lens, cp * cap, dp)
        assert [[packs[i * dp + r // cp] for r in range(cp * dp)] for i in range(len(packs) // dp)] == want
