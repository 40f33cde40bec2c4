"""ZeppelinAttention and ZeppelinGPTModel on one rank against plain references."""

from __future__ import annotations

import math
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.enums import AttnMaskType

from megatron_zeppelin.attention.backends import get_backend
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.megatron import (ZeppelinAttention, build_gpt_model, build_packed_seq_params,
                                        get_zeppelin_layer_spec, packed_causal_attention, rotary_freqs,
                                        transformer_config)
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.plan import Mode, Plan, Span, placement
from megatron_zeppelin.planner.base import same_layout_linear
from megatron_zeppelin.step_context import StepContext

MODEL = ModelConfig(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=64, vocab_size=64)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def one_rank():
    """A one-process gloo world with Megatron's parallel state (TP = PP = CP = 1)."""
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        parallel_state.initialize_model_parallel()
        yield
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_gpt_model(MODEL, max_seq_len=64)


def _forward(model, ids: torch.Tensor, spans: list[Span], plan: Plan | None = None, labels=None):
    context = StepContext(plan=plan, rank=0, communicator=None, backend=get_backend("torch"))
    packed = build_packed_seq_params(spans, context=context, device=CPU)
    return model(ids[None], packed.position_ids[None], None, labels=None if labels is None else labels[None],
                 packed_seq_params=packed)


def test_rotary_freqs_match_megatron_angles():
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    positions = torch.tensor([5, 0, 3, 17, 2])
    want = torch.cat([rope.get_freqs_non_repeated(18)] * 2, dim=-1)[positions]
    torch.testing.assert_close(rotary_freqs(rope, positions)[:, 0, 0], want, rtol=0, atol=0)


def test_packed_causal_attention_matches_masked_softmax():
    torch.manual_seed(1)
    lens = [3, 1, 6]
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, 0.3)
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    pos = torch.arange(10)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) * 0.3
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_packed_buffer_equals_sequences_run_alone(one_rank):
    """Masking and per-sequence RoPE: a packed buffer of three sequences gives each
    sequence the logits and gradients it gets alone, with positions from 0."""
    model = _model()
    lens = [5, 9, 3]
    ids = torch.randint(0, MODEL.vocab_size, (sum(lens),))
    spans = [Span(i, 0, n) for i, n in enumerate(lens)]
    packed_loss = _forward(model, ids, spans, labels=ids.roll(-1))
    packed_loss.sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    start = 0
    for i, n in enumerate(lens):
        alone = _forward(model, ids[start:start + n], [Span(i, 0, n)], labels=ids.roll(-1)[start:start + n])
        torch.testing.assert_close(alone[0], packed_loss[0, start:start + n], rtol=1e-5, atol=1e-6)
        alone.sum().backward()
        start += n
    for got, p in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)


def test_thd_rope_applies_each_tokens_own_position(one_rank):
    """Zigzag chunks [0, 2) and [6, 8) of a sequence plus a whole second sequence:
    Megatron's THD RoPE fed ``rotary_freqs`` rotates every row exactly as RoPE of
    the whole sequence rotates that row's position."""
    config = transformer_config(MODEL)
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    spans = [Span(0, 0, 2), Span(0, 6, 8), Span(1, 0, 3)]
    packed = build_packed_seq_params(spans, context=StepContext(None, 0, None, None), device=CPU)
    torch.manual_seed(2)
    full = {0: torch.randn(8, 2, 8), 1: torch.randn(3, 2, 8)}
    rows = torch.cat([full[sp.seq][sp.start:sp.end] for sp in spans])
    got = apply_rotary_pos_emb(rows, rotary_freqs(rope, packed.position_ids), config=config,
                               cu_seqlens=packed.cu_seqlens_q, cp_group=dist.group.WORLD)
    whole = {i: apply_rotary_pos_emb(x[:, None], rotary_freqs(rope, torch.arange(len(x))),
                                     config=config)[:, 0] for i, x in full.items()}
    want = torch.cat([whole[sp.seq][sp.start:sp.end] for sp in spans])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, rows)


