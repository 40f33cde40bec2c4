"""Expert parallelism's weights: which global expert each rank's local expert is.

Under expert parallelism ``ep`` a rank of EP rank ``e`` holds experts
``e * local .. e * local + local - 1`` (``local = num_experts / ep``) under the
local names ``0 .. local - 1``.  Megatron-Core's CPU initialisation draws every
rank's local experts from the same point of torch's generator, so at EP 2
expert 2 would start equal to expert 0; :func:`expert_parallel_weights` instead
gives each rank its slice of the weights the EP 1 model draws, so the EP size
decides only where an expert lives, never what it computes.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping

import torch

from megatron_zeppelin.errors import ConfigError

#: Megatron-Core's expert parameter names: SequentialMLP's ``experts.local_experts.<i>.``
#: and TEGroupedMLP's ``experts.linear_fc<k>.weight<i>`` (one tensor per local expert).
_EXPERT_INDEX = (re.compile(r"(experts\.local_experts\.)(\d+)(\.)"),
                 re.compile(r"(experts\.linear_fc[12]\.(?:weight|bias))(\d+)()$"))


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """The EP 1 name of local parameter ``name`` on EP rank ``ep_rank`` (itself
    for a parameter outside the experts)."""
    for pattern in _EXPERT_INDEX:
        match = pattern.search(name)
        if match:
            index = ep_rank * num_local + int(match.group(2))
            return f"{name[:match.start()]}{match.group(1)}{index}{match.group(3)}{name[match.end():]}"
    return name


def one_rank_expert_groups():
    """Megatron-Core's process groups with expert parallelism 1: the EP group is
    this rank alone, the expert TP x EP group the expert TP group (enough to
    build an EP 1 model whose weights are read, never run)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups()
    # Only this rank joins its group, so no other rank has to take part in making it.
    groups.ep = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    groups.tp_ep = groups.expt_tp
    return groups


def expert_parallel_weights(build: Callable[[], torch.nn.Module], build_ep1: Callable[[], torch.nn.Module],
                            ep_rank: int, num_local: int) -> torch.nn.Module:
    """``build()``'s model holding EP rank ``ep_rank``'s slice of the weights
    ``build_ep1()`` draws.  torch's generator is left where the EP 1 build leaves
    it, so whatever draws after the model draws the same at every EP size."""
    full = build_ep1().state_dict()
    after_ep1 = torch.get_rng_state()
    model = build()
    torch.set_rng_state(after_ep1)
    model.load_state_dict(expert_slice(full, model.state_dict().keys(), ep_rank, num_local))
    return model


def expert_slice(full: Mapping[str, torch.Tensor], local_names: Iterable[str], ep_rank: int,
                 num_local: int) -> dict[str, torch.Tensor]:
    """The entries of the EP 1 state ``full`` under this rank's local names."""
    out = {}
    for name in local_names:
        source = global_expert_name(name, ep_rank, num_local)
        if source not in full:
            raise ConfigError(f"expert parallelism: local parameter {name} has no EP 1 counterpart {source}; "
                              "this Megatron-Core expert module names its weights in a way not handled here")
        out[name] = full[source]
    return out
