"""One rank of the Megatron-LM resume test (run by test_megatron_lm_e2e.py, one process per rank,
inside a patched Megatron-LM core_v0.16.1 tree):

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... \
        python megatron_lm_resume.py DATA CLUSTER STEPS [MEGATRON-LM FLAGS...]

Megatron-LM's own parser and ``validate_args``, the patched ``pretrain_gpt.py`` dataset
provider, and Megatron-LM's own ``load_checkpoint`` (under ``--load``, before the
loaders are built, as ``pretrain()`` orders them) and ``save_checkpoint`` (under
``--save``, after ``STEPS`` iterations) on the model the patched builder makes.  Each
iteration draws its ``--global-batch-size / DP`` micro-batches through
``forward_step``'s ``get_batch``; no model step runs (the pieces are what is tested).

``SAVE_FAULT_RANK=r``: rank r's save raises (a full disk) inside Megatron-LM's
``save_checkpoint``.

Prints on rank 0, per iteration:  PIECES iteration [[dataset, doc, start, end], ...]
(every piece of the iteration's micro-batches, in order), and the loader's own lines.
"""

import json
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.training import checkpointing
from megatron.training.checkpointing import load_checkpoint, save_checkpoint

from megatron_lm_e2e import cuda_means_cpu, megatron_args, tiny_cpu_argv
from megatron_zeppelin import integration as zeppelin
from megatron_zeppelin.integration.args import zeppelin_micro_batches
from megatron_zeppelin.integration.hooks import say_line


def main():
    prefix, cluster, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = sys.argv[4:]
    argv = [*tiny_cpu_argv(), "--use-cpu-initialization", "--data-path", prefix, "--split", "100,0,0",
            "--zeppelin-cluster", cluster, "--zeppelin-backend", "torch", "--ckpt-format", "torch_dist",
            "--no-save-optim", "--no-load-optim", "--no-load-rng", "--eval-iters", "0", *extra]
    sys.argv = ["pretrain_gpt.py", *argv]
    # What the patched script runs before pretrain(): flag, data and checkpoint-folder checks.
    zeppelin.check_args_before_launch(zeppelin.chain_args_providers(None, zeppelin.add_zeppelin_args))
    args = megatron_args(argv)
    init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size, False)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)

    import pretrain_gpt  # the patched script, as a module
    from gpt_builders import gpt_builder
    from model_provider import model_provider

    torch.manual_seed(args.seed)
    model = partial(model_provider, zeppelin.gpt_builder(gpt_builder))(pre_process=True, post_process=True)
    if args.load:
        with cuda_means_cpu():
            args.iteration, _ = load_checkpoint([model], None, None)
    with cuda_means_cpu():  # the provider reads the --load checkpoint's data state (read_metadata)
        train_loader, _, _ = pretrain_gpt.train_valid_test_datasets_provider([1, 1, 1])
    handed_out = []
    record = train_loader.on_batch
    train_loader.on_batch = lambda p, context: (handed_out.append(p), record(p, context))
    data = RerunDataIterator(train_loader)
    first = args.iteration
    for iteration in range(first, first + steps):
        pieces = []
        for _ in range(zeppelin_micro_batches(args)):
            pretrain_gpt.get_batch(data)
            pieces += [[p.dataset, p.doc, p.start, p.end] for p in handed_out[-1].batch.pieces]
        if dist.get_rank() == 0:
            say_line(f"PIECES {iteration} {json.dumps(pieces)}")   # one write: the loader notes from its thread
    if args.save:
        if os.environ.get("SAVE_FAULT_RANK") == str(dist.get_rank()):  # the fault test: this rank's save fails
            def disk_full(*_, **__):
                raise OSError(28, "No space left on device")
            checkpointing.dist_checkpointing.save = disk_full
        with cuda_means_cpu():
            save_checkpoint(first + steps, [model], None, None, 0)
    train_loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":  # Megatron's checkpoint writer spawns processes that import this file
    main()
