"""Plot of a run report: per-iteration time against the prediction, per-stage energy measured vs predicted.

Takes a ``report.against_plan.Comparison``; computes nothing. matplotlib is imported when called.
"""

from __future__ import annotations

from typing import Any


def plot_run_report(cmp: Any, predicted_time_s: float, title: str = "", axes: Any = None) -> Any:
    """Draw the report on two Axes (made when `axes` is None); return the Figure."""
    import matplotlib

    if axes is None:
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    else:
        fig = axes[0].figure
    ax_t, ax_e = axes
    pts = [(i, t * 1e3) for i, t in enumerate(cmp.iteration_time_s) if t is not None]
    ax_t.plot([i for i, _ in pts], [t for _, t in pts], "o-", label="measured")
    ax_t.axhline(predicted_time_s * 1e3, color="C1", linestyle="--", label="predicted")
    if cmp.skipped:
        ax_t.axvspan(-0.5, cmp.skipped - 0.5, color="0.9", label="warm-up (not compared)")
    ax_t.set_xlabel("iteration")
    ax_t.set_ylabel("iteration time (ms)")
    ax_t.legend()
    stages = sorted(cmp.stage_energy_j)
    width = 0.38
    measured = [cmp.stage_energy_j[s][0] or 0.0 for s in stages]
    predicted = [cmp.stage_energy_j[s][1] or 0.0 for s in stages]
    ax_e.bar([s - width / 2 for s in stages], measured, width, label="measured")
    ax_e.bar([s + width / 2 for s in stages], predicted, width, label="predicted")
    ax_e.set_xticks(stages, [f"stage {s}" for s in stages])
    ax_e.set_ylabel("energy per iteration (J)")
    ax_e.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
