"""The engine's schedule, single process: waves are rank-disjoint and in tier
order, every rank issues the *same* rounds (the contract a routed communicator
relies on), and random plans are exact in float64 -- ranks simulated by threads
over an in-memory communicator that checks the round contract strictly."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.attention import AttentionCounter, build_schedule, plan_attention, shard_sequences
from megatron_zeppelin.attention.backends import TorchBackend
from megatron_zeppelin.attention.engine import TIER_ORDER
from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.plan import Mode, placement
from megatron_zeppelin.topology import Topology
from tests.attention.helpers import make_plan, random_plan, random_sequences, reference

TOPOS = [Topology(nodes=2, gpus_per_node=2, nics_per_node=1),
         Topology(nodes=2, gpus_per_node=4, nics_per_node=2),
         Topology(nodes=3, gpus_per_node=2, nics_per_node=2)]


class _Mailbox:
    """Shared by the threads of one simulated world."""

    def __init__(self, world: int) -> None:
        self.box: dict[tuple[int, int], torch.Tensor] = {}
        self.cv = threading.Condition()
        self.rounds: list[list[tuple]] = [[] for _ in range(world)]


class _Pending:
    def __init__(self, mail: _Mailbox, index: int, recvs) -> None:
        self.mail, self.index, self.recvs = mail, index, recvs

    def wait(self) -> None:
        with self.mail.cv:
            for mid, buf in self.recvs.items():
                if not self.mail.cv.wait_for(lambda: (self.index, mid) in self.mail.box, timeout=30):
                    raise TimeoutError(f"round {self.index} message {mid} never sent")
                buf.copy_(self.mail.box[(self.index, mid)])


class ThreadComm:
    """In-memory Communicator; checks that sends/recvs are exactly this rank's
    messages with the declared sizes, and records every round's message list."""

    def __init__(self, mail: _Mailbox, rank: int) -> None:
        self.mail, self.rank, self.counters = mail, rank, ByteCounters()

    def start_round(self, messages, sends, recvs):
        index = len(self.mail.rounds[self.rank])
        self.mail.rounds[self.rank].append(tuple(messages))
        assert len({m.id for m in messages}) == len(messages), "message ids must be unique in a round"
        assert set(sends) == {m.id for m in messages if m.src == self.rank}
        assert set(recvs) == {m.id for m in messages if m.dst == self.rank}
        by_id = {m.id: m for m in messages}
        for mid, t in [*sends.items(), *recvs.items()]:
            assert t.numel() == by_id[mid].numel and t.is_contiguous()
        with self.mail.cv:
            for mid, t in sends.items():
                self.mail.box[(index, mid)] = t.clone()
            self.mail.cv.notify_all()
        return _Pending(self.mail, index, recvs)


def run_world(world: int, fn):
    """``fn(rank, comm)`` on ``world`` threads; returns (results, rounds per rank)."""
    mail, results, errors = _Mailbox(world), [None] * world, []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadComm(mail, rank))
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results, mail.rounds


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(range(len(TOPOS))), st.integers(1, 8))
def test_random_plans_exact_and_collective(seed, topo_index, n_seqs):
    topo = TOPOS[topo_index]
    plan = random_plan(random.Random(seed), topo, n_seqs)
    hq, hk, d = 4, 2, 3
    seqs = random_sequences(plan, hq, hk, d, torch.float64, seed)
    refs = reference(seqs)

    def fn(rank, comm):
        q, k, v, dout = (shard_sequences(plan, rank, [s[i] for s in seqs]) for i in range(4))
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        counter = AttentionCounter()
        out = plan_attention(q, k, v, plan=plan, rank=rank, comm=comm, backend="torch", counter=counter)
        out.backward(dout)
        return (out.detach(), q.grad, k.grad, v.grad), counter

    results, rounds = run_world(plan.world_size, fn)
    assert all(r == rounds[0] for r in rounds), "ranks issued different rounds"
    for rank, (got, counter) in enumerate(results):
        for g, i in zip(got, range(4)):
            torch.testing.assert_close(g, shard_sequences(plan, rank, [r[i] for r in refs]),
                                       atol=1e-10, rtol=1e-10)
        pairs = plan.attn_pairs_per_rank()[rank]
        assert (counter.forward_pairs, counter.backward_pairs) == (pairs, pairs)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(range(len(TOPOS))), st.integers(1, 12))
