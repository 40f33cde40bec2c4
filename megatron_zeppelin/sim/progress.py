"""Progress of a simulation on stderr (no tqdm dependency).

On a terminal, a bar redrawn in place.  On a redirected stderr (CI logs, a
batch job) one plain line every ``heartbeat_s`` seconds from a background
thread -- even while one plan takes long -- so a long simulation never looks
hung, while a short one (and its error output) stays free of progress noise.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

#: Seconds between the progress lines on a non-terminal stderr.
HEARTBEAT_S = 10.0


class Progress:
    """``[#####-----]  5/10  12s  step 3 zeppelin``, redrawn in place (a terminal),
    or ``progress: 5/10 plans, 12 s, step 3 zeppelin`` every ``heartbeat_s``."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 30, heartbeat_s: float = HEARTBEAT_S) -> None:
        """``total``: units of work (0: not known yet, see :meth:`set_total`);
        ``enabled``: True the bar, False nothing, None the bar on a terminal, else the lines."""
        self.known = total > 0
        self.total = max(total, 1)
        self.done = 0
        self.label = "sampling batches"
        self.stream = stream if stream is not None else sys.stderr
        tty = self.stream.isatty()
        self.enabled = tty if enabled is None else enabled
        self.width = width
        self._start = time.monotonic()
        self._stop = threading.Event()
        if enabled is None and not tty:
            threading.Thread(target=self._beat, args=(heartbeat_s,), name="sim-progress", daemon=True).start()

    def set_total(self, total: int) -> None:
        """The units of work, once known (the lines count them from then on)."""
        self.total, self.known = max(total, 1), True

    def _beat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            counted = f"{self.done}/{self.total} plans, " if self.known else ""
            self.stream.write(f"progress: {counted}{time.monotonic() - self._start:.0f} s, {self.label}\n")
            self.stream.flush()

    def advance(self, label: str = "") -> None:
        """Count one unit of work finished and redraw."""
        self.done = min(self.done + 1, self.total)
        self.label = label
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        elapsed = time.monotonic() - self._start
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done:>{len(str(self.total))}}/{self.total} "
                          f"{elapsed:5.0f}s  {label[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line so later output starts on a fresh one; stop the lines."""
        self._stop.set()
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()
