"""A plain-text progress bar on stderr (no tqdm dependency).

Drawn only on a terminal: redirected stderr (CI logs, subprocess tests) stays
free of carriage-return noise and keeps error output to one line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``[#####-----]  5/10  12s  step 3 zeppelin``, redrawn in place."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 30) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self._start = time.monotonic()

    def advance(self, label: str = "") -> None:
        """Count one unit of work finished and redraw."""
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        elapsed = time.monotonic() - self._start
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done:>{len(str(self.total))}}/{self.total} "
                          f"{elapsed:5.0f}s  {label[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line so later output starts on a fresh one."""
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()
