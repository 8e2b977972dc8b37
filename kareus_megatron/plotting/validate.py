"""Plot of a `kareus validate` report: measured kernels against the preset (and the fit), clock latency.

Takes the report dict (cost/gpu_validate.py, kareus-validate/1); computes nothing but ratios to draw.
Full mode: time per call relative to the highest clock, power (W) against the SM clock (MHz), and the
clock-change latency (ms) per locked clock. Read-only: time and power of each kernel, measured against
the preset at the clock the GPU ran at. matplotlib is imported when called, with the Agg canvas only.
"""

from __future__ import annotations

from typing import Any


def plot_validation(report: dict[str, Any]) -> Any:
    """Draw the report on a new Figure and return it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    full = report["mode"] == "full"
    fig = Figure(figsize=(15 if full else 10, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3 if full else 2)
    kernels = report["kernels"]
    if full:
        _curves(axes[0], axes[1], kernels)
        _latency(axes[2], report.get("lock_reset", {}))
    else:
        _bars(axes[0], axes[1], kernels)
    dry = ", dry run (simulated GPU, CPU kernels)" if report["dry_run"] else ""
    fig.suptitle(
        f"kareus validate, {report['mode'].replace('_', '-')} on {report['identity']['name']} "
        f"(preset {report['gpu']}){dry}"
    )
    fig.tight_layout()
    return fig


def _curves(ax_t: Any, ax_p: Any, kernels: dict[str, Any]) -> None:
    for i, (name, row) in enumerate(kernels.items()):
        color = f"C{i}"
        f = row["clocks_mhz"]
        if name != "idle":
            top = row["time_s"][-1]  # clocks ascend: the last is the highest
            ax_t.plot(f, [t / top for t in row["time_s"]], "o", color=color, label=f"{name} measured")
            ax_t.plot(
                f,
                [t / row["preset_time_s"][-1] for t in row["preset_time_s"]],
                "--",
                color=color,
                label=f"{name} preset",
            )
            if "calibrated_time_s" in row:
                ax_t.plot(
                    f, [t / row["calibrated_time_s"][-1] for t in row["calibrated_time_s"]], "-", color=color, alpha=0.6
                )
        ax_p.plot(f, row["power_w"], "o", color=color, label=f"{name} measured")
        ax_p.plot(f, row["preset_power_w"], "--", color=color, label=f"{name} preset")
        if "calibrated_power_w" in row:
            ax_p.plot(f, row["calibrated_power_w"], "-", color=color, alpha=0.6)
    ax_t.set_xlabel("SM clock (MHz)")
    ax_t.set_ylabel("time per call / time at the highest clock")
    ax_t.set_title("time (dots measured, dashed preset, solid fitted)", fontsize=9)
    ax_t.legend(fontsize=7)
    ax_p.set_xlabel("SM clock (MHz)")
    ax_p.set_ylabel("average power (W)")
    ax_p.set_title("power", fontsize=9)
    ax_p.legend(fontsize=7)


def _latency(ax: Any, lock: dict[str, Any]) -> None:
    rows = lock.get("clocks", [])
    ok = [r for r in rows if r["applied_s"] is not None]
    ax.plot([r["mhz"] for r in ok], [r["applied_s"] * 1e3 for r in ok], "o", label="call to applied")
    ax.plot([r["mhz"] for r in rows], [r["call_s"] * 1e3 for r in rows], "x", label="call returns")
    missed = [r["mhz"] for r in rows if r["applied_s"] is None]
    if missed:
        ax.plot(missed, [0.0] * len(missed), "v", color="C3", label="not applied in time")
    ax.set_xlabel("locked SM clock (MHz)")
    ax.set_ylabel("clock-change latency (ms)")
    ax.set_title(f"lock/reset: {lock.get('locked_ok', 0)}/{lock.get('tried', 0)} clocks read back", fontsize=9)
    ax.legend(fontsize=7)


def _bars(ax_t: Any, ax_p: Any, kernels: dict[str, Any]) -> None:
    names = [n for n in kernels if n != "idle"]
    width = 0.38
    x = range(len(names))
    ax_t.bar([i - width / 2 for i in x], [kernels[n]["time_s"][0] * 1e3 for n in names], width, label="measured")
    ax_t.bar([i + width / 2 for i in x], [kernels[n]["preset_time_s"][0] * 1e3 for n in names], width, label="preset")
    ax_t.set_xticks(list(x), [f"{n}\n{kernels[n]['clocks_mhz'][0]} MHz" for n in names])
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per call (ms)")
    ax_t.legend()
    allk = list(kernels)
    xa = range(len(allk))
    ax_p.bar([i - width / 2 for i in xa], [kernels[n]["power_w"][0] for n in allk], width, label="measured")
    ax_p.bar([i + width / 2 for i in xa], [kernels[n]["preset_power_w"][0] for n in allk], width, label="preset")
    ax_p.set_xticks(list(xa), allk)
    ax_p.set_ylabel("average power (W)")
    ax_p.legend()
