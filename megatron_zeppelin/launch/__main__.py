"""``python -m megatron_zeppelin.launch --preset FILE (--print-args | --run)``.

``--print-args`` prints the full ``torchrun ... pretrain_gpt.py ...`` command of
one node; ``--only megatron`` prints just the ``pretrain_gpt.py`` arguments, one
per line (what ``scripts/slurm/*.sbatch`` read into an array).  ``--run`` runs the
command on this node (single-node runs; use the sbatch scripts for clusters).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from megatron_zeppelin.errors import ConfigError, exit_on_user_error
from megatron_zeppelin.launch.preset import check_model_fits, load_launch_preset
from megatron_zeppelin.launch.render import format_command, pretrain_args, render_command
from megatron_zeppelin.model_config import load_model
from megatron_zeppelin.validation import OneLineParser


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m megatron_zeppelin.launch",
                                 description="Render a launch preset into a Megatron-LM pretrain_gpt.py command.")
    ap.add_argument("--preset", required=True, help="preset name (configs/presets/) or YAML file")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--print-args", action="store_true", help="print the command and exit")
    what.add_argument("--run", action="store_true", help="run the command on this node")
    ap.add_argument("--only", choices=("all", "megatron"), default="all",
                    help="megatron: only the pretrain_gpt.py arguments, one per line")
    ap.add_argument("--rdzv-host", default="localhost", help="host of the first node (torchrun rendezvous)")
    ap.add_argument("--megatron-lm", default=None, help="Megatron-LM checkout (overrides the preset)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    preset = load_launch_preset(args.preset)
    if args.megatron_lm:
        preset = dataclasses.replace(preset, megatron_lm=args.megatron_lm)
    model = load_model(preset.model)
    check_model_fits(preset, model)
    if args.only == "megatron":
        command = pretrain_args(preset, model)
        if args.print_args:
            print("\n".join(command))
            return 0
        raise ConfigError("--only megatron prints arguments for a script to wrap; use it with --print-args")
    command = render_command(preset, model, args.rdzv_host)
    if args.print_args:
        print(format_command(command))
        return 0
    if preset.nodes > 1 and args.rdzv_host == "localhost":
        # torchrun would wait for the other nodes' rendezvous forever.
        raise ConfigError(f"preset {preset.name} spans {preset.nodes} nodes: run --run on every node with "
                          "--rdzv-host FIRST_NODE, or submit scripts/slurm/pretrain_gpt.sbatch")
    return _run(command)


def _run(command: list[str]) -> int:
    """Run on this node with ``${VAR}`` expanded; a missing script is a user error."""
    expanded = [os.path.expandvars(a) for a in command]
    unset = [a for a in expanded if "${" in a]
    if unset:
        raise ConfigError(f"{unset[0]!r} names an unset environment variable; export it (e.g. "
                          "MEGATRON_LM_DIR=/path/to/Megatron-LM) or pass --megatron-lm DIR")
    script = next(a for a in expanded if a.endswith("pretrain_gpt.py"))
    if not Path(script).is_file():
        raise ConfigError(f"{script} does not exist; pass --megatron-lm DIR of a patched Megatron-LM "
                          "checkout (scripts/apply_megatron_patch.sh DIR)")
    # Megatron's tensor-parallel communication overlap relies on one CUDA work queue
    # (its own scripts and scripts/slurm/pretrain_gpt.sbatch set the same); a value
    # the user exported wins.
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={env['CUDA_DEVICE_MAX_CONNECTIONS']} {format_command(expanded)}",
          file=sys.stderr, flush=True)
    return subprocess.call(expanded, env=env)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
