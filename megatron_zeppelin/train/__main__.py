"""``python -m megatron_zeppelin.train``: see :mod:`megatron_zeppelin.train.cli`."""

from __future__ import annotations

import sys
import warnings
from typing import Sequence

from megatron_zeppelin.errors import exit_on_user_error


def main(argv: Sequence[str] | None = None) -> None:
    if sys.argv and sys.argv[0].endswith("__main__.py"):
        sys.argv[0] = "megatron_zeppelin.train"  # error lines name the command, not __main__.py
    # megatron.core warns at import that TransformerEngine/Apex are missing; on a
    # CPU run that is expected, and the backend in use is printed per run anyway.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
    # Megatron's TP layers advise a CUDA stream setting (meaningless on CPU; Megatron-LM's launchers set it).
    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS")
    from megatron_zeppelin.train.cli import parse_args
    from megatron_zeppelin.comm.deadline import CommTimeoutError
    from megatron_zeppelin.train.divergence import Diverged
    from megatron_zeppelin.train.launch import ChildFailed, launch
    from megatron_zeppelin.train.lifetime import Interrupted

    def run() -> None:
        cfg = parse_args(argv)
        try:
            launch(cfg)
        except (ChildFailed, CommTimeoutError, Diverged) as exc:   # the last two: under torchrun/srun
            print(f"megatron_zeppelin.train: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        except Interrupted as exc:
            print(f"megatron_zeppelin.train: {exc}", file=sys.stderr)
            raise SystemExit(128 + exc.signum) from None

    exit_on_user_error(run)


if __name__ == "__main__":
    main()