def test_engine_path_equals_plain_path(one_rank):
    """A one-rank all-local Plan through the engine equals plain packed attention."""
    model = _model(5)
    lens = [4, 7, 2]
    ids = torch.randint(0, MODEL.vocab_size, (sum(lens),))
    attention = tuple(placement(i, n, Mode.LOCAL, [0]) for i, n in enumerate(lens))
    plan = Plan(strategy="t", world_size=1, gpus_per_node=1, seq_lens=tuple(lens), attention=attention,
                linear=same_layout_linear(1, attention)).validate()
    spans = plan.attention_spans(0)
    results = []
    for p in (None, plan):
        loss = _forward(model, ids, spans, plan=p, labels=ids.roll(-1))
        loss.sum().backward()
        results.append((loss.detach(), [q.grad.clone() for q in model.parameters()]))
        model.zero_grad()
    (plain, plain_grads), (engine, engine_grads) = results
    torch.testing.assert_close(engine, plain, rtol=1e-5, atol=1e-6)
    for got, want in zip(engine_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_attention_rejects_what_it_cannot_compute():
    base = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    with pytest.raises(ConfigError, match="dropout"):
        ZeppelinAttention(config=transformer_config(MODEL), attention_dropout=0.1, **base)
    fused = transformer_config(MODEL)
    fused.apply_rope_fusion = True
    with pytest.raises(ConfigError, match="rope"):
        ZeppelinAttention(config=fused, **base)
    with pytest.raises(ConfigError, match="causal"):
        ZeppelinAttention(config=transformer_config(MODEL), layer_number=1,
                          attn_mask_type=AttnMaskType.no_mask, attention_type="self")
    # Keyword arguments of later Megatron-Core versions are accepted.
    ZeppelinAttention(config=transformer_config(MODEL), cp_comm_type="p2p", pg_collection=None,
                      model_comm_pgs=None, some_future_kwarg=1, **base)


def test_layer_spec_plugs_zeppelin_attention():
    spec = get_zeppelin_layer_spec(use_te=False)
    assert spec.submodules.self_attention.submodules.core_attention is ZeppelinAttention
    # The base spec is not modified: Megatron's own local spec keeps its attention.
    assert get_zeppelin_layer_spec(use_te=False) is not spec


def test_moe_spec_remaps_the_moe_block_and_routes_on_cpu():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_zeppelin.megatron.moe import ZeppelinTopKRouter
    from megatron_zeppelin.remap import RemapMLPMixin

    spec = get_zeppelin_layer_spec(use_te=False, remap=True, num_experts=4)
    mlp = spec.submodules.mlp
    assert issubclass(mlp.module, MoELayer) and issubclass(mlp.module, RemapMLPMixin)
    assert mlp.submodules.router is ZeppelinTopKRouter



def test_the_cpu_router_goes_into_megatron_0_19s_moe_partial():
    """Megatron-Core 0.19 gives the MoE spec as ``partial(MoELayer, submodules=MoESubmodules(...))``."""
    import dataclasses
    import functools

    from megatron_zeppelin.megatron.moe import ZeppelinTopKRouter
    from megatron_zeppelin.megatron.spec import with_router

    @dataclasses.dataclass
    class Submodules:  # MoESubmodules' shape at 0.19
        experts: object
        router: type = object

    given = functools.partial(dict, submodules=Submodules(experts="mlp"))
    built = with_router(given, ZeppelinTopKRouter)
    assert built.func is dict and built.keywords["submodules"] == Submodules("mlp", ZeppelinTopKRouter)
    assert given.keywords["submodules"].router is object  # Megatron's own spec is left as it was


def test_step_context_reaches_every_zeppelin_module_through_the_model(one_rank):
    """One channel: the context on the packed parameters is bound by the model to
    every ZeppelinAttention and ZeppelinRemap; a batch without one unbinds it, and
    the modules then refuse to run instead of passing their input through."""
    from megatron_zeppelin.megatron.packed import ZeppelinPackedSeqParams
    from megatron_zeppelin.remap import ZeppelinRemap

    torch.manual_seed(3)
    model = build_gpt_model(MODEL, max_seq_len=64, remap=True)
    lens = [6, 3]
    attention = tuple(placement(i, n, Mode.LOCAL, [0]) for i, n in enumerate(lens))
    plan = Plan(strategy="t", world_size=1, gpus_per_node=1, seq_lens=tuple(lens), attention=attention,
                linear=same_layout_linear(1, attention)).validate()
    ids = torch.randint(0, MODEL.vocab_size, (sum(lens),))
    context = StepContext(plan=plan, rank=0, communicator=_LoopbackComm(), backend=get_backend("torch"))
    packed = build_packed_seq_params(plan.attention_spans(0), context=context, device=CPU)
    model(ids[None], packed.position_ids[None], None, packed_seq_params=packed)
    users = [m for m in model.modules() if isinstance(m, (ZeppelinAttention, ZeppelinRemap))]
    assert len(users) == 3 * MODEL.num_layers and all(m.step_context is context for m in users)
    assert context.attention_counter.forward_pairs == MODEL.num_layers * (21 + 6)
    kinds = sorted({key[0] for key in context.cache})
    assert kinds == ["layer_schedules", "remap_exchange"]  # per-plan data lives on the context
    bare = ZeppelinPackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens_q,
                                   cu_seqlens_kv=packed.cu_seqlens_q, position_ids=packed.position_ids)
    with pytest.raises(ConfigError, match="ran without a Zeppelin step context"):
        model(ids[None], packed.position_ids[None], None, packed_seq_params=bare)
    assert all(m.step_context is None for m in users)


