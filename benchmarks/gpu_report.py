"""What one section of ``gpu_check`` reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SectionResult:
    """One section's verdict: PASS/FAIL, one figure for the summary, its body."""

    passed: bool
    """Whether the section met its targets."""
    figure: str
    """One line: the figure that decides it."""
    body: str
    """Markdown: the commands, tables and notes of the report."""
