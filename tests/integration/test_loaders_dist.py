"""build_train_valid_test_loaders on 4 gloo ranks with Megatron's parallel state (TP 1 and 2)."""

import argparse

import numpy as np
import pytest

from megatron_zeppelin.integration import SPEC, add_zeppelin_args
from tests.distributed import world_fixture

pytestmark = pytest.mark.slow
world = world_fixture(4)


def megatron_namespace(prefix, tp, routing, iteration=0, micro=1, sequence_parallel=False):
    """What Megatron-LM's parser and validate_args leave for the tiny preset on 4 ranks."""
    ns = add_zeppelin_args(argparse.ArgumentParser()).parse_args(
        ["--zeppelin", "--zeppelin-tokens-per-gpu", "600", "--zeppelin-cluster", "cpu-sim",
         "--zeppelin-routing", routing, "--zeppelin-remap", "off", "--zeppelin-backend", "torch"])
    dp = 4 // tp
    values = dict(world_size=4, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                  context_parallel_size=1, micro_batch_size=1, global_batch_size=dp * micro,
                  calculate_per_token_loss=True, dataloader_type="external", seq_length=512, spec=list(SPEC),
                  attention_dropout=0.0, apply_rope_fusion=False, transformer_impl="local",
                  normalization="RMSNorm", data_path=[prefix],
                  # The valid split's 6 documents end an epoch in a 1-sequence batch: too few for 2 micro-batches.
                  split="90,10,0" if micro == 1 else "100,0,0", seed=11, iteration=iteration,
                  consumed_valid_samples=0, num_layers=2, hidden_size=64, num_attention_heads=4,
                  group_query_attention=True, num_query_groups=2, ffn_hidden_size=128, padded_vocab_size=256,
                  bf16=False, sequence_parallel=sequence_parallel)
    for k, v in values.items():
        setattr(ns, k, v)
    return ns


def _loaders_case(rank, world_size, prefix, tp, routing, iteration, steps, micro=1, sequence_parallel=False):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zeppelin.integration.hooks import build_train_valid_test_loaders

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        args = megatron_namespace(prefix, tp, routing, iteration, micro, sequence_parallel)
        train, valid, test = build_train_valid_test_loaders(args)
        out = []
        for _ in range(steps):
            b = next(train)
            out.append((b.packed_seq_params.context.plan.fingerprint(), b.tokens[0].tolist(),
                        b.packed_seq_params.context.plan.seq_lens, b.packed_seq_params.pad_tokens,
                        int(b.loss_mask.sum())))
        kinds = type(b.packed_seq_params.context.communicator).__name__
        valid_ok = valid is None or next(valid).tokens.shape[0] == 1
        train.close()
        if valid is not None:
            valid.close()
        return {"dp_rank": parallel_state.get_data_parallel_rank(), "steps": out, "comm": kinds,
                "valid": valid_ok, "test": test, "state": args.zeppelin_data_state["batches_consumed"],
                "rank": dist.get_rank()}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    from tests.integration.indexed_data import write_dataset

    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.pareto(1.1, 60) * 50 + 10, 1500).astype(np.int64)
    return write_dataset(str(tmp_path_factory.mktemp("data") / "docs"), lengths)


@pytest.mark.parametrize("tp, routing", [(1, "on"), (2, "off")])
def test_every_rank_plans_the_same_batches(world, prefix, tp, routing):
    results = world.run(_loaders_case, prefix, tp, routing, 0, 3)
    dp = 4 // tp
    for step in range(3):
        fps = {r["steps"][step][0] for r in results}
        assert len(fps) == 1  # one Plan everywhere
        by_dp = {}
        for r in results:
            by_dp.setdefault(r["dp_rank"], []).append(r["steps"][step][1])
        assert sorted(by_dp) == list(range(dp))
        for tokens in by_dp.values():  # TP ranks of one data-parallel rank hold the same buffer
            assert all(t == tokens[0] for t in tokens)
        assert sum(len(t[0]) for t in by_dp.values()) == sum(results[0]["steps"][step][2]) + \
            sum(r["steps"][step][3] for r in results if r["rank"] % tp == 0)
    assert {r["comm"] for r in results} == {"RoutedCommunicator" if routing == "on" else "DirectCommunicator"}
    assert all(r["valid"] and r["test"] is None and r["state"] == 3 for r in results)


