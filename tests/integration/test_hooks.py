"""The per-step hand-off: loaders over indexed datasets, plan check, resume, Megatron batch shapes."""

import argparse
import dataclasses
import os

import numpy as np
import pytest
import torch

from megatron_zeppelin.cost import CostModel
from megatron_zeppelin.errors import ConfigError, InfeasibleError
from megatron_zeppelin.integration import SPEC, add_zeppelin_args
from megatron_zeppelin.integration.checkpoint import restore_sampler
from megatron_zeppelin.integration.data import open_blends
from megatron_zeppelin.plan.agreement import PlanMismatchError, check_same_plan
from megatron_zeppelin.integration.hooks import (
    ZeppelinLoader,
    build_plan_fn,
    format_plan_log,
    get_batch,
    get_batch_by_keys,
    model_config_from_args,
    record_batch,
)
from megatron_zeppelin.integration.step_report import IterationReports, StepClock, format_report
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.sampler import batch_budget
from megatron_zeppelin.sampler.deferral import DeferringSampler
from megatron_zeppelin.topology import Topology, load_cluster, plan_topology

from tests.integration.indexed_data import doc_tokens

WORLD = 4  # cpu-sim: 2 nodes x 2 GPUs
MAX_SEQ, TOKENS_PER_GPU = 512, 300


def exact_max(*rank_values):
    """A fake MAX all-reduce over ranks holding ``rank_values`` (this rank's values first)."""
    def reduce(values):
        return [max(col) for col in zip(values, *rank_values)]
    return reduce


@pytest.fixture
def setup(datasets):
    prefixes, lengths = datasets
    blend = open_blends(["0.6", prefixes[0], "0.4", prefixes[1]], "1")["train"]
    cluster = load_cluster("cpu-sim")
    cluster = dataclasses.replace(cluster, topology=plan_topology(cluster.topology, WORLD, 1, 0))
    make_plan = build_plan_fn("zeppelin", CostModel(cluster, load_model("tiny")), TOKENS_PER_GPU,
                              remap=False, time_limit_s=5.0)
    return blend, make_plan, lengths


def loaders(blend, make_plan, *, prefetch="off", resume_at=0, check=None):
    out = []
    for rank in range(WORLD):
        sampler = DeferringSampler(blend.sampler(max_seq_len=MAX_SEQ, seed=3,
                                                 tokens_per_batch=batch_budget(TOKENS_PER_GPU, WORLD, MAX_SEQ)))
        restore_sampler(sampler, resume_at)
        out.append(ZeppelinLoader(sampler=sampler, blend=blend, make_plan=make_plan, rank=rank,
                                  device=torch.device("cpu"), communicator=None, backend=None,
                                  all_reduce_max=check, prefetch=prefetch))
    return out


def test_every_token_lands_once_in_plan_order(setup):
    blend, make_plan, lengths = setup
    ranks = loaders(blend, make_plan)
    tiers = set()
    for _ in range(4):
        steps = [next(loader) for loader in ranks]
        plan = steps[0].packed_seq_params.context.plan
        assert all(s.packed_seq_params.context.plan == plan for s in steps)
        labelled = 0
        for rank, step in enumerate(steps):
            assert step.tokens.shape == step.labels.shape == step.loss_mask.shape == step.position_ids.shape
            assert step.tokens.shape[0] == 1
            spans = plan.attention_spans(rank)
            np.testing.assert_array_equal(step.position_ids[0].numpy(),
                                          np.concatenate([np.arange(s.start, s.end) for s in spans]))
            labelled += int(step.loss_mask.sum())
        assert labelled == sum(n - 1 for n in plan.seq_lens)
        assert sum(s.tokens.shape[1] for s in steps) == sum(plan.seq_lens)
        assert max(plan.attention_tokens_per_rank()) <= TOKENS_PER_GPU
        tiers |= {plan.tier_of(p) for p in plan.attention}
    assert "local" in tiers and len(tiers) >= 2  # long pieces ride rings, short ones stay local


