"""One rank of the end-to-end Megatron-LM test (run by test_megatron_lm_e2e.py, one process per
rank, inside a patched Megatron-LM core_v0.16.1 or core_v0.19.0 tree):

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... \
        python megatron_lm_e2e.py DATA CLUSTER CKPT STEPS MODEL [MEGATRON-LM FLAGS...]

Megatron-LM's own parser, ``gpt_builder``/``model_provider`` and the patched
``pretrain_gpt.py`` (dataset provider, ``forward_step``, ``loss_func``) train ``STEPS``
global batches with ``--zeppelin-remap on --zeppelin-decide off`` (every batch
remaps) on gloo ranks (Megatron-LM's loop itself
needs CUDA; its per-step calls run here), the ``tiny-cpu`` preset's flags plus the
extra flags given (e.g. ``--tensor-model-parallel-size 2 --sequence-parallel``, or
``--num-experts 4 ...``, with ``--expert-model-parallel-size 2``).  Beside it, the project's trainer
(``train.trainer.train_step``, ``--strategy reference``: plain data parallelism at the
same TP/SP/EP) trains a copy of the same weights (``MODEL``: the project's preset of the
same shape) on the same global batches.  Half way, the Megatron model is
saved with Megatron-Core's ``torch_dist`` format (what ``--ckpt-format torch_dist``
writes), loaded into a freshly built model, and training continues from there.

Prints per step on rank 0:  STEP k megatron_loss trainer_loss attention_max/mean linear_max/mean
(linear: the rows the first layer's MLP or router saw on each rank; under
``--sequence-parallel`` each TP rank's share of its data-parallel rank's rows)
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import _set_timers, set_args

from megatron_zeppelin import integration as zeppelin
from megatron_zeppelin.attention.backends import TorchBackend
from megatron_zeppelin.integration.args import megatron_core_version, zeppelin_micro_batches
from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.cost.model import DEFAULT_RING_GRAD_DTYPE
from megatron_zeppelin.megatron import build_gpt_model
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.sampler import GlobalBatch
from megatron_zeppelin.topology import load_cluster
from megatron_zeppelin.train.batch import num_label_tokens, padded_length
from megatron_zeppelin.train.reference import reference_plan
from megatron_zeppelin.step_context import RemapCounters
from megatron_zeppelin.train.micro import MicroBatch
from megatron_zeppelin.train.trainer import Run, allreduce_grads, train_step


def build_megatron_model(seed):
    """This stage's model as the patched pretrain_gpt.py builds it: at core_v0.16.1 through
    ``model_provider`` and the wrapped ``gpt_builder``; at core_v0.19.0 from the
    ``GPTModelConfig`` of Zeppelin's class (``gpt_config_from_args``) and its builder."""
    stage = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                 post_process=parallel_state.is_pipeline_last_stage())
    torch.manual_seed(seed)  # CPU initialisation draws from torch's default generator: same on every rank
    if megatron_core_version() >= (0, 19):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training import get_args
        from megatron.training.argument_utils import gpt_config_from_args

        from megatron_zeppelin.integration.hooks import ZeppelinGPTModelBuilder

        config = gpt_config_from_args(get_args(), model_config_cls=zeppelin.gpt_model_config_cls())
        return ZeppelinGPTModelBuilder(config).build_model(ProcessGroupCollection.use_mpu_process_groups(), **stage)
    from gpt_builders import gpt_builder
    from model_provider import model_provider

    return partial(model_provider, zeppelin.gpt_builder(gpt_builder))(**stage)


@contextlib.contextmanager
def cuda_means_cpu():
    """Megatron-Core's torch_dist writer and reader and Megatron-LM's checkpointing call
    torch.cuda.synchronize(), current_device() and get_rng_state() unconditionally and
    all-reduce the iteration as a CUDA tensor (``read_metadata``); on a CPU-only torch
    they mean "the CPU"."""
    names = ("synchronize", "current_device", "get_rng_state")
    saved, tensor = [getattr(torch.cuda, n) for n in names], torch.tensor
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.tensor = lambda *a, device=None, **k: tensor(*a, **k)
    try:
        yield
    finally:
        for n, f in zip(names, saved):
            setattr(torch.cuda, n, f)
        torch.tensor = tensor