def test_sequence_parallel_pads_each_buffer_to_a_multiple_of_tp(world, prefix):
    results = world.run(_loaders_case, prefix, 2, "off", 0, 3, 1, True)
    for step in range(3):
        seq_lens = results[0]["steps"][step][2]
        for r in results:
            _, tokens, _, pad, labels = r["steps"][step]
            assert len(tokens) % 2 == 0 and 0 <= pad <= 2 and len(tokens) - pad >= 0
        mine = [r["steps"][step] for r in results if r["rank"] % 2 == 0]
        assert sum(len(s[1]) - s[3] for s in mine) == sum(seq_lens)  # padding is all that was added
        assert sum(s[4] for s in mine) == sum(L - 1 for L in seq_lens)  # and it carries no loss


def test_resumed_loaders_continue_the_same_sequence(world, prefix):
    straight = world.run(_loaders_case, prefix, 1, "off", 0, 4)
    resumed = world.run(_loaders_case, prefix, 1, "off", 2, 2)
    for a, b in zip(straight, resumed):
        assert b["steps"] == a["steps"][2:]
        assert b["state"] == 4


def test_global_batch_size_runs_micro_batches_of_one_token_budget(world, prefix):
    """--global-batch-size 2 x DP: each global batch (2 x the budget) comes as two
    micro-batches under the cap, consumed as one batch; a resume continues them."""
    from megatron_zeppelin.integration.data import open_blends
    from megatron_zeppelin.sampler import batch_budget

    straight = world.run(_loaders_case, prefix, 1, "off", 0, 4, 2)
    blend = open_blends([prefix], "100,0,0", None)["train"]
    sampler = blend.sampler(max_seq_len=512, tokens_per_batch=batch_budget(2 * 600, 4, 512, 0.95), seed=11)
    batches = iter(sampler)
    for step in (0, 2):
        micro = [sorted(straight[0]["steps"][step + i][2]) for i in (0, 1)]
        assert all(micro) and all(sum(m) <= 600 * 4 for m in micro)
        assert sorted(micro[0] + micro[1]) == sorted(next(batches).seq_lens)
    assert all(r["state"] == 2 for r in straight)
    resumed = world.run(_loaders_case, prefix, 1, "off", 1, 2, 2)
    for a, b in zip(straight, resumed):
        assert b["steps"] == a["steps"][2:]


def _plan_check_case(rank, world_size, lens_by_rank):
    """Each rank plans its own lengths; the check must pass iff all ranks agree."""
    import torch

    from megatron_zeppelin.cost import CostModel
    from megatron_zeppelin.comm.collectives import torch_all_reduce_max
    from megatron_zeppelin.integration.hooks import build_plan_fn
    from megatron_zeppelin.plan.agreement import PlanMismatchError, check_same_plan
    from megatron_zeppelin.model_config import load_model
    from megatron_zeppelin.topology import load_cluster

    plan = build_plan_fn("zeppelin", CostModel(load_cluster("cpu-sim"), load_model("tiny")), 256, False,
                         5.0)(lens_by_rank[rank])
    try:
        check_same_plan(plan, 0, torch_all_reduce_max(torch.device("cpu")))
    except PlanMismatchError as exc:
        return str(exc)
    return None


def test_plan_hash_mismatch_detected_over_gloo(world):
    same = [[400, 200, 50, 30]] * 4
    assert world.run(_plan_check_case, same) == [None] * 4
    one_off = same[:3] + [[400, 200, 50, 31]]
    errors = world.run(_plan_check_case, one_off)
    assert all(e is not None and "different Plans for global batch 0" in e for e in errors)