def test_tokens_come_from_the_right_documents(setup):
    blend, make_plan, lengths = setup
    loader = loaders(blend, make_plan)[0]
    prepared = loader.prepare()
    pieces, plan = prepared.batch.pieces, prepared.plan
    expected = np.concatenate([
        doc_tokens(pieces[s.seq].dataset, pieces[s.seq].doc,
                   lengths[pieces[s.seq].dataset][pieces[s.seq].doc])[pieces[s.seq].start + s.start:
                                                                      pieces[s.seq].start + s.end]
        for s in plan.attention_spans(0)])
    np.testing.assert_array_equal(prepared.data.tokens.numpy(), expected)
    # Labels are the next token of the same piece (the first span's, checked inside it).
    n = plan.attention_spans(0)[0].length
    np.testing.assert_array_equal(prepared.data.labels.numpy()[:n - 1], expected[1:n])
    assert prepared.data.loss_mask.numpy()[:n - 1].all()


def test_prefetch_and_resume_see_the_same_batches(setup):
    blend, make_plan, _ = setup
    a = loaders(blend, make_plan)[1]
    straight = [next(a) for _ in range(5)]
    for mode in ("thread", "process"):    # planned on a thread, or in a child process
        b = loaders(blend, make_plan, prefetch=mode)[1]
        fetched = [next(b) for _ in range(5)]
        # ``process`` plans in a spawned child (its pool holds one live process), ``thread`` here.
        children = b._planning._pool._processes if b._planning is not None else {}
        assert len(children) == (1 if mode == "process" else 0)
        assert all(pid != os.getpid() for pid in children)
        b.close()
        for x, y in zip(straight, fetched):
            assert torch.equal(x.tokens, y.tokens)
            assert x.packed_seq_params.context.plan == y.packed_seq_params.context.plan
    resumed = [next(loaders(blend, make_plan, resume_at=2)[1])]
    assert torch.equal(resumed[0].tokens, straight[2].tokens)
    assert resumed[0].packed_seq_params.context.plan == straight[2].packed_seq_params.context.plan


def test_plan_check_with_fake_all_reduce(setup):
    blend, make_plan, _ = setup
    plan = make_plan([400, 120, 90, 60])
    fp = plan.fingerprint()
    check_same_plan(plan, 7, exact_max([fp, -fp], [fp, -fp]))
    other = make_plan([400, 120, 90, 61]).fingerprint()
    with pytest.raises(PlanMismatchError, match="global batch 7") as exc:
        check_same_plan(plan, 7, exact_max([other, -other]))
    assert "--seed" in str(exc.value)
    # The loader runs the check before handing the batch over.
    loader = loaders(blend, make_plan, check=exact_max([1, -1]))[0]
    with pytest.raises(PlanMismatchError):
        next(loader)


def test_plan_topology_with_tensor_parallelism():
    h100 = Topology(nodes=1, gpus_per_node=8, nics_per_node=8)
    t = plan_topology(h100, 16, tp=2, tp_rank=1)
    assert (t.nodes, t.gpus_per_node, t.nics_per_node, t.nic_affinity) == (2, 4, 4, (0, 1, 2, 3))
    a800 = Topology(nodes=1, gpus_per_node=8, nics_per_node=4, nic_affinity=(0, 0, 1, 1, 2, 2, 3, 3))
    t = plan_topology(a800, 32, tp=4, tp_rank=0)
    assert (t.nodes, t.gpus_per_node, t.nics_per_node, t.nic_affinity) == (4, 2, 2, (0, 1))
    assert plan_topology(a800, 8, 1, 0).nic_affinity == a800.nic_affinity
    with pytest.raises(ConfigError, match="not a multiple"):
        plan_topology(a800, 12, 1, 0)
    with pytest.raises(ConfigError, match="does not divide"):
        plan_topology(a800, 8, 3, 0)


def test_model_config_from_megatron_args():
    ns = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                            num_query_groups=2, ffn_hidden_size=128, padded_vocab_size=256, vocab_size=250,
                            bf16=True)
    m = model_config_from_args(ns)
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.ffn_hidden_size, m.vocab_size, m.dtype_bytes) == \
        (2, 64, 2, 128, 256, 2)
    ns.group_query_attention, ns.bf16 = False, False
    m = model_config_from_args(ns)
    assert (m.num_query_groups, m.dtype_bytes) == (4, 4)


