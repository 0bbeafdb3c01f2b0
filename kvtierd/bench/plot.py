"""PNG figures for the benchmarks, drawn with matplotlib (the `bench` extra, imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

INSTALL_HINT = "plots need matplotlib: pip install 'kvtierd[bench]' (or: .venv/bin/pip install 'matplotlib>=3.8')"


class PlotError(RuntimeError):
    """matplotlib is missing; the message says how to install it."""


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only: no display needed), or PlotError."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError(INSTALL_HINT) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reserve(series: Sequence[Sequence[float]], resizes: Sequence[Sequence[float]], kv_pages: int, title: str,
                 path: Path) -> None:
    """The reserved region's size and the high class's pages over time: `series` holds (seconds, reserved,
    high) after each step, `resizes` (seconds, old, new, p99 of high's pages) at each resize."""
    plt = pyplot()
    # The size changes when a step starts (it observes high's pages while scheduling), which a point taken
    # after that step would show late: the size is drawn from the resizes, high's pages from the steps.
    end = series[-1][0]
    size_t = [0.0] + [r[0] for r in resizes] + [end]
    size = [series[0][1]] + [r[2] for r in resizes] + [series[-1][1]]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    # Each value holds until the next one: steps, not slopes.
    ax.step(size_t, size, where="post", linewidth=2, label="reserved pages")
    ax.step([p[0] for p in series], [p[2] for p in series], where="post", linewidth=1, alpha=0.8,
            label="pages held by high (after a step)")
    # A step frees the pages of the requests it finishes: the resize saw high's use before that.
    ax.scatter([r[0] for r in resizes], [r[3] for r in resizes], marker="x", color="black", zorder=3,
               label="high's p99 pages a resize followed")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel(f"device pages (of {kv_pages})")
    ax.set_ylim(0, max(size + [p[2] for p in series]) * 1.15 + 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