def megatron_args(argv):
    """Megatron-LM's parse_args and validate_args on ``pretrain_gpt.py ARGV`` (with the
    --zeppelin-* flags), set as Megatron's global args; tokenizer building skipped."""
    sys.argv = ["pretrain_gpt.py", *argv]
    torch.set_num_threads(1)
    args = parse_args(zeppelin.chain_args_providers(None, zeppelin.add_zeppelin_args))
    # With TP > 1 validate_args asks the GPU's architecture (Hopper and older need
    # CUDA_DEVICE_MAX_CONNECTIONS=1); a CPU has none: answer as a Hopper with that set.
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    with mock.patch("megatron.training.arguments.get_device_arch_version", lambda: 9):
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    args.padded_vocab_size = 384  # what Megatron pads NullTokenizer's 257 to (tokenizer building skipped)
    args.iteration, args.consumed_valid_samples = 0, 0
    set_args(args)
    _set_timers(args)
    return args


def tiny_cpu_argv():
    """The tiny-cpu preset's Megatron-LM flags."""
    return subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", "tiny-cpu", "--print-args",
                           "--only", "megatron"], capture_output=True, text=True, check=True).stdout.split()


def ratio(values):
    return max(values) / (sum(values) / len(values))


def csv(values):
    return ",".join(map(str, values))


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def reference_run(args, rank, world, dp, cluster, model_cfg, reference, blend):
    """The project's trainer (``--strategy reference``: plain data parallelism at the same
    TP/SP/EP/PP) on ``reference``, a copy of the Megatron model's weights."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cfg = SimpleNamespace(strategy="reference", dump_plans=None, dump_trace=None, tp=tp, pp=pp,
                          sequence_parallel=args.sequence_parallel, timeout_s=300.0, lr=1e-3,
                          max_seq_len=args.seq_length,
                          # plain data parallelism sends no ring messages; the trainer's run reads it
                          engine_ring_grad_dtype=DEFAULT_RING_GRAD_DTYPE)
    return Run(cfg=cfg, rank=rank, world_size=world, dp_rank=rank % (world // pp) // tp, device=torch.device("cpu"),
               cluster=load_cluster(cluster), model_cfg=model_cfg, model=reference,
               optimizer=torch.optim.Adam(reference.parameters(), lr=1e-3), sampler=None,
               make_plan=lambda lens: reference_plan(lens, dp, dp), split=None, comm=None,
               counters=ByteCounters(), remap_counters=RemapCounters(), backend=TorchBackend(),
               source=blend, remap=False,
               # The order 1F1B runs a global batch's micro-batches in changes only the
               # summation order of gradients: keep the loader's.
               modeled_s=lambda plan: 0.0)


def main():
    prefix, cluster, ckpt_dir, steps, model_name = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    extra = sys.argv[6:]
    args = megatron_args([
        *tiny_cpu_argv(), "--use-cpu-initialization", "--global-batch-size", "2",
        "--data-path", prefix, "--split", "100,0,0", "--zeppelin-cluster", cluster,
        "--zeppelin-tokens-per-gpu", "1000", "--zeppelin-batch-fill", "0.7", "--zeppelin-backend", "torch",
        # Every batch remaps (the default; the per-batch decision would drop the remap
        # on this cluster, whose links are slow so that every document stays on one rank).
        "--zeppelin-remap", "on", "--zeppelin-decide", "off",
        "--zeppelin-log-interval", "1", *extra])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, sp, ep = args.tensor_model_parallel_size, args.sequence_parallel, args.expert_model_parallel_size
    pp = args.pipeline_model_parallel_size
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             pipeline_model_parallel_size=pp)
    dp, dp_group = world // (tp * pp), parallel_state.get_data_parallel_group()
    if pp > 1:
        return pipelined(args, rank, world, tp, pp, dp, cluster=cluster, steps=steps,
                         model_name=model_name, ckpt_dir=ckpt_dir)

    import pretrain_gpt  # the patched script, as a module

    model = build_megatron_model(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    # The project's trainer on the same weights: plain data parallelism (the oracle).
    model_cfg = dataclasses.replace(load_model(model_name), vocab_size=args.padded_vocab_size,
                                    expert_parallel_size=ep)
    reference = build_gpt_model(model_cfg, max_seq_len=args.seq_length, tp=tp, sequence_parallel=sp)
    reference.load_state_dict(model.state_dict())  # strict: the same parameters, name by name
    train_loader, _, _ = pretrain_gpt.train_valid_test_datasets_provider([1, 1, 1])
    handed_out = []
    log_batch = train_loader.on_batch
    train_loader.on_batch = lambda p, context: (handed_out.append(p), log_batch(p, context))
    run = reference_run(args, rank, world, dp, cluster, model_cfg, reference, train_loader.blend)

    mlp_rows = []  # what the first MLP's first linear layer (MoE: its router) saw on this rank, step by step

    def watch_mlp(m):
        mlp = m.decoder.layers[0].mlp
        first = mlp.router if args.num_experts else mlp.linear_fc1
        first.register_forward_pre_hook(lambda mod, inp: mlp_rows.append(inp[0].shape[0]))

    watch_mlp(model)
    if args.num_experts and rank == 0:
        mlp = model.decoder.layers[0].mlp
        print(f"MOE local_experts={mlp.num_local_experts} dispatcher={type(mlp.token_dispatcher).__name__}", flush=True)
    data = RerunDataIterator(train_loader)
    for step in range(steps):
        if step == steps // 2:
            # --ckpt-format torch_dist: Megatron-Core's distributed checkpoint of the model's
            # sharded state dict (the call that raised on ZeppelinRemap before), then a fresh
            # model built the same way loads it and training continues from it.
            with cuda_means_cpu():
                dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
            loaded = build_megatron_model(args.seed + 1)
            with cuda_means_cpu():
                loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), ckpt_dir))
            for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values()):
                assert not isinstance(want, torch.Tensor) or torch.equal(got, want), name
            state = optimizer.state_dict()
            model, optimizer = loaded, torch.optim.Adam(loaded.parameters(), lr=1e-3)
            optimizer.load_state_dict(state)
            watch_mlp(model)
            if rank == 0:
                print(f"RESUMED torch_dist {ckpt_dir}", flush=True)
        output, loss_func = pretrain_gpt.forward_step(data, model)
        loss, num_tokens, _ = loss_func(output)
        prepared = handed_out[-1]
        label_count = num_label_tokens(prepared.batch.seq_lens)
        (loss / label_count).backward()
        allreduce_grads(model, sp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)  # the TP ranks of a group hold the same loss
        batch = GlobalBatch(prepared.batch.index, prepared.batch.epoch,
                            tuple(train_loader.blend.blend_pieces(prepared.batch.pieces)))
        micro = MicroBatch(batch, 0, 1, batch.pieces, run.make_plan(batch.seq_lens), {})
        record = train_step(run, iter([micro]))
        attention_rows = gather(prepared.data.tokens.numel() - prepared.data.pad_tokens)
        linear_rows = gather(mlp_rows[-1])
        if rank == 0:
            print(f"STEP {step} {float(total) / label_count:.8f} {record.loss:.8f} {ratio(attention_rows):.4f} "
                  f"{ratio(linear_rows):.4f} linear={csv(linear_rows)} plan_linear={csv(prepared.plan.linear_tokens_per_rank())}",
                  flush=True)
    next(data)  # hands out one more batch: the last step's zeppelin log line (with remap_bytes) prints now
    train_loader.close()
    dist.destroy_process_group()


def pipelined(args, rank, world, tp, pp, dp, *, cluster, steps, model_name, ckpt_dir):
    """``--pipeline-model-parallel-size P``: each global batch through Megatron-Core's 1F1B
    schedule with the patched ``forward_step``; beside it the trainer's reference at the
    same PP (``train.pipeline``) on the same micro-batches.  Under
    ``--zeppelin-log-interval``, the schedule calls the ``finalize_model_grads`` the
    provider wrapped, as Megatron-LM's ``train()`` sets it.  Half way, Megatron-LM's own
    ``save_checkpoint`` (``torch_dist``, each stage its layers) writes the model and the
    Zeppelin data state to ``CKPT``; a fresh model loads it with ``load_checkpoint``, the
    patched provider builds new loaders from it, and training goes on (the optimizer's
    state is carried in memory: this driver's Adam is not Megatron's).  Prints per step
    on rank 0: STEP k megatron_loss trainer_loss batch=<global batch index> rows=<...>; at
    the end REMAP {batch index: bytes every rank's remapping layers counted}."""
    import pretrain_gpt
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training import training

    from megatron_zeppelin.train.parallel import allreduce_gradients

    model = build_megatron_model(args.seed)
    assert model.config.variable_seq_lengths and model.config.calculate_per_token_loss
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model_cfg = dataclasses.replace(load_model(model_name), vocab_size=args.padded_vocab_size,
                                    num_layers=args.num_layers, expert_parallel_size=args.expert_model_parallel_size)
    sp = args.sequence_parallel
    reference = build_gpt_model(model_cfg, max_seq_len=args.seq_length, tp=tp, sequence_parallel=sp, pp=pp)
    if args.num_experts and rank == 0:
        mlp = model.decoder.layers[0].mlp
        print(f"MOE local_experts={mlp.num_local_experts} dispatcher={type(mlp.token_dispatcher).__name__}", flush=True)
    rows = []  # the hidden states' rows this stage's first layer got, micro-batch by micro-batch
    watch_first_layer(model, rows)
    reference.load_state_dict(model.state_dict())  # this stage's parameters, name by name
    handed_out, contexts = [], []
    # Megatron-LM's train() hands training.finalize_model_grads (read after the loaders
    # are built, which may wrap it) to the schedule, which calls it after the last
    # backward; this driver all-reduces the gradients itself after the schedule.
    training.finalize_model_grads = lambda *a, **k: None
    train_loader = watched_loader(pretrain_gpt, handed_out, contexts)
    model.config.finalize_model_grads_func = training.finalize_model_grads
    run = reference_run(args, rank, world, dp, cluster, model_cfg, reference, train_loader.blend)
    micro = zeppelin_micro_batches(args)
    data = RerunDataIterator(train_loader)
    expected = None  # after the resume: the pieces the uninterrupted loader would have handed out
    for step in range(steps):
        if step == steps // 2:
            model, optimizer, train_loader, expected = resume_stage(args, step, model, optimizer, train_loader,
                                                                    micro, pretrain_gpt, handed_out, contexts)
            model.config.finalize_model_grads_func = training.finalize_model_grads
            watch_first_layer(model, rows)
            data = RerunDataIterator(train_loader)
            if rank == 0:
                print(f"RESUMED torch_dist {ckpt_dir} at iteration {step}", flush=True)
        first_seen = len(handed_out)
        stored = get_forward_backward_func()(
            forward_step_func=pretrain_gpt.forward_step, data_iterator=data, model=[model], num_microbatches=micro,
            seq_length=args.seq_length, micro_batch_size=1, forward_only=False)
        parts = handed_out[first_seen:first_seen + micro]
        assert len(parts) == micro and len({p.batch.index for p in parts}) == 1
        if expected is not None:
            assert [tuple(p.batch.pieces) for p in parts] == expected, "the resume skipped or repeated pieces"
            expected = None
        # Each micro-batch's boundary shape is this rank's token count in its Plan (under
        # sequence parallelism padded to a multiple of TP and split over it); only the
        # first and last stages read tokens.
        split = tp if sp else 1
        held = [padded_length(sum(s.length for s in p.plan.attention_spans(run.dp_rank)), split) // split
                for p in parts]
        assert rows[-micro:] == held, (rows[-micro:], held)
        reads = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
        assert all((p.data is not None) == reads for p in parts)
        pieces = [piece for p in parts for piece in train_loader.blend.blend_pieces(p.batch.pieces)]
        batch = GlobalBatch(parts[0].batch.index, parts[0].batch.epoch, tuple(pieces))
        label_count = num_label_tokens(batch.seq_lens)
        for param in model.parameters():
            param.grad /= label_count  # calculate_per_token_loss: the schedule summed token losses
        allreduce_gradients(model, sp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        # The last stage's data-parallel ranks hold the loss (its TP ranks the same one), every other rank none.
        loss = torch.tensor(sum(float(d["lm loss"][0]) for d in stored) if rank % tp == 0 else 0.0,
                            dtype=torch.float64)
        dist.all_reduce(loss)
        micros, at = [], 0
        for i, p in enumerate(parts):
            own = tuple(pieces[at:at + len(p.batch.pieces)])
            at += len(own)
            micros.append(MicroBatch(batch, i, micro, own, reference_plan(GlobalBatch(0, 0, own).seq_lens, dp, dp), {}))
        record = train_step(run, iter(micros))
        shapes = gather(held)
        if rank == 0:
            print(f"STEP {step} {float(loss) / label_count:.8f} {record.loss:.8f} batch={batch.index} "
                  f"rows={json.dumps(shapes)}", flush=True)
    next(data)  # hands out one more micro-batch: the last step's zeppelin log line prints now
    # What the remapping layers of every rank counted, per global batch (the log lines' remap_bytes).
    counted = {}
    for index, context in contexts:
        counted[index] = counted.get(index, 0) + context.remap_counters.total
    totals = {}
    for counts in gather(counted):
        for index, n in counts.items():
            totals[index] = totals.get(index, 0) + n
    if rank == 0:
        print(f"REMAP {json.dumps(totals)}", flush=True)
    train_loader.close()
    dist.destroy_process_group()


def watch_first_layer(model, rows):
    """Record the rows of hidden states this stage's first layer gets, call by call."""
    model.decoder.layers[0].register_forward_pre_hook(
        lambda mod, inp, kwargs: rows.append((kwargs.get("hidden_states", inp[0] if inp else None)).shape[0]),
        with_kwargs=True)


def watched_loader(pretrain_gpt, handed_out, contexts):
    """The patched provider's training loader; every micro-batch it hands out is appended
    to ``handed_out``, with its batch index and step context to ``contexts``."""
    with cuda_means_cpu():  # on a resume the provider reads the --load checkpoint's data state
        train_loader, _, _ = pretrain_gpt.train_valid_test_datasets_provider([1, 1, 1])
    log_batch = train_loader.on_batch
    train_loader.on_batch = lambda p, context: (handed_out.append(p), contexts.append((p.batch.index, context)),
                                                log_batch(p, context))
    return train_loader


def resume_stage(args, iteration, model, optimizer, train_loader, micro, pretrain_gpt, handed_out, contexts):
    """Megatron-LM's save_checkpoint after ``iteration`` global batches, then a fresh
    stage model through load_checkpoint and new loaders from the checkpoint's data
    state; asserts the loaded weights are the saved ones and the new loader hands out
    exactly the micro-batches the old one would have (the uninterrupted run's):
    returns the model, optimizer, loader and those micro-batches' pieces."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size, False)
    with cuda_means_cpu():
        save_checkpoint(iteration, [model], None, None, 0)
    # What the uninterrupted run trains next (drawn before the old loader closes).
    for _ in range(micro):
        next(train_loader)
    expected = [tuple(p.batch.pieces) for p in handed_out[-micro:]]
    train_loader.close()
    loaded = build_megatron_model(args.seed + 1)
    with cuda_means_cpu():
        args.iteration, _ = load_checkpoint([loaded], None, None)
    assert args.iteration == iteration, (args.iteration, iteration)
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert not isinstance(want, torch.Tensor) or torch.equal(got, want), name
    state = optimizer.state_dict()
    optimizer = torch.optim.Adam(loaded.parameters(), lr=1e-3)
    optimizer.load_state_dict(state)
    return loaded, optimizer, watched_loader(pretrain_gpt, handed_out, contexts), expected


if __name__ == "__main__":  # Megatron's checkpoint writer spawns processes that import this file
    main()
