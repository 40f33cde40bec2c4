"""Per-step record: the JSON line (a public contract) and the console summary."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import IO, Sequence

from megatron_zeppelin.plan import TierCounts

RUN_START = "run_start"
"""Key of the line ``--append-log`` writes before a run's first step record, so a
reader of a log holding several runs (``train.compare``) takes one of them."""


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did, gathered on rank 0.  JSON keys may be added, never removed."""

    step: int
    """Step number (0-based, continues after ``--load``)."""
    loss: float
    """Per-token mean loss over the whole global batch."""
    grad_norm: float
    """L2 norm of the summed (data-parallel) gradient."""
    num_tokens: int
    """Tokens in the global batch."""
    plan: TierCounts
    """Sequences per tier."""
    attn_pairs_per_rank: Sequence[int]
    """Causal query-key pairs each rank computed this step (forward, per layer)."""
    linear_tokens_per_rank: Sequence[int]
    """Tokens each rank ran through the projections and MLP."""
    attention_tokens_per_rank: Sequence[int]
    """Tokens each rank held in the attention layout."""
    intra_node_bytes: int
    """Bytes sent between GPUs of the same node (all layers, forward and backward)."""
    inter_node_per_nic: Sequence[Sequence[int]]
    """``[node][nic]`` bytes sent through each NIC (all layers, forward and backward)."""
    remap_intra_node_bytes: int
    """Of ``intra_node_bytes``: what the layout switches (remap) sent inside nodes."""
    remap_inter_node_bytes: int
    """Bytes the layout switches sent to other nodes (counted in ``inter_node_per_nic`` too)."""
    step_time_s: float
    """Wall time of the step on rank 0 (plan, forward, backward, optimizer)."""
    micro_batch_tokens: Sequence[int]
    """Tokens of each micro-batch the global batch ran as: one entry per
    ``--micro-batches`` part, or more where the strategy runs a part in several
    passes (a baseline's rounds, ``train/passes.py``).  Per-rank fields above
    are summed over the micro-batches."""

    def to_dict(self) -> dict:
        return {
            "step": self.step, "loss": self.loss, "grad_norm": self.grad_norm,
            "num_tokens": self.num_tokens,
            "plan": {"local": self.plan.local, "intra": self.plan.intra, "inter": self.plan.inter,
                     "ulysses": self.plan.ulysses},
            "attn_pairs_per_rank": list(self.attn_pairs_per_rank),
            "linear_tokens_per_rank": list(self.linear_tokens_per_rank),
            "attention_tokens_per_rank": list(self.attention_tokens_per_rank),
            "bytes": {"intra_node": self.intra_node_bytes,
                      "inter_node_per_nic": [list(n) for n in self.inter_node_per_nic],
                      "remap_intra_node": self.remap_intra_node_bytes,
                      "remap_inter_node": self.remap_inter_node_bytes},
            "step_time_s": self.step_time_s,
            "micro_batch_tokens": list(self.micro_batch_tokens),
        }

    @property
    def pair_imbalance(self) -> float:
        """max / mean of ``attn_pairs_per_rank`` (1.0 = perfectly balanced)."""
        mean = sum(self.attn_pairs_per_rank) / max(len(self.attn_pairs_per_rank), 1)
        return max(self.attn_pairs_per_rank) / mean if mean else 1.0

    def summary(self, total_steps: int) -> str:
        """One console line: progress bar, loss, tiers, pair imbalance, bytes, time."""
        width = 20
        done = round(width * (self.step + 1) / max(total_steps, 1))
        bar = "#" * done + "." * (width - done)
        inter = sum(sum(n) for n in self.inter_node_per_nic)
        p = self.plan
        return (f"[{bar}] step {self.step + 1}/{total_steps} loss {self.loss:.5f} "
                f"| tiers local {p.local} intra {p.intra} inter {p.inter} ulysses {p.ulysses} "
                f"| pairs max/mean {self.pair_imbalance:.2f} "
                f"| bytes intra {_mb(self.intra_node_bytes)} inter {_mb(inter)} "
                f"NICs {nic_bars(self.inter_node_per_nic)} "
                f"| {self.num_tokens} tok {self.step_time_s:.2f}s")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}MB"


_BLOCKS = " ▁▂▃▄▅▆▇█"


def nic_bars(per_nic: list[list[int]]) -> str:
    """One block character per NIC, height = its inter-node bytes relative to the
    busiest NIC, nodes in brackets: ``[████][████]`` is perfectly
    spread, ``[   █][   █]`` is one NIC per node doing all the work."""
    top = max((b for node in per_nic for b in node), default=0)
    if top == 0:
        return "idle"
    return "".join("[" + "".join(_BLOCKS[round(8 * b / top)] for b in node) + "]" for node in per_nic)


class StepLogger:
    """Writes JSON lines and console summaries (rank 0 only)."""

    def __init__(self, json_path: str | None, total_steps: int, quiet: bool,
                 console: IO[str] | None = None, run_start: dict | None = None) -> None:
        """``run_start``: written as the log's ``{"run_start": ...}`` line first (``--append-log``)."""
        console = console or sys.stderr   # looked up now: a default bound at import would miss redirections
        self._json = open(json_path, "a", encoding="utf-8") if json_path else None
        if self._json is not None and run_start is not None:
            self._json.write(json.dumps({RUN_START: run_start}) + "\n")
            self._json.flush()
        self._total = total_steps
        self._console = None if quiet else console
        self._warnings = console

    def log(self, record: StepRecord) -> None:
        if self._json is not None:
            self._json.write(json.dumps(record.to_dict()) + "\n")
            self._json.flush()
        if self._console is not None:
            print(record.summary(self._total), file=self._console, flush=True)

    def header(self, message: str) -> None:
        """What the run is about to do (console only)."""
        if self._console is not None:
            print(message, file=self._console, flush=True)

    def warn(self, message: str) -> None:
        """Something the user should know even with ``--quiet`` (console only)."""
        print(f"warning: {message}", file=self._warnings, flush=True)

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