def test_waves_are_disjoint_and_tier_ordered(seed, topo_index, n_seqs):
    plan = random_plan(random.Random(seed), TOPOS[topo_index], n_seqs)
    cache: dict = {}                                              # a step context's cache
    schedule = build_schedule(plan, 4, 2, 8, cache=cache)
    assert build_schedule(plan, 4, 2, 8, cache=cache) is schedule  # cached on the context
    assert build_schedule(plan, 8, 4, 8, cache=cache) is not schedule  # ...per head shape
    assert build_schedule(plan, 4, 2, 8) is not schedule          # no module-level cache
    seen_jobs, last_tier = [], -1
    for wave in schedule.waves:
        ranks = [r for j in wave.jobs for r in schedule.jobs[j].ranks]
        assert len(ranks) == len(set(ranks)), "jobs of a wave must not share ranks"
        tiers = {TIER_ORDER[plan.tier_of(schedule.jobs[j].placement)] for j in wave.jobs}
        assert len(tiers) == 1 and min(tiers) >= last_tier
        last_tier = min(tiers)
        seen_jobs += wave.jobs
        for backward in (False, True):
            for step, msgs in enumerate(wave.rounds[backward]):
                assert [m.id for m in msgs] == list(range(len(msgs)))
    assert sorted(seen_jobs) == list(range(len(schedule.jobs)))
    # every distributed placement is one job; locals are not
    assert len(schedule.jobs) == sum(p.size > 1 for p in plan.attention)


def test_wrong_token_count_is_rejected():
    plan = random_plan(random.Random(3), TOPOS[0], 4)
    rank = max(range(plan.world_size), key=lambda r: plan.attention_tokens_per_rank()[r])
    n = plan.attention_tokens_per_rank()[rank] + 1
    with pytest.raises(ValueError, match=f"rank {rank} holds {n - 1} tokens"):
        plan_attention(torch.zeros(n, 2, 4), torch.zeros(n, 1, 4), torch.zeros(n, 1, 4), plan=plan,
                       rank=rank, comm=None, backend="torch")


class _Recorder:
    """Wraps a backend and a communicator to log the order of rounds and local work."""

    def __init__(self, inner, log: list[str]) -> None:
        self.inner, self.log = inner, log
        self.name = getattr(inner, "name", "comm")
        self.counters = getattr(inner, "counters", None)

    def varlen_forward(self, q, *args, **kwargs):
        self.log.append(f"local{q.shape[0]}")
        return self.inner.varlen_forward(q, *args, **kwargs)

    def start_round(self, *args):
        pending = self.inner.start_round(*args)
        self.log.append("round")
        log = self.log

        class _Wait:
            def wait(self):
                pending.wait()
                log.append("wait")
        return _Wait()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_local_work_fills_rounds_then_drains_in_one_call():
    spec = [(8, Mode.RING, [0, 1]), (3, Mode.LOCAL, [2]), (4, Mode.LOCAL, [2]), (5, Mode.LOCAL, [2]),
            (6, Mode.LOCAL, [0])]
    plan = make_plan(4, 2, [L for L, _, _ in spec], [placement(i, L, m, r) for i, (L, m, r) in enumerate(spec)])
    logs = [[] for _ in range(4)]

    def fn(rank, comm):
        n = plan.attention_tokens_per_rank()[rank]
        q, kv = torch.randn(n, 2, 4), torch.randn(n, 1, 4)
        plan_attention(q, kv, kv, plan=plan, rank=rank, comm=_Recorder(comm, logs[rank]),
                       backend=_Recorder(TorchBackend(), logs[rank]))

    run_world(4, fn)
    # the ring [0, 1] has one forward round: idle rank 2 computes its first local
    # sequence during it and the other two in one packed call (4 + 5 rows)
    assert logs[2] == ["round", "local3", "wait", "local9"]
    assert logs[0] == ["round", "wait", "local6"]           # busy with the ring: locals after
    assert logs[3] == ["round", "wait"]                     # no tokens, still in every round