def _broadcast_case(rank, world_size, prefix, broadcast):
    """Ranks whose planners disagree (as a time-limited MILP can): with the plan
    broadcast from rank 0 every rank trains rank 0's Plan; without, the check stops."""
    import torch

    from megatron_zeppelin.comm.collectives import torch_all_reduce_max
    from megatron_zeppelin.cost import CostModel
    from megatron_zeppelin.integration.data import open_blends
    from megatron_zeppelin.integration.hooks import ZeppelinLoader, broadcast_plan_from_rank0, build_plan_fn
    from megatron_zeppelin.model_config import load_model
    from megatron_zeppelin.plan.agreement import PlanMismatchError
    from megatron_zeppelin.sampler import batch_budget
    from megatron_zeppelin.sampler.deferral import DeferringSampler
    from megatron_zeppelin.topology import load_cluster

    cpu = torch.device("cpu")
    blend = open_blends([prefix], "1")["train"]
    cost = CostModel(load_cluster("cpu-sim"), load_model("tiny"))
    make_plan = build_plan_fn("zeppelin" if rank == 0 else "packing_dp", cost, 600, False, 5.0)
    planned = []
    loader = ZeppelinLoader(
        sampler=DeferringSampler(blend.sampler(max_seq_len=512, tokens_per_batch=batch_budget(600, 4, 512), seed=2)),
        blend=blend,
        make_plan=lambda lens: planned.append(1) or make_plan(lens), rank=rank, device=cpu, communicator=None,
        backend=None, all_reduce_max=torch_all_reduce_max(cpu), prefetch="thread",
        broadcast_plan=broadcast_plan_from_rank0(cpu) if broadcast else None)
    try:
        plans = [next(loader).packed_seq_params.context.plan for _ in range(2)]
    except PlanMismatchError as exc:
        return str(exc)
    finally:
        loader.close()
    return [p.fingerprint() for p in plans], [p.strategy for p in plans], len(planned)


def test_one_rank_plans_and_broadcasts_for_flexsp(world, prefix):
    from megatron_zeppelin.integration.hooks import PLAN_ON_ONE_RANK

    assert "flexsp" in PLAN_ON_ONE_RANK
    results = world.run(_broadcast_case, prefix, True)
    assert all(r[0] == results[0][0] and r[1] == ["zeppelin"] * 2 for r in results)
    assert results[0][2] >= 2 and all(r[2] == 0 for r in results[1:])  # only rank 0 ran its planner
    errors = world.run(_broadcast_case, prefix, False)
    assert all("different Plans" in e for e in errors)


def _no_validation_case(rank, world_size, prefix):
    import contextlib
    import io

    from megatron.core import parallel_state

    from megatron_zeppelin.integration.hooks import build_train_valid_test_loaders

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        args = megatron_namespace(prefix, 1, "off")
        args.split, args.eval_iters = "100,0,0", 2
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            train, valid, test = build_train_valid_test_loaders(args)
        train.close()
        return valid, test, args.eval_iters, printed.getvalue()
    finally:
        parallel_state.destroy_model_parallel()


def test_an_empty_validation_split_turns_evaluation_off_in_one_line(world, prefix):
    """--split 100,0,0 with --eval-iters 2: Megatron-LM would evaluate on a missing
    loader at the first --eval-interval; the loaders turn evaluation off instead and
    rank 0 says so once."""
    results = world.run(_no_validation_case, prefix)
    assert [r[:3] for r in results] == [(None, None, 0)] * 4 and not any(r[3] for r in results[1:])
    assert results[0][3].splitlines() == ["zeppelin: --split 100,0,0 gives the validation split no document: evaluation is off (as with "
                     "--eval-iters 0, not 2); give it a share, e.g. --split 98,2,0, to evaluate"]


def _ring_grad_dtype_case(rank, world_size, prefix):
    import torch
    from megatron.core import parallel_state

    from megatron_zeppelin.integration.hooks import build_train_valid_test_loaders

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        args = megatron_namespace(prefix, 1, "off")
        # A bf16 model (Megatron sets params_dtype from --bf16) with fp32 dK/dV, not the default.
        args.bf16, args.params_dtype, args.zeppelin_ring_grad_dtype = True, torch.bfloat16, "fp32"
        args.split, args.zeppelin_prefetch = "100,0,0", "off"
        train, _, _ = build_train_valid_test_loaders(args)
        context = next(train).packed_seq_params.context
        train.close()
        return train.make_plan.cost.ring_grad_dtype, train.make_plan.cost.model.dtype_bytes, context.ring_grad_dtype
    finally:
        parallel_state.destroy_model_parallel()


def test_the_ring_gradient_dtype_reaches_the_cost_model_and_the_steps_context(world, prefix):
    """--zeppelin-ring-grad-dtype fp32 on a bf16 model: the cost model that plans
    and every step's context (which the engine reads) carry fp32; a flag parsed and
    dropped on the way would leave the default, model."""
    assert world.run(_ring_grad_dtype_case, prefix) == [("fp32", 2, "fp32")] * 4
