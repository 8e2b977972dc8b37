"""Iteration time–energy frontier plot: every method's plans as points, its full frontier as a line.

Input is a ``kareus-frontier/1`` document (the object ``kareus plan`` writes as frontier.json and
``kareus compare`` builds from measured logs): time = iteration time (s), energy = GPU energy of the
whole job per iteration (J; drawn in kJ). matplotlib is imported lazily and only with the Agg canvas,
so importing this module costs nothing and never opens a window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kareus_megatron.vocab import KAREUS, MEGATRON, NANOBATCH_PERSEUS, PERSEUS, SOLVE

# Fixed colours and labels so every figure of the project reads the same way.
METHOD_STYLE: dict[str, tuple[str, str, str]] = {
    # name: (label, colour, marker)
    MEGATRON: ("Megatron-LM", "#7f7f7f", "s"),
    PERSEUS: ("Megatron + Perseus", "#1f77b4", "o"),
    NANOBATCH_PERSEUS: ("Nanobatching + Perseus", "#ff7f0e", "^"),
    KAREUS: ("Kareus (joint)", "#d62728", "D"),
    SOLVE: ("solve", "#2ca02c", "v"),
}


def method_label(name: str) -> str:
    """Human-readable name of a planning method."""
    return METHOD_STYLE.get(name, (name, "", ""))[0]


def plot_frontier(
    doc: Mapping[str, Any],
    ax: Any,
    *,
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    title: str | None = None,
    legend: bool = True,
) -> Any:
    """Draw each method's points (time s, energy J) of a frontier document on `ax`; return `ax`.

    `curves` optionally maps a method to its whole frontier (time s, energy J), drawn as a step line
    under the points (the points are the plans that were written; the curve is every plan found).
    """
    curves = curves or {}
    for name, entry in doc["methods"].items():
        label, colour, marker = METHOD_STYLE.get(name, (name, None, "o"))
        pts = entry["points"]
        t = [p["time_s"] for p in pts]
        e = [p["energy_j"] / 1e3 for p in pts]
        if name in curves:
            ct, ce = curves[name]
            ax.step(list(ct), [x / 1e3 for x in ce], where="post", color=colour, lw=1.0, alpha=0.6)
        elif len(pts) > 1:
            ax.plot(t, e, color=colour, lw=1.0, alpha=0.6)
        ax.scatter(t, e, color=colour, marker=marker, s=28, zorder=3, label=f"{label} ({len(pts)})")
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("GPU energy per iteration, all GPUs (kJ)")
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=8, loc="upper right")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_reductions(
    labels: Sequence[str],
    values: Mapping[str, Sequence[float | None]],
    ax: Any,
    *,
    title: str | None = None,
) -> Any:
    """Grouped bars: one group per configuration label, one bar per method (fractions, drawn as %)."""
    n = max(1, len(values))
    width = 0.8 / n
    for k, (name, vals) in enumerate(values.items()):
        label, colour, _ = METHOD_STYLE.get(name, (name, None, "o"))
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(labels))]
        ys = [100 * v if v is not None else 0.0 for v in vals]
        ax.bar(xs, ys, width=width, color=colour, label=label)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(labels)), list(labels))
    ax.set_ylabel("reduction (%)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def save_grid_png(
    path: str | Path, draws: Sequence[Callable[[Any], Any]], ncols: int = 3, panel: tuple[float, float] = (4.6, 3.4)
) -> None:
    """One panel per `draws` entry (each called with its Axes), `ncols` per row, written as PNG (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    nrows = max(1, -(-len(draws) // ncols))
    fig = Figure(figsize=(panel[0] * ncols, panel[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, draw in zip(axes, draws):
        draw(ax)
    for ax in axes[len(draws):]:
        ax.set_visible(False)
    fig.savefig(path, dpi=100)


def save_png(path: str | Path, draw: Callable[[Any], Any], figsize: tuple[float, float] = (7.0, 4.5)) -> None:
    """Create a figure with one Axes, call `draw(ax)`, and write it to `path` as PNG (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    draw(fig.add_subplot(1, 1, 1))
    fig.savefig(path, dpi=120)


def save_frontier_png(
    path: str | Path,
    doc: Mapping[str, Any],
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    title: str | None = None,
) -> None:
    """Write the frontier plot of `doc` to `path` (PNG)."""
    save_png(path, lambda ax: plot_frontier(doc, ax, curves=curves, title=title))
