"""What one section of ``benchmarks/gpu_check.py`` returns, and how the report shows it.

Kept apart from gpu_check.py so that a module of sections (``stream_checks.py``)
imports it without importing the runner.  A section is a function
``section_<name>(args, dry_run: bool) -> SectionResult``; ``dry_run`` runs its own
code on the CPU with every CUDA call left out (its process sees no GPU).  ``args``
is gpu_check's command line: ``cluster`` (a preset name, or None: the GPU's own),
``steps``, ``table``, and ``section_budget``, the seconds this section's process
has before it is stopped.  It runs in a process of its own, with ``benchmarks/``
on ``sys.path``; an exception it raises is a FAIL carrying the exception's line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class SectionResult:
    """One section's verdict."""

    passed: bool
    """The section proved what it claims (its own criterion, stated in ``body``)."""
    figure: str
    """One line: the number that says how it went (printed beside PASS / FAIL)."""
    body: str
    """Markdown for the report: commands, tables, the criterion, what failed."""

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> "SectionResult":
        data = json.loads(path.read_text())
        return cls(bool(data["passed"]), str(data["figure"]), str(data["body"]))

    @classmethod
    def failed(cls, figure: str, body: str = "") -> "SectionResult":
        return cls(False, " ".join(figure.split()) or "failed", body or figure)


def fenced(text: str) -> str:
    """``text`` as a markdown code block."""
    return f"```\n{text.rstrip()}\n```"
