"""Per-rank timeline plot of one step: compute vs exposed communication.

One panel per strategy, one horizontal bar per rank, segments coloured by
kind (``timeline.SEGMENT_KINDS``), all panels on the same time axis so the
strategies compare at a glance.  Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sim.simulate import SimResult
from megatron_zeppelin.sim.timeline import SEGMENT_KINDS

COLORS = {"attention": "#4c72b0", "exposed_comm": "#dd8452", "remap": "#8172b3", "linear": "#55a868"}
LABELS = {"attention": "attention compute", "exposed_comm": "exposed attention comm",
          "remap": "remap", "linear": "linear (proj + MLP)"}


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display), or a clear error."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib; pip install matplotlib (or "
                          "pip install megatron-zeppelin[plot])") from None
    return plt


def check_plot_path(path: Path, flag: str = "--plot") -> None:
    """Before any work: matplotlib writes the format ``path``'s suffix names."""
    fmt = Path(path).suffix[1:].lower()
    if not fmt:
        return      # matplotlib writes its default format (PNG)
    plt = pyplot()
    fig = plt.figure()
    formats = sorted(fig.canvas.get_supported_filetypes())
    plt.close(fig)
    if fmt not in formats:
        raise ConfigError(f"{flag} {str(path)!r}: matplotlib writes no .{fmt[:20]} files; end the name with one of "
                          f"{', '.join('.' + f for f in formats)}")


def save_figure(fig, path: str | Path) -> None:
    """Write ``fig`` (format from the suffix) and close it; an unwritable path is
    a one-line error, not a traceback."""
    plt = pyplot()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(f"cannot write plot {str(path)!r}: {exc.strerror}; pick a writable path") from None
    finally:
        plt.close(fig)


def plot_timelines(result: SimResult, path: Path, *, title: str = "") -> None:
    """Draw the kept timeline of every feasible strategy into ``path`` (PNG, SVG, PDF)."""
    plt = pyplot()
    timelines = [(name, r.timeline) for name, r in result.strategies.items() if r.timeline is not None]
    if not timelines:
        raise ConfigError("nothing to plot: no strategy placed the plotted step; pick another "
                          "--plot-step (below --steps) or a feasible strategy")
    world = len(timelines[0][1].ranks)
    fig, axes = plt.subplots(len(timelines), 1, sharex=True, squeeze=False,
                             figsize=(10, 1.0 + len(timelines) * (0.6 + min(world, 64) * 0.06)))
    bar = 0.8 if world <= 64 else 1.0   # thousands of ranks: bars touch, the outline is the picture
    for ax, (name, tl) in zip(axes[:, 0], timelines):
        for kind in SEGMENT_KINDS:
            spans = [(r.rank, s.start_s * 1e3, s.duration_s * 1e3)
                     for r in tl.ranks for s in r.segments if s.kind == kind]
            if spans:
                ranks, starts, widths = zip(*spans)
                ax.barh(ranks, widths, left=starts, height=bar, color=COLORS[kind], linewidth=0)
        ax.axvline(tl.step_s * 1e3, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel("rank")
        ax.set_ylim(world - 0.5, -0.5)
        ax.set_title(f"{name}: step {tl.step_s * 1e3:.1f} ms, attn imbalance {tl.attn_imbalance:.2f}, "
                     f"slowest rank {tl.slowest_rank}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time in step (ms, all layers, forward + backward)")
    from matplotlib.patches import Patch
    fig.legend([Patch(color=COLORS[k]) for k in SEGMENT_KINDS], [LABELS[k] for k in SEGMENT_KINDS],
               loc="upper right", fontsize=8, ncol=len(SEGMENT_KINDS), frameon=False)
    if title:
        fig.suptitle(title, x=0.01, y=1 - 0.1 / fig.get_figheight(), ha="left", va="top", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    save_figure(fig, path)