def test_remap_model_saves_and_loads_with_torch_dist(one_rank, tmp_path, monkeypatch):
    """``--ckpt-format torch_dist`` asks every module for ``sharded_state_dict``
    (Megatron-Core 0.16.1 raised AttributeError on ZeppelinRemap at the first save)."""
    pytest.importorskip("psutil", reason="Megatron's torch_dist writer needs psutil")
    from megatron.core import dist_checkpointing

    # Megatron's torch_dist writer calls these two CUDA functions unconditionally;
    # on a CPU-only torch they mean "the CPU" (no stream to wait for).
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    torch.manual_seed(4)
    saved = build_gpt_model(MODEL, max_seq_len=64, remap=True)
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path))
    torch.manual_seed(5)
    loaded = build_gpt_model(MODEL, max_seq_len=64, remap=True)
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), str(tmp_path)))
    for (name, want), got in zip(saved.state_dict().items(), loaded.state_dict().values()):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), name


class _LoopbackComm:
    """One rank's communicator: a round only copies a rank's messages to itself."""

    def __init__(self) -> None:
        from megatron_zeppelin.comm.base import ByteCounters
        self.counters = ByteCounters()

    def start_round(self, messages, sends, recvs, *, routed=True):
        for m in messages:
            recvs[m.id].copy_(sends[m.id])
        return self

    def wait(self) -> None:
        pass


def test_cu_seqlens_stay_on_the_host():
    """Megatron's THD RoPE calls .tolist() and .item() per span on cu_seqlens: on the
    host those are free, on a GPU each would wait for the stream."""
    spans = [Span(0, 0, 3), Span(1, 4, 9)]
    packed = build_packed_seq_params(spans, context=StepContext(None, 0, None, None),
                                     device=torch.device("meta"))
    assert packed.cu_seqlens_q.device.type == "cpu" and packed.cu_seqlens_q.tolist() == [0, 3, 8]
    assert packed.position_ids.device.type == "meta"
