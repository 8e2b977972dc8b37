"""Plot of a run report: per-iteration time against the prediction, per-stage energy measured vs predicted.

Takes a ``report.against_plan.Comparison``; computes nothing. Iterations are counted from 0 and ticked
at whole numbers; times are drawn in ms or s and energies in J, kJ or MJ, whichever suits the values
(plotting/units.py). matplotlib is imported when called, with the Agg canvas only (no pyplot).
"""

from __future__ import annotations

from typing import Any

from kareus_megatron.plotting.units import energy_unit, time_unit


def plot_run_report(cmp: Any, predicted_time_s: float, title: str = "", axes: Any = None) -> Any:
    """Draw the report on two Axes (made when `axes` is None); return the Figure."""
    from matplotlib.ticker import MaxNLocator

    if axes is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(11, 4))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 2)
    else:
        fig = axes[0].figure
    ax_t, ax_e = axes
    measured_s = [(i, t) for i, t in enumerate(cmp.iteration_time_s) if t is not None]
    tf, tu = time_unit([t for _, t in measured_s] + [predicted_time_s])
    ax_t.plot([i for i, _ in measured_s], [t * tf for _, t in measured_s], "o-", label="measured")
    ax_t.axhline(predicted_time_s * tf, color="C1", linestyle="--", label="predicted")
    if cmp.skipped:
        ax_t.axvspan(-0.5, cmp.skipped - 0.5, color="0.9", label="warm-up (not compared)")
    ax_t.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_t.set_xlabel("iteration")
    ax_t.set_ylabel(f"iteration time ({tu})")
    ax_t.legend()
    stages = sorted(cmp.stage_energy_j)
    width = 0.38
    ef, eu = energy_unit([v for s in stages for v in cmp.stage_energy_j[s]])
    for k, (label, offset) in enumerate((("measured", -width / 2), ("predicted", width / 2))):
        values = [cmp.stage_energy_j[s][k] for s in stages]
        ax_e.bar([s + offset for s in stages], [(v or 0.0) * ef for v in values], width, label=label)
        for s, v in zip(stages, values):
            if v is None:  # no bar is not a zero: say so
                ax_e.text(s + offset, 0, "n/a", ha="center", va="bottom", fontsize=8)
    ax_e.set_xticks(stages, [f"stage {s}" for s in stages])
    ax_e.set_ylabel(f"energy per iteration ({eu})")
    ax_e.margins(y=0.2)  # headroom for the legend
    ax_e.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
