"""The remapped MLP under sequence parallelism equals it without, rows and gradients
(4 gloo ranks = 2 data-parallel x 2 tensor-parallel, TP-fastest)."""

from __future__ import annotations

import torch

from megatron_zeppelin.comm.base import ByteCounters
from megatron_zeppelin.comm.direct import DirectCommunicator
from megatron_zeppelin.remap import ZeppelinRemap, pad_rows
from megatron_zeppelin.step_context import StepContext
from megatron_zeppelin.remap.sequence_parallel import sequence_parallel_mlp
from megatron_zeppelin.topology import Topology
from tests.distributed import world_fixture
from tests.remap.test_remap import features, random_plan

TP, DP, WIDTH = 2, 2, 3
world = world_fixture(TP * DP)


def _case(rank, world_size, seeds):
    import torch.distributed as dist

    tp_groups = [dist.new_group([d * TP + t for t in range(TP)]) for d in range(DP)]
    dp_groups = [dist.new_group([d * TP + t for d in range(DP)]) for t in range(TP)]
    dp_rank, tp_rank = divmod(rank, TP)
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    comm = DirectCommunicator(dp_group, topology=Topology(nodes=DP, gpus_per_node=1, nics_per_node=1),
                              counters=ByteCounters())
    weight = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(3))
    for seed in seeds:
        plan = random_plan(seed, world_size=DP, gpus_per_node=1)
        context = StepContext(plan=plan, rank=dp_rank, communicator=comm, backend=None)
        to_linear, to_attention = ZeppelinRemap("to_linear"), ZeppelinRemap("to_attention")
        to_linear.step_context = to_attention.step_context = context
        x = features(plan.attention_spans(dp_rank), seed, WIDTH)  # [t + pad, 2, w]
        attention_rows = x.shape[0]
        rows = attention_rows + -attention_rows % TP + TP  # SP padding (one extra TP block: any multiple works)
        x = torch.cat([x, torch.randn(rows - attention_rows, 2, WIDTH)])  # padding rows hold garbage
        grad_out = torch.randn(rows, 2, WIDTH, generator=torch.Generator().manual_seed(seed))

        # Without SP: the whole buffer through switch, row-wise "MLP", switch back.
        x_full, w_full = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y_full = to_attention(to_linear(x_full[:attention_rows]) @ w_full)
        (y_full * grad_out[:attention_rows]).sum().backward()

        # With SP: this TP rank's rows in, its rows out; the weight's gradient sums over TP.
        share = rows // TP
        mine = slice(tp_rank * share, (tp_rank + 1) * share)
        x_sp, w_sp = x[mine].clone().requires_grad_(), weight.clone().requires_grad_()
        y_sp, bias = sequence_parallel_mlp(lambda h: (h @ w_sp, None), x_sp, to_linear, to_attention,
                                           tp_group, attention_rows)
        (y_sp * grad_out[mine]).sum().backward()
        dist.all_reduce(w_sp.grad, group=tp_group)

        expected = torch.cat([y_full, torch.zeros(rows - attention_rows, 2, WIDTH)])[mine]
        torch.testing.assert_close(y_sp, expected, rtol=1e-6, atol=1e-6)
        expected_grad = torch.cat([x_full.grad[:attention_rows], torch.zeros(rows - attention_rows, 2, WIDTH)])
        torch.testing.assert_close(x_sp.grad, expected_grad[mine], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w_sp.grad, w_full.grad, rtol=1e-5, atol=1e-6)
        assert bias is None and pad_rows(0) == 1
    return True


def test_sequence_parallel_mlp_equals_the_unsplit_one(world):
    assert world.run(_case, list(range(12))) == [True] * (TP * DP)
