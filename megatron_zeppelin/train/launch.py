"""Process launch: spawn simulated GPUs on CPU (gloo), or join torchrun/srun (NCCL).

On a CPU machine the trainer forks ``nodes x gpus_per_node`` children, one per
simulated GPU, after the parent has imported torch and Megatron-Core once (a
fork shares those imports; a fresh interpreter per rank would re-import them).
Every collective has a timeout, and the parent watches the children: when one
fails, the others are terminated and the parent exits non-zero with that
child's error -- a dead peer never leaves the run hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.deadline import CommTimeoutError
from megatron_zeppelin.errors import ConfigError, ZeppelinError
from megatron_zeppelin.resources import check_forkable
from megatron_zeppelin.sampler.batch_sampler import check_piece_memory
from megatron_zeppelin.train.cli import TrainConfig
from megatron_zeppelin.train.divergence import Diverged
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.train.batch import make_token_source
from megatron_zeppelin.train.checkpoint import load_state
from megatron_zeppelin.train.lifetime import die_with_parent, rank_signals, signals_interrupt
from megatron_zeppelin.train.micro import check_micro_batches, make_sampler
from megatron_zeppelin.train.trainer import check_resume, resolve_cluster, run_rank

#: Exit status of a child that failed on a user error (the parent re-raises it).
USER_ERROR = 2
#: Characters of a crashed rank's traceback sent to the parent.
MAX_REPORT = 16000


class ChildFailed(RuntimeError):
    """A spawned rank crashed (not a user error); carries its traceback."""


def launch(cfg: TrainConfig) -> None:
    """Run ``cfg`` under torchrun/srun when their environment is set, else spawn locally."""
    cluster = resolve_cluster(cfg)
    cluster.topology.check_world_size(cfg.world_size)  # preset errors before any fork
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not launched:
        check_forkable(cfg.world_size)
    _, doc_lengths = make_token_source(cfg.lengths, cfg.data, cfg.seed, load_model(cfg.model).vocab_size)
    # Every forked rank builds its own sampler (under torchrun, this process is one rank).
    check_piece_memory(doc_lengths, cfg.max_seq_len, cfg.lengths or cfg.data, copies=1 if launched else cfg.world_size)
    resume = None
    if cfg.load:   # a damaged or mismatched checkpoint is one line before any fork
        path, resume = load_state(Path(cfg.load), torch.device("cpu"))
        check_resume(cfg, load_model(cfg.model).name, path, resume)
        make_sampler(cfg, doc_lengths).load_state_dict(resume["sampler"])
    if cfg.micro_batches > 1:  # every global batch splits, or one line before any process group
        check_micro_batches(cfg, cluster, doc_lengths, resume["sampler"] if resume else None)
    if launched:
        run_launched(cfg)
    else:
        spawn_local(cfg)


def run_launched(cfg: TrainConfig) -> None:
    """One rank of a torchrun/srun job: NCCL on GPUs, gloo otherwise."""
    world = int(os.environ["WORLD_SIZE"])
    if world != cfg.world_size:
        raise ConfigError(f"the launcher started {world} processes but --nodes {cfg.nodes} x "
                          f"--gpus-per-node {cfg.gpus_per_node} = {cfg.world_size}; make them match")
    rank = int(os.environ["RANK"])
    die_with_parent(os.getppid())   # torchrun's agent / srun's step daemon
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % cfg.gpus_per_node)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout_s))
    try:
        run_rank(cfg, rank, world, device)
    finally:
        dist.destroy_process_group()


def spawn_local(cfg: TrainConfig) -> None:
    """Fork one gloo process per simulated GPU and supervise them."""
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    port = _free_port()
    children = [ctx.Process(target=_child, args=(cfg, rank, port, errors, os.getpid()),
                            name=f"zeppelin-rank{rank}") for rank in range(cfg.world_size)]
    try:
        with signals_interrupt():
            for child in children:
                child.start()
            supervise(children, errors)
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
                os.kill(child.pid, signal.SIGCONT)   # a stopped (SIGSTOP) rank acts on SIGTERM only once continued
        for child in children:
            if child.pid is None:
                continue
            child.join(5)
            if child.is_alive():
                child.kill()
                child.join()


def supervise(children: list, errors) -> None:
    """Wait for every child (``children[r]`` is rank ``r``); on the first failure
    raise its error (the caller stops the rest)."""
    running = {c.sentinel: c for c in children}
    while running:
        for sentinel in wait(list(running)):
            child = running.pop(sentinel)
            child.join()
            if child.exitcode != 0:
                _raise_child_error(children.index(child), child, errors)


def _raise_child_error(rank: int, child, errors) -> None:
    reports = {}
    while not errors.empty():
        r, kind, text = errors.get()
        reports.setdefault(r, (kind, text))
    # The first rank to fail is the cause; its peers then fail on closed
    # connections or timeouts, so their reports are only a fallback.
    kind, text = reports.get(rank) or (None, None)
    if kind == "user":
        raise ZeppelinError(text)
    if kind == "crash":
        raise ChildFailed(f"rank {rank} failed:\n{text}")
    if kind == "one-line":
        raise ChildFailed(text)   # one line already naming the rank and the operation, peer or value
    code = child.exitcode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    raise ChildFailed(f"{child.name} {how} without reporting an error; the other ranks were stopped")


#: Process groups inherited from the parent, kept alive for the child's lifetime.
_INHERITED_GROUPS: list = []


def _keep_inherited_groups() -> None:
    """Megatron's ``destroy_model_parallel`` leaves some process groups in
    ``parallel_state`` globals; a fork copies them.  If the child's
    ``initialize_model_parallel`` overwrote them, their destructor would run in
    the child and wait forever on worker threads a fork does not copy.  So the
    child holds on to them (it leaves through ``os._exit``, never destroying them)."""
    from megatron.core import parallel_state

    for name, value in vars(parallel_state).items():
        if isinstance(value, dist.ProcessGroup):
            _INHERITED_GROUPS.append(value)
            setattr(parallel_state, name, None)


def _child(cfg: TrainConfig, rank: int, port: int, errors, parent_pid: int) -> None:
    status = 0
    try:
        rank_signals()
        die_with_parent(parent_pid)
        torch.set_num_threads(1)  # ranks share the machine's cores
        _keep_inherited_groups()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=cfg.world_size, timeout=timedelta(seconds=cfg.timeout_s))
        run_rank(cfg, rank, cfg.world_size, torch.device("cpu"))
        dist.destroy_process_group()
    except ZeppelinError as exc:
        errors.put((rank, "user", str(exc)))
        status = USER_ERROR
    except (CommTimeoutError, Diverged) as exc:
        errors.put((rank, "one-line", str(exc)))
        status = 1
    except BaseException:  # noqa: BLE001 -- everything must reach the parent
        # Bounded: a report larger than the pipe buffer would block until the parent reads.
        errors.put((rank, "crash", traceback.format_exc()[-MAX_REPORT:]))
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip the forked interpreter's atexit/teardown (shared with the parent).
        os._exit(status)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
