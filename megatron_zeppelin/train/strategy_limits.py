"""What a strategy's parallelism can hold, checked before any process starts.

The sampler cuts documents into pieces of up to ``--max-seq-len`` tokens, so a
run must place a piece of that length whenever the data has one.  Two kinds of
strategy have a hard limit below the cluster's capacity:

* ``packing_dp`` never splits a sequence: a piece must fit one GPU;
* ``ulysses_sp`` and ``flexsp`` split heads over a Ulysses group of ``d`` GPUs,
  so ``d`` must divide the KV heads (per tensor-parallel rank): the model caps
  the group, and with it the longest piece.

Such a configuration is refused here with one line naming the limit and the
fixes, rather than failing mid-run at the first long piece, and never by
quietly running another layout than the one the user asked for.  (te_cp and
megatron_hybrid_cp grow their rings to the whole world, which
:meth:`TrainConfig.check` already bounds.)
"""

from __future__ import annotations

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.planner.flexsp import ulysses_sizes

#: Strategies whose groups split attention heads (Ulysses all-to-all).
ULYSSES_STRATEGIES = ("ulysses_sp", "flexsp")


def check_strategy_holds(strategy: str, model: ModelConfig, *, max_seq_len: int, tokens_per_gpu: int,
                         data_parallel_size: int, tp: int) -> None:
    """Raise :class:`ConfigError` when ``strategy`` cannot place a ``max_seq_len`` piece."""
    if strategy == "packing_dp" and max_seq_len > tokens_per_gpu:
        raise ConfigError(f"packing_dp holds every sequence whole on one GPU, and --max-seq-len {max_seq_len} "
                          f"is over --tokens-per-gpu {tokens_per_gpu}: lower --max-seq-len to {tokens_per_gpu}, "
                          "raise --tokens-per-gpu, or pick a strategy that splits sequences")
    if strategy not in ULYSSES_STRATEGIES:
        return
    kv = max(model.num_query_groups // tp, 1)
    largest = max(d for d in ulysses_sizes(data_parallel_size, kv) if data_parallel_size % d == 0)
    if max_seq_len <= largest * tokens_per_gpu:
        return
    per_tp = f" per TP rank (--tp {tp})" if tp > 1 else ""
    preset = " (e.g. --model tiny-ulysses)" if model.name == "tiny" else ""
    raise ConfigError(
        f"{strategy}: a {max_seq_len}-token piece needs a Ulysses group of more than {largest} GPUs at "
        f"--tokens-per-gpu {tokens_per_gpu}, and a group must divide model {model.name}'s {kv} KV heads{per_tp}; "
        f"use a model with more KV heads{preset}, raise --tokens-per-gpu to {-(-max_seq_len // largest)}, "
        f"or lower --max-seq-len to {largest * tokens_per_gpu}")
