"""Launch presets -> Megatron-LM ``pretrain_gpt.py`` command lines (``python -m megatron_zeppelin.launch``)."""

from megatron_zeppelin.launch.preset import LaunchPreset, load_launch_preset
from megatron_zeppelin.launch.render import format_command, pretrain_args, render_command

__all__ = ["LaunchPreset", "load_launch_preset", "format_command", "pretrain_args", "render_command"]
