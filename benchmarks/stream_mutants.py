"""The stream protocol's mutation check: every ordering line must be needed.

    python benchmarks/stream_mutants.py [TEST ...]     # default: tests/comm/test_stream_check.py

Replaces, one at a time, each line of ``megatron_zeppelin/`` that calls
``wait_event(``, ``wait_stream(`` or ``record_stream(`` or records an event
(``.record(``) by ``pass``, runs the tests, and restores the file.  A mutant the
tests do not fail is an ordering line no test needs: either dead, or a hole in
the checker.  Run it in a checkout nobody else edits (it rewrites files in place,
and restores each before the next).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDERING = re.compile(r"(wait_event\(|wait_stream\(|record_stream\(|\.record\()")


def ordering_lines() -> list[tuple[Path, int, str]]:
    """(file, 0-based line, text) of every ordering call of the package (definitions excluded)."""
    found = []
    for path in sorted((ROOT / "megatron_zeppelin").rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines()):
            code = line.split("#")[0].strip()
            if ORDERING.search(code) and not code.startswith(("def ", '"""')):
                found.append((path, i, line.strip()))
    return found


def main(argv: list[str]) -> int:
    tests = argv or ["tests/comm/test_stream_check.py"]
    killed = 0
    lines = ordering_lines()
    for path, i, text in lines:
        original = path.read_text()
        rows = original.splitlines(keepends=True)
        indent = rows[i][:len(rows[i]) - len(rows[i].lstrip())]
        path.write_text("".join(rows[:i] + [f"{indent}pass  # mutant\n"] + rows[i + 1:]))
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                               cwd=ROOT, capture_output=True, text=True, timeout=900)
        finally:
            path.write_text(original)
        failed = next((x for x in r.stdout.splitlines() if x.startswith("FAILED")), "")
        killed += r.returncode != 0
        print(f"{'KILLED  ' if r.returncode else 'SURVIVED'} {path.relative_to(ROOT)}:{i + 1}: {text}  {failed}",
              flush=True)
    print(f"{killed}/{len(lines)} mutants killed")
    return 0 if killed == len(lines) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