def test_megatron_batch_shapes_and_records(setup, tmp_path, capsys):
    blend, make_plan, _ = setup
    args = add_zeppelin_args(argparse.ArgumentParser()).parse_args(
        ["--zeppelin", "--zeppelin-plan-dump-dir", str(tmp_path), "--zeppelin-log-interval", "1"])
    loader = loaders(blend, make_plan)[0]
    times = iter([10.0, 12.5])
    one_rank_sum = lambda values: [v * WORLD for v in values]  # noqa: E731  4 ranks, same values
    reports = IterationReports(1, load_model("tiny"), StepClock(lambda: next(times)), one_rank_sum, pipelined=False,
                               emit=lambda micro_batches, r: print(f"{format_plan_log(micro_batches)}, "
                                                                   f"{format_report(r)}"))
    loader.on_batch = record_batch(args, "train", True, reports, 1000)
    tokens, labels, loss_mask, attention_mask, position_ids, packed = get_batch(loader)
    assert attention_mask is None and packed.context.plan is not None and tokens.shape == position_ids.shape
    assert args.zeppelin_data_state["batches_consumed"] == 1
    assert args.zeppelin_data_state["sampler"] == loader.sampler.state_dict()
    assert (tmp_path / "train_plan_0000000.json").is_file()
    assert capsys.readouterr().out == ""  # batch 0 is reported once it has trained
    packed.context.remap_counters.remap_intra_node = 100  # what batch 0's remaps counted on this rank
    first_plan = packed.context.plan
    keys = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
            "loss_mask", "max_seqlen", "position_ids", "tokens"]
    values = dict(zip(keys, get_batch_by_keys(loader, keys)))
    line = capsys.readouterr().out
    tokens0 = sum(first_plan.seq_lens)
    assert line.startswith(f"zeppelin batch 0: {len(first_plan.seq_lens)} seqs, {tokens0} tokens")
    assert f"remap_bytes={4 * 100} {tokens0 / 2.5:.1f} tokens/s" in line  # summed over ranks; 2.5 s
    assert values["cu_seqlens"].context.plan is not None and values["tokens"].shape[0] == 1
    assert all(values[k] is None for k in ("attention_mask", "cu_seqlens_padded", "max_seqlen", "local_cp_size"))
    assert args.zeppelin_data_state["batches_consumed"] == 2
    assert "local" in format_plan_log([loader.prepare()])
    assert SPEC[1] == "zeppelin_layer_spec"


def test_layer_spec_uses_zeppelin_attention():
    from types import SimpleNamespace

    from megatron_zeppelin.integration.hooks import layer_spec_for
    from megatron_zeppelin.megatron.attention import ZeppelinAttention

    from megatron_zeppelin.megatron.norm import SequenceParallelRMSNorm

    args = add_zeppelin_args(argparse.ArgumentParser()).parse_args(["--zeppelin", "--zeppelin-remap", "off"])
    config = SimpleNamespace(qk_layernorm=False, transformer_impl="local", sequence_parallel=False, num_layers=2)
    spec = layer_spec_for(args, config)
    assert spec.submodules.self_attention.submodules.core_attention is ZeppelinAttention
    # Under --sequence-parallel the block's norms accept SP (Megatron's local norm refuses it).
    block = layer_spec_for(args, SimpleNamespace(**{**vars(config), "sequence_parallel": True}))
    assert len(block.layer_specs) == 2 and block.layer_norm is SequenceParallelRMSNorm
    assert block.layer_specs[0].submodules.self_attention.submodules.core_attention is ZeppelinAttention
    assert block.layer_specs[0].submodules.input_layernorm is SequenceParallelRMSNorm


def test_built_gpt_model_is_retyped_for_per_token_rope(monkeypatch):
    from megatron.core.models.gpt import GPTModel

    from megatron_zeppelin.integration import hooks
    from megatron_zeppelin.integration.hooks import gpt_builder
    from megatron_zeppelin.megatron.model import ZeppelinGPTModel

    prepared = []  # the CPU layer is prepared (before the build) under --zeppelin only
    monkeypatch.setattr(hooks, "prepare_cpu_rank", prepared.append)
    built = GPTModel.__new__(GPTModel)  # the instance a builder returns (construction is Megatron's)
    on, off = argparse.Namespace(zeppelin=True, seed=7), argparse.Namespace(zeppelin=False, seed=7)
    assert type(gpt_builder(lambda args, *a, **k: built)(on, True, True, None, config=None)) is ZeppelinGPTModel
    assert prepared == [7]
    plain = GPTModel.__new__(GPTModel)
    assert type(gpt_builder(lambda args, *a, **k: plain)(off, True, True)) is GPTModel
    assert prepared == [7]
    with pytest.raises(ConfigError, match="legacy"):
        gpt_builder(lambda args, *a, **k: object())(on)


