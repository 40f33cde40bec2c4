"""What ``pretrain_gpt.py --zeppelin`` checks on the data and the checkpoint folders
before Megatron-LM builds anything (called by :func:`~megatron_zeppelin.integration.args.check_args_before_launch`,
right after the flag checks, on every rank; no process group exists yet).

* the datasets: every ``--data-path`` prefix opens as a Megatron indexed dataset
  (its ``.idx`` well formed, its ``.bin`` as long as the index says), a
  ``--zeppelin-data-lengths`` file matches them, and ``--split`` leaves the
  training split some documents;
* the attention backend ``--zeppelin-backend`` names is installed, TransformerEngine
  under ``--transformer-impl transformer_engine``, and psutil
  when ``--save`` writes ``torch_dist`` checkpoints;
* the batches: the training and validation batches the run will draw each hold at
  least one sequence per micro-batch (``--global-batch-size`` / data-parallel
  size), so no evaluation or epoch end fails hours into the run;
* the checkpoint folders: every shard of a ``--load`` checkpoint is there and as long
  as its index says; the checkpoint drew its batches from the same
  documents, ``--seq-length`` and seed (else its position cannot be continued);
  the checkpoint was saved at this ``--pipeline-model-parallel-size``;
  ``--save`` never overwrites a checkpoint of another run (other data, seed or
  model) unless ``--load`` points there too.

Each problem raises a :class:`~megatron_zeppelin.errors.ConfigError` in
``pretrain_gpt.py``'s own terms.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.integration.args import data_parallel_size, zeppelin_micro_batches
from megatron_zeppelin.integration.data import SPLITS, DocumentBlend, open_blends
from megatron_zeppelin.sampler import batch_budget

#: Most global batches of a split walked for the micro-batch count check (a walk is
#: one searchsorted per batch; this bounds a very long run's start-up).
MAX_BATCHES_CHECKED = 200_000

#: Flags that make a checkpoint another run's when they differ (compared where this run
#: sets them: Megatron's validate_args fills some in after this check).
RUN_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
             "num_experts", "seed", "seq_length")


def check_before_launch(args: argparse.Namespace) -> None:
    """Every data and checkpoint-folder check of a ``--zeppelin`` run; raise ConfigError."""
    blends = open_blends(args.data_path, args.split, args.zeppelin_data_lengths)
    if blends["train"] is None:
        raise ConfigError(f"--split {args.split} gives the training split no document of --data-path "
                          f"{' '.join(args.data_path)}; give it a share, e.g. --split 98,2,0")
    if args.zeppelin_backend != "auto":
        from megatron_zeppelin.attention.backends import get_backend

        get_backend(args.zeppelin_backend)
    check_transformer_impl(args)
    check_batches_fill_micro_batches(args, blends)
    check_checkpoint_writer(args)
    check_checkpoint_files(getattr(args, "load", None), args)
    check_same_pipeline_size(args)
    saved = saved_data_state_on_disk(getattr(args, "load", None), args)
    if saved is not None:
        from megatron_zeppelin.integration.checkpoint import check_same_pieces

        check_same_pieces(saved["sampler"], train_sampler(args, blends["train"]).state_dict())
    check_save_folder(args, blends["train"])


def train_sampler(args: argparse.Namespace, blend: DocumentBlend) -> Any:
    """The training split's sampler as the ranks build it (its order and fingerprint)."""
    seed = args.seed if args.zeppelin_seed is None else args.zeppelin_seed
    return blend.sampler(max_seq_len=args.seq_length, tokens_per_batch=_budget(args), seed=seed)


def _budget(args: argparse.Namespace) -> int:
    dp = data_parallel_size(args) or 1
    return batch_budget(zeppelin_micro_batches(args) * args.zeppelin_tokens_per_gpu, dp, args.seq_length,
                        args.zeppelin_batch_fill)


