"""Driver for test_expert_parallel.py: the tiny-moe MoE layer on 2 gloo CPU ranks.

    python tests/megatron/expert_parallel_ranks.py EP OUT_DIR PORT [EP1_STATE]

Each rank routes its own tokens (10 and 13) through Megatron-Core's MoE layer built
from the project's layer spec at expert parallelism EP (1: all-gather dispatcher,
2: all-to-all), with EP1_STATE's weights when given (rank r holds global experts
r x local .. r x local + local - 1), and saves the output, the input gradient, the
parameter gradients and (EP 1) the weights to OUT_DIR/rank{r}.pt.  One process
group per run: Megatron's parallel state is built once per process.
"""

import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, ep: int, out: str, state_path: str | None, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_zeppelin.megatron import cpu_compat
    from megatron_zeppelin.megatron.experts import global_expert_name
    from megatron_zeppelin.megatron.model import transformer_config
    from megatron_zeppelin.megatron.spec import get_zeppelin_layer_spec
    from megatron_zeppelin.model_config import load_model

    mpu.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    cpu_compat.apply_cpu_compat(seed=1234)
    model = dataclasses.replace(load_model("tiny-moe"), expert_parallel_size=ep)
    spec = get_zeppelin_layer_spec(use_te=False, num_experts=model.num_experts)
    torch.manual_seed(0)
    layer = MoELayer(transformer_config(model), submodules=spec.submodules.mlp.submodules)
    if state_path is not None:
        state = torch.load(state_path)
        per = model.num_experts // ep
        layer.load_state_dict({k: state[global_expert_name(k, rank, per)] for k in layer.state_dict()})
    x = torch.randn(10 + 3 * rank, 1, 64, generator=torch.Generator().manual_seed(7 + rank), requires_grad=True)
    y, _ = layer(x)
    (y * y).sum().backward()
    torch.save({"dispatcher": type(layer.token_dispatcher).__name__, "y": y.detach(), "x.grad": x.grad,
                "grads": {n: p.grad for n, p in layer.named_parameters()},
                "state": layer.state_dict() if ep == 1 else None}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    ep, out, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    mp.spawn(run, args=(ep, out, sys.argv[4] if len(sys.argv) > 4 else None, port), nprocs=2)
