"""Iteration time–energy frontier plot: each method's Pareto frontier as a step line, its plans as points.

Input is a ``kareus-frontier/1`` document (the object ``kareus plan`` writes as frontier.json and
``kareus compare`` builds from measured logs): time = iteration time (s), energy = GPU energy of the
whole job per iteration (J). The line of a method goes through exactly its non-dominated points (its
Pareto set: no other point is both no slower and no costlier); points another point of the same method
dominates (a measured run can land there) are drawn faint, off the line. Axis units scale with the data
(ms or s, J, kJ or MJ; plotting/units.py). matplotlib is imported lazily and only with the Agg canvas,
so importing this module costs nothing and never opens a window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kareus_megatron.plotting.units import energy_unit, time_unit
from kareus_megatron.vocab import KAREUS, MEGATRON, NANOBATCH_PERSEUS, PERSEUS, POWERCAP, SOLVE

# Fixed colours and labels so every figure of the project reads the same way; a label starts with the
# method's CLI name (vocab.py) so a legend reads like the `--methods` flag and the frontier.json keys.
METHOD_STYLE: dict[str, tuple[str, str, str]] = {
    # name: (label, colour, marker)
    MEGATRON: (MEGATRON, "#7f7f7f", "s"),
    PERSEUS: (PERSEUS, "#1f77b4", "o"),
    NANOBATCH_PERSEUS: (NANOBATCH_PERSEUS, "#ff7f0e", "^"),
    KAREUS: (f"{KAREUS} (joint)", "#d62728", "D"),
    POWERCAP: (f"{POWERCAP} (one power limit)", "#9467bd", "P"),
    SOLVE: (SOLVE, "#2ca02c", "v"),
}

Curves = Mapping[str, tuple[Sequence[float], Sequence[float]]]


def method_label(name: str) -> str:
    """Legend name of a planning method: its CLI name, maybe with a short description after it."""
    return METHOD_STYLE.get(name, (name, "", ""))[0]


def pareto_points(time_s: Sequence[float], energy_j: Sequence[float]) -> list[tuple[float, float]]:
    """The non-dominated (time s, energy J) points, fastest first (energy strictly decreasing)."""
    import numpy as np

    from kareus_megatron.search.frontier import pareto_indices

    keep = pareto_indices(np.asarray(time_s, dtype=float), np.asarray(energy_j, dtype=float))
    return [(float(time_s[i]), float(energy_j[i])) for i in keep]


def _same(p: tuple[float, float], q: tuple[float, float], rel_tol: float = 1e-9) -> bool:
    """Whether two (time s, energy J) points agree to `rel_tol` (a written plan re-simulated vs the search's)."""
    return all(abs(a - b) <= rel_tol * max(abs(a), abs(b)) for a, b in zip(p, q))


def _same_points(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> bool:
    """Whether two frontiers (time s, energy J; fastest first) are the same points, so one hides the other."""
    return len(a) == len(b) and all(_same(p, q, rel_tol=1e-6) for p, q in zip(a, b))


def plot_frontier(
    doc: Mapping[str, Any],
    ax: Any,
    *,
    curves: Curves | None = None,
    title: str | None = None,
    legend: bool = True,
    bands: bool = False,
) -> Any:
    """Draw each method's frontier of a frontier document on `ax`; return `ax`.

    `curves` optionally maps a method to every plan its search found (time s, energy J); the method's
    line is then the Pareto set of those and its written points, else of its written points alone.
    Artists carry gids ``frontier/NAME`` (the line), ``points/NAME``, ``dominated/NAME`` and, with `bands`,
    ``bands/NAME``: a cross per point that carries bands (``time_s_band``, ``energy_j_band``) spanning them.
    `kareus compare` draws its measured bands (each run's own noise); `kareus plan` does not draw its prediction
    bands: one parameter draw moves every method alike, so crosses per point would show overlaps that the
    reductions' own (much narrower) bands rule out.
    """
    curves = curves or {}
    methods: Mapping[str, Any] = doc["methods"]
    times = [p["time_s"] for m in methods.values() for p in m["points"]]
    energies = [p["energy_j"] for m in methods.values() for p in m["points"]]
    for ct, ce in curves.values():
        times.extend(ct)
        energies.extend(ce)
    tf, tu = time_unit(times)
    ef, eu = energy_unit(energies)
    what = "runs" if doc.get("config", {}).get("source") == "measured" else "plans"
    fronts = {}
    for name, entry in methods.items():
        pts = [(float(p["time_s"]), float(p["energy_j"])) for p in entry["points"]]
        ct, ce = curves.get(name, ((), ()))
        fronts[name] = (pts, pareto_points([t for t, _ in pts] + list(ct), [e for _, e in pts] + list(ce)))
    order = list(methods)
    for k, name in enumerate(order):
        label, colour, marker = METHOD_STYLE.get(name, (name, None, "o"))
        pts, front = fronts[name]
        # a frontier another method's, drawn later, covers exactly: the legend says so (it is not missing)
        over = [METHOD_STYLE.get(m, (m,))[0] for m in order[k + 1 :] if _same_points(front, fronts[m][1])]
        suffix = f" (same frontier as {' and '.join(over)}, drawn under it)" if over else ""
        kept = [p for p in pts if any(_same(p, q) for q in front)]
        dominated = [p for p in pts if not any(_same(p, q) for q in front)]
        if len(front) > 1:
            ax.step(
                [t * tf for t, _ in front],
                [e * ef for _, e in front],
                where="post",
                color=colour,
                lw=1.0,
                alpha=0.7,
                gid=f"frontier/{name}",
            )
        ax.scatter(
            [t * tf for t, _ in kept],
            [e * ef for _, e in kept],
            color=colour,
            marker=marker,
            s=28,
            zorder=3,
            label=f"{label}: {len(pts)} {what if len(pts) != 1 else what[:-1]}{suffix}",
            gid=f"points/{name}",
        )
        if dominated:
            ax.scatter(
                [t * tf for t, _ in dominated],
                [e * ef for _, e in dominated],
                color=colour,
                marker=marker,
                s=22,
                alpha=0.25,
                zorder=2,
                gid=f"dominated/{name}",
            )
    from matplotlib.collections import LineCollection

    banded = False
    for name, entry in methods.items() if bands else ():
        segments = band_segments(entry["points"], tf, ef)
        if segments:
            banded = True
            colour = METHOD_STYLE.get(name, (name, None))[1]
            bars = LineCollection(segments, colors=colour, linewidths=0.8, alpha=0.45, gid=f"bands/{name}")
            ax.add_collection(bars, autolim=True)
    if banded:
        ax.autoscale_view()
    ax.set_xlabel(f"iteration time ({tu})")
    ax.set_ylabel(f"GPU energy per iteration, all GPUs ({eu})")
    ax.grid(True, alpha=0.3)
    if legend:
        notes = []
        if any(a.get_gid() and a.get_gid().startswith("dominated/") for a in ax.collections):
            notes.append("faint: dominated")
        if banded:
            lo, hi = doc.get("bands", {}).get("percentiles", (5, 95))
            notes.append(f"bars: {lo:g}th-{hi:g}th percentile band")
        ax.legend(fontsize=8, loc="upper right", title="; ".join(notes) or None, title_fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_reductions(
    labels: Sequence[str], values: Mapping[str, Sequence[float | None]], ax: Any, *, title: str | None = None
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
    for ax in axes[len(draws) :]:
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


def band_segments(
    points: Sequence[Mapping[str, Any]], time_factor: float = 1.0, energy_factor: float = 1.0
) -> list[list[tuple[float, float]]]:
    """Line segments of the band crosses of `points` (a horizontal one over ``time_s_band`` at the point's energy, a
    vertical one over ``energy_j_band`` at its time; each where that band is given), in the plot's units."""
    out = []
    for p in points:
        t, e = float(p["time_s"]) * time_factor, float(p["energy_j"]) * energy_factor
        if p.get("time_s_band"):
            lo, hi = p["time_s_band"]
            out.append([(float(lo) * time_factor, e), (float(hi) * time_factor, e)])
        if p.get("energy_j_band"):
            lo, hi = p["energy_j_band"]
            out.append([(t, float(lo) * energy_factor), (t, float(hi) * energy_factor)])
    return out


def save_frontier_png(
    path: str | Path,
    doc: Mapping[str, Any],
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    title: str | None = None,
    bands: bool = False,
) -> None:
    """Write the frontier plot of `doc` to `path` (PNG); `curves` and `bands` as for plot_frontier."""
    save_png(path, lambda ax: plot_frontier(doc, ax, curves=curves, title=title, bands=bands))
