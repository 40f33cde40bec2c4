"""Writing a benchmark's report into its ``docs/results`` page without losing the page's history."""

from __future__ import annotations

from pathlib import Path


def write_head(path: Path, report: str) -> None:
    """Write ``report`` as the head of ``path``: it replaces everything before the
    page's first ``## `` heading, and the sections from there on (earlier runs,
    before/after tables written by hand, other benchmarks' sections) are kept."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    history = old[old.index("\n## ") + 1:] if "\n## " in old else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.rstrip("\n") + "\n" + ("\n" + history if history else ""), encoding="utf-8")
