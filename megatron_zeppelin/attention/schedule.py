"""Communication schedule of a Plan's attention, identical on every rank.

Rounds are collective over the world (``comm/base.py``), so every rank must
issue the same rounds in the same order with the same global message lists --
also ranks that take no part in a transfer (a routed communicator uses them as
proxies).  The engine therefore derives the whole schedule from the Plan alone:

* every ring / Ulysses placement is a *job* with a fixed number of steps and, per
  step, a list of :class:`Link` s (its messages, known to every rank);
* jobs are packed into *waves* of jobs with disjoint rank sets (inter-node rings
  first, then intra-node rings, then Ulysses groups, each first-fit), and the
  ``s``-th step of every job of a wave shares one round;
* a rank's part of a job is a generator (:data:`JobSteps`) that yields an
  :class:`Exchange` (its tensors for the step's round), then :data:`COMPUTE_DONE`
  after the step's compute, and resumes after the round has landed.

The executor (:func:`run_waves`) starts each round, lets every job compute its
step, fills rounds in which the rank has nothing to compute with local work,
and waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator, Protocol, Sequence

import torch

from megatron_zeppelin.comm.base import Communicator, Message


@dataclass(frozen=True)
class Link:
    """One message of a job's step, before it gets its id in the round."""

    src: int
    """Sending global rank."""
    dst: int
    """Receiving global rank."""
    numel: int
    """Elements sent."""
    itemsize: int
    """Bytes per element (K/V in the data dtype, dK/dV in the accumulation dtype)."""


@dataclass
class Exchange:
    """A rank's tensors for one step of one job, keyed by index into the step's links."""

    sends: dict[int, torch.Tensor] = field(default_factory=dict)
    """Link index -> contiguous tensor this rank sends."""
    recvs: dict[int, torch.Tensor] = field(default_factory=dict)
    """Link index -> contiguous buffer this rank receives into."""
    computes: bool = True
    """Whether the step computes anything while its round is in flight; when no
    job of the rank does, the executor fills the round with local work."""


COMPUTE_DONE = None
"""What a job generator yields after a step's compute (the executor then waits)."""

JobSteps = Generator[Exchange | None, None, object]
"""A rank's part of a job: per step ``yield Exchange`` then ``yield COMPUTE_DONE``;
returns its result."""


class Job(Protocol):
    """A distributed placement (ring or Ulysses), as every rank sees it."""

    ranks: tuple[int, ...]

    def num_steps(self, backward: bool) -> int: ...

    def links(self, step: int, backward: bool) -> list[Link]: ...


@dataclass(frozen=True)
class Wave:
    """Jobs with disjoint rank sets whose steps share rounds."""

    jobs: tuple[int, ...]
    """Indices into ``Schedule.jobs``."""
    rounds: tuple[tuple[tuple[Message, ...], ...], ...]
    """``rounds[backward][step]``: the global message list of that step's round."""
    offsets: tuple[tuple[tuple[int, ...], ...], ...]
    """``offsets[backward][step][i]``: id of job ``jobs[i]``'s first link in that round."""
    job_steps: tuple[tuple[int, ...], ...]
    """``job_steps[backward][i]``: steps of job ``jobs[i]`` (a wave lasts the longest)."""

    def steps(self, backward: bool) -> int:
        return len(self.rounds[backward])


def build_waves(jobs: Sequence[Job], tiers: Sequence[int]) -> tuple[Wave, ...]:
    """Pack jobs into waves: tiers in increasing order, first-fit on disjoint rank
    sets within a tier (so every rank meets its jobs in plan order per tier)."""
    groups: list[tuple[int, list[int], set[int]]] = []     # (tier, job ids, busy ranks)
    for tier in sorted(set(tiers)):
        first = len(groups)
        for j, job in enumerate(jobs):
            if tiers[j] != tier:
                continue
            for _, members, busy in groups[first:]:
                if busy.isdisjoint(job.ranks):
                    members.append(j)
                    busy.update(job.ranks)
                    break
            else:
                groups.append((tier, [j], set(job.ranks)))
    return tuple(_wave([jobs[j] for j in members], members) for _, members, _ in groups)


def _wave(jobs: list[Job], ids: list[int]) -> Wave:
    rounds, offsets, job_steps = [], [], []
    for backward in (False, True):
        job_steps.append(tuple(job.num_steps(backward) for job in jobs))
        steps = max(job_steps[-1])
        per_step_msgs, per_step_offsets = [], []
        for step in range(steps):
            msgs: list[Message] = []
            starts = []
            for job in jobs:
                starts.append(len(msgs))
                if step < job.num_steps(backward):
                    msgs.extend(Message(len(msgs), ln.src, ln.dst, ln.numel, ln.itemsize)
                                for ln in job.links(step, backward))
            per_step_msgs.append(tuple(msgs))
            per_step_offsets.append(tuple(starts))
        rounds.append(tuple(per_step_msgs))
        offsets.append(tuple(per_step_offsets))
    return Wave(tuple(ids), tuple(rounds), tuple(offsets), tuple(job_steps))


def run_waves(waves: Sequence[Wave], backward: bool, comm: Communicator,
              my_jobs: dict[int, Callable[[], JobSteps]], fill: Callable[[], None]) -> dict[int, object]:
    """Run every wave on this rank; return ``{job id: result}`` of this rank's jobs.

    ``my_jobs`` maps the ids of this rank's jobs to generator factories; ``fill()``
    runs one piece of local work, if any is left, and is called while a round is in flight and no job of the rank computes in that step."""
    results: dict[int, object] = {}
    for wave in waves:
        running = {i: my_jobs[j]() for i, j in enumerate(wave.jobs) if j in my_jobs}
        for step in range(wave.steps(backward)):
            messages = wave.rounds[backward][step]
            active = {i: gen for i, gen in running.items()
                      if step < wave.job_steps[backward][i]}
            sends: dict[int, torch.Tensor] = {}
            recvs: dict[int, torch.Tensor] = {}
            busy = False
            for i, gen in active.items():
                exchange = next(gen)
                busy |= exchange.computes
                base = wave.offsets[backward][step][i]
                sends.update((base + k, t) for k, t in exchange.sends.items())
                recvs.update((base + k, t) for k, t in exchange.recvs.items())
            pending = comm.start_round(messages, sends, recvs) if messages else None
            for gen in active.values():
                next(gen)                                   # the step's compute
            if pending is not None:
                if not busy:
                    fill()
                pending.wait()
            for i in [i for i in active if step + 1 == wave.job_steps[backward][i]]:
                results[wave.jobs[i]] = _finish(running.pop(i))
    return results


def _finish(gen: JobSteps) -> object:
    try:
        next(gen)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("job generator yielded past its last step")