def test_micro_batch_plans_are_dumped_apart(tmp_path):
    """--global-batch-size 2 x DP: the two micro-batches of a global batch share its
    index; each gets its own plan file."""
    from types import SimpleNamespace

    args = add_zeppelin_args(argparse.ArgumentParser()).parse_args(
        ["--zeppelin", "--zeppelin-plan-dump-dir", str(tmp_path)])
    args.world_size, args.global_batch_size = 4, 8
    handle = record_batch(args, "train", True, None, 1000)
    for index in (0, 0, 1, 1):
        handle(SimpleNamespace(batch=SimpleNamespace(index=index), plan=SimpleNamespace(to_json=lambda: "{}"),
                               sampler_state={}), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "train_plan_0000000_mb0.json", "train_plan_0000000_mb1.json",
        "train_plan_0000001_mb0.json", "train_plan_0000001_mb1.json"]
    assert args.zeppelin_data_state["batches_consumed"] == 2


def test_megatron_path_plans_what_the_simulator_times():
    """``--zeppelin-decide on``: the Megatron-LM path's plan is the simulator's
    ``zeppelin`` plan (here another layout, which the replay times faster); ``off``
    is the simulator's ``zeppelin_nodecide`` plan, the first one."""
    from megatron_zeppelin.sim.simulate import build_strategies, plan_context
    from megatron_zeppelin.sim.timeline import decision_step_s

    cost = CostModel(load_cluster("cpu-sim", nodes=4), load_model("tiny"), routing=True)
    lens = [598, 453, 367, 203, 229, 47, 71, 31, 139, 573, 2474]
    decided = build_plan_fn("zeppelin", cost, 1024, True, 5.0, decide=True)(lens)
    first = build_plan_fn("zeppelin", cost, 1024, True, 5.0)(lens)
    sim = {s.name: s.planner.plan(lens, plan_context(s, 1024, 5.0))
           for s in build_strategies(["zeppelin", "zeppelin_nodecide"], cost)}
    assert decided == sim["zeppelin"] and first == sim["zeppelin_nodecide"]
    assert first != decided
    assert decision_step_s(decided, cost) < decision_step_s(first, cost)


def test_a_batch_no_plan_holds_defers_a_piece_to_the_next(setup):
    """The Megatron-LM loader defers like the trainer: a global batch its planner
    cannot place hands its last piece to the next global batch (logged), so every
    piece drawn is trained once or still waits, never dropped, and a checkpoint
    taken then carries the waiting pieces."""
    blend, make_plan, _ = setup

    def at_most_three(seq_lens):
        if len(seq_lens) > 3:
            raise InfeasibleError(f"no placement of {len(seq_lens)} sequences")
        return make_plan(seq_lens)

    budget = batch_budget(TOKENS_PER_GPU, WORLD, MAX_SEQ)
    sampler = DeferringSampler(blend.sampler(max_seq_len=MAX_SEQ, tokens_per_batch=budget, seed=3))
    notes = []
    loader = ZeppelinLoader(sampler=sampler, blend=blend, make_plan=at_most_three, rank=0, device=torch.device("cpu"),
                            communicator=None, backend=None, all_reduce_max=None, prefetch="off", note=notes.append)
    handed = [loader.prepare() for _ in range(6)]
    trained = [p for h in handed for p in h.batch.pieces]
    raw = iter(blend.sampler(max_seq_len=MAX_SEQ, tokens_per_batch=budget, seed=3))
    drawn = [p for _ in range(6) for p in next(raw).pieces]
    assert all(len(h.batch.pieces) <= 3 for h in handed) and len(set(trained)) == len(trained)
    assert sorted(trained + sampler.carried, key=repr) == sorted(drawn, key=repr)
    assert notes and all(n.startswith("step ") and "deferred a piece of" in n for n in notes)
    assert handed[-1].sampler_state["carried"] == [[p.doc, p.start, p.end, p.dataset] for p in sampler.carried]
    assert {h.batch.index for h in handed} == set(range(6))
