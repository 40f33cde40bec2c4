"""``python -m megatron_zeppelin.sim`` (and the ``zeppelin-sim`` console script)."""

from megatron_zeppelin.sim.cli import main

if __name__ == "__main__":
    main()
