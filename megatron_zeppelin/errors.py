"""User-facing errors.

Every mistake a user can make (bad preset, bad lengths file, topology that does
not match the world size, ...) raises a subclass of :class:`ZeppelinError` whose
message names the problem *and* the fix.  Command-line entry points catch it,
print one line and exit with status 2 -- never a traceback from deep inside torch.
"""

from __future__ import annotations

import sys
from typing import Callable, NoReturn, TypeVar

T = TypeVar("T")


class ZeppelinError(ValueError):
    """A problem with the user's input or configuration (message says how to fix it)."""


class ConfigError(ZeppelinError):
    """A preset, YAML file or command-line flag is malformed or inconsistent."""


class PlanError(ZeppelinError):
    """A Plan violates an invariant (coverage, zigzag shards, token cap)."""


class InfeasibleError(ZeppelinError):
    """A strategy cannot place this batch (e.g. a sequence longer than its token cap)."""


def brief(exc: BaseException, limit: int = 200) -> str:
    """An exception as one short line (for messages that quote a library's error)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return (text[:limit - 3] + "...") if len(text) > limit else (text or type(exc).__name__)


def exit_on_user_error(main: Callable[[], T]) -> T | NoReturn:
    """Run ``main``; turn a :class:`ZeppelinError` into one line on stderr and exit 2."""
    try:
        return main()
    except ZeppelinError as exc:
        prog = sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "megatron_zeppelin"
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