def evaluation_batches(args: argparse.Namespace) -> int:
    """Validation global batches the run draws (Megatron: ``--eval-iters`` at every
    ``--eval-interval`` and once at the end)."""
    eval_iters = getattr(args, "eval_iters", 0) or 0
    interval, train_iters = getattr(args, "eval_interval", None), getattr(args, "train_iters", None) or 0
    return eval_iters * ((train_iters // interval if interval else 0) + 1)


def check_batches_fill_micro_batches(args: argparse.Namespace, blends: dict[str, DocumentBlend | None]) -> None:
    """Each global batch the run will draw from the training and validation splits
    holds at least one sequence per micro-batch (a global batch is split into
    ``--global-batch-size`` / DP micro-batches; an epoch's last batch can be small)."""
    micro = zeppelin_micro_batches(args)
    if micro == 1:
        return
    seed = args.seed if args.zeppelin_seed is None else args.zeppelin_seed
    wanted = {"train": getattr(args, "train_iters", None) or 0, "valid": evaluation_batches(args)}
    for i, split in enumerate(SPLITS[:2]):
        blend = blends[split]
        if blend is None or not wanted[split]:
            continue
        sampler = blend.sampler(max_seq_len=args.seq_length, tokens_per_batch=_budget(args), seed=seed + i)
        index, epoch = 0, 0
        while index < min(wanted[split], MAX_BATCHES_CHECKED):
            bounds = sampler.batch_bounds(epoch)
            small = [k for k, (begin, end) in enumerate(bounds) if end - begin < micro]
            if small and index + small[0] < wanted[split]:
                begin, end = bounds[small[0]]
                what = "training" if split == "train" else "validation"
                raise ConfigError(
                    f"the {what} split's global batch {index + small[0]} (epoch {epoch}) holds "
                    f"{end - begin} sequence{'s' if end - begin != 1 else ''}, fewer than the {micro} "
                    f"micro-batches per step (--global-batch-size {args.global_batch_size} / data-parallel "
                    f"size {data_parallel_size(args)}); lower --global-batch-size"
                    + (", give the validation split more documents (--split) or pass --eval-iters 0"
                       if split == "valid" else ", lower --train-iters or add documents"))
            index, epoch = index + len(bounds), epoch + 1


def check_transformer_impl(args: argparse.Namespace) -> None:
    """``--transformer-impl transformer_engine`` (Megatron-LM's default) builds Zeppelin's
    layer on TransformerEngine's modules; without TE the layer spec would fail after
    the process groups exist."""
    if getattr(args, "transformer_impl", "transformer_engine") != "transformer_engine":
        return
    try:
        import transformer_engine  # noqa: F401  (the check is the import)
    except ImportError:
        raise ConfigError("--transformer-impl transformer_engine (Megatron-LM's default) needs TransformerEngine, "
                          "which is not installed; install it, or pass --transformer-impl local --normalization "
                          "RMSNorm --no-persist-layer-norm for Megatron-Core's local modules") from None


def check_checkpoint_writer(args: argparse.Namespace) -> None:
    """``--save`` in the ``torch_dist`` format needs psutil: Megatron-Core 0.16.1's
    writer calls it first thing in each forked writer process, outside its error
    handling, so without it the process dies unreported and every rank waits
    forever for it at the first save (a hang, not an error)."""
    if not getattr(args, "save", None) or getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        return
    try:
        import psutil  # noqa: F401  (the check is the import)
    except ImportError:
        raise ConfigError("--save with --ckpt-format torch_dist (the default) needs psutil: Megatron-Core's "
                          "checkpoint writer uses it in its writer processes, and without it every rank "
                          "hangs at the first save; pip install psutil (or megatron-zeppelin[megatron])") from None


def checkpoint_common_args(folder: str | None, args: argparse.Namespace) -> argparse.Namespace | None:
    """The ``args`` a ``torch_dist`` checkpoint in ``folder`` was saved with (its common
    state, read as Megatron's ``load_args_from_checkpoint`` reads it); None
    when the folder holds no checkpoint or one of another format."""
    directory = _checkpoint_directory(folder, args)
    if directory is None:
        return None
    from megatron.training.checkpointing import _load_base_checkpoint

    try:
        state_dict = _load_base_checkpoint(folder, args, rank0=True)[0]
    except Exception as exc:  # noqa: BLE001 -- any unreadable file: name it, in one line
        raise ConfigError(f"{directory}'s common state cannot be read ({type(exc).__name__}: {str(exc)[:160]}): "
                          "the checkpoint is damaged; point --load/--save elsewhere or load an earlier "
                          "iteration (--ckpt-step)") from None
    return (state_dict or {}).get("args")


def check_checkpoint_files(folder: str | None, args: argparse.Namespace) -> None:
    """Every shard file of the ``torch_dist`` checkpoint ``--load`` resumes from is
    there and as long as its index (``.metadata``) says: a missing or truncated
    shard is named here instead of deep in the load on every rank."""
    directory = _checkpoint_directory(folder, args)
    if directory is None:
        return
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 -- any unreadable index: name it, in one line
        raise ConfigError(f"{directory / '.metadata'} cannot be read ({type(exc).__name__}: {str(exc)[:160]}): the "
                          "--load checkpoint is damaged; load an earlier iteration (--ckpt-step) or another "
                          "--load") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        have = (directory / name).stat().st_size if (directory / name).is_file() else None
        if have is None or have < size:
            got = "is missing" if have is None else f"holds {have} bytes"
            raise ConfigError(f"{directory / name} {got}, its index (.metadata) needs {size}: the --load checkpoint "
                              "is damaged (a save that did not finish?); load an earlier iteration (--ckpt-step) "
                              "or another --load")


def _checkpoint_directory(folder: str | None, args: argparse.Namespace) -> Path | None:
    """The iteration directory of the ``torch_dist`` checkpoint in ``folder`` that a
    ``--load`` of it reads (None: none there, or another format)."""
    tracker = Path(folder or "") / "latest_checkpointed_iteration.txt"
    if not folder or getattr(args, "ckpt_step", None) or not tracker.is_file():
        return None
    from megatron.training.checkpointing import get_checkpoint_name, read_metadata

    iteration, release = read_metadata(str(tracker))
    directory = Path(get_checkpoint_name(folder, iteration, release, return_base_dir=True))
    # Megatron-Core 0.16.1 writes the common state (args, iteration) to common.pt; 0.19
    # keeps it inside the torch_dist checkpoint itself (its index, .metadata).
    return directory if (directory / "common.pt").is_file() or (directory / ".metadata").is_file() else None


def check_same_pipeline_size(args: argparse.Namespace) -> None:
    """A ``--load`` checkpoint resumes at the ``--pipeline-model-parallel-size`` it was
    saved at: the same P is what the end-to-end test resumes exactly; another P
    re-splits the layers over other stages, which no test covers under ``--zeppelin``."""
    if getattr(args, "finetune", False):
        return
    theirs = checkpoint_common_args(getattr(args, "load", None), args)
    saved = getattr(theirs, "pipeline_model_parallel_size", None) or 1
    now = getattr(args, "pipeline_model_parallel_size", None) or 1
    if theirs is not None and saved != now:
        raise ConfigError(f"--load {args.load} was saved at --pipeline-model-parallel-size {saved}, this run has "
                          f"{now}: --zeppelin resumes a checkpoint at the pipeline size it was saved at only "
                          f"(another size re-splits the layers over the stages, which is not tested); pass "
                          f"--pipeline-model-parallel-size {saved}")


def saved_data_state_on_disk(folder: str | None, args: argparse.Namespace) -> dict | None:
    """The Zeppelin data state of the ``torch_dist`` checkpoint ``--load`` resumes from
    (None: no such checkpoint, ``--finetune``, or one written without ``--zeppelin``)."""
    if getattr(args, "finetune", False):
        return None
    return getattr(checkpoint_common_args(folder, args), "zeppelin_data_state", None)


def check_save_folder(args: argparse.Namespace, train: DocumentBlend) -> None:
    """``--save`` holding another run's checkpoint (other data, seed or model) is
    refused unless ``--load`` resumes from that folder."""
    save = getattr(args, "save", None)
    if not save or (getattr(args, "load", None) and _same_folder(args.load, save)):
        return
    theirs = checkpoint_common_args(save, args)
    if theirs is None:
        return
    differs = [f"--{name.replace('_', '-')} {getattr(theirs, name, None)} (this run: {getattr(args, name)})"
               for name in RUN_FLAGS
               if getattr(args, name, None) is not None and getattr(theirs, name, None) != getattr(args, name)]
    state = getattr(theirs, "zeppelin_data_state", None)
    if state is not None and state["sampler"].get("datasets") != train_sampler(args, train).state_dict()["datasets"]:
        differs.append("its documents (--data-path / --split)")
    elif state is None and list(getattr(theirs, "data_path", None) or []) != list(args.data_path):
        differs.append(f"--data-path {' '.join(getattr(theirs, 'data_path', None) or [])}")
    if differs:
        raise ConfigError(f"--save {save} holds another run's checkpoint ({'; '.join(differs)}): saving "
                          "there would overwrite it; pass another --save, or --load "
                          f"{save} to continue that run")


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
