"""Power waveform plot: the job's total power (W, every GPU) over time (s), one step line per curve.

Curves are ``label -> (t_s, power_w)``: bin centres (s) and bin averages (W), e.g. two predicted
iterations of a plan (``kareus plan``'s power.png) or an iteration folded from measured samples against
its prediction (``kareus report``). A label that starts with a planning method's name takes its colour
(plotting/frontier.py); one containing "measured" is drawn solid, others dashed beside it. Axis units scale
with the data (W, kW or MW). matplotlib is imported lazily, Agg canvas only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kareus_megatron.plotting.frontier import METHOD_STYLE, save_png
from kareus_megatron.plotting.units import time_unit

Series = Sequence[float] | np.ndarray  # values, a list or a numpy array
PowerCurves = Mapping[str, tuple[Series, Series]]  # label -> (t_s, power_w)
_POWER_UNITS = ((1e-6, "MW"), (1e-3, "kW"), (1.0, "W"))


def power_unit(values_w: Sequence[float]) -> tuple[float, str]:
    """(factor, unit) for powers given in W: MW from 1e6 W, kW from 1e3 W, else W."""
    top = max((abs(float(v)) for v in values_w), default=0.0)
    for factor, unit in _POWER_UNITS:
        if top * factor >= 1.0:
            return factor, unit
    return _POWER_UNITS[-1]


def _colour(label: str, i: int) -> str:
    for name in sorted(METHOD_STYLE, key=len, reverse=True):
        if label.startswith(name):
            return METHOD_STYLE[name][1]
    return f"C{i}"


def plot_power(curves: PowerCurves, ax: Any, *, title: str | None = None) -> Any:
    """Draw each curve of `curves` as a step line on `ax`; return `ax`. Artists carry gids ``power/LABEL``."""
    all_t = [float(t) for ts, _p in curves.values() for t in ts]
    all_p = [float(p) for _t, ps in curves.values() for p in ps]
    tf, tu = time_unit(all_t)
    pf, pu = power_unit(all_p)
    for i, (label, (ts, ps)) in enumerate(curves.items()):
        style = "-" if "measured" in label or "measured" not in " ".join(curves) else "--"
        (line,) = ax.step(
            [tf * float(t) for t in ts],
            [pf * float(p) for p in ps],
            where="mid",
            color=_colour(label, i),
            linestyle=style,
            linewidth=1.2,
            label=label,
        )
        line.set_gid(f"power/{label}")
    ax.set_xlabel(f"time ({tu})")
    ax.set_ylabel(f"job power, all GPUs ({pu})")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(fontsize=8, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def save_power_png(path: str | Path, curves: PowerCurves, *, title: str | None = None) -> None:
    """Write `curves` as a PNG waveform plot (see plot_power)."""
    save_png(path, lambda ax: plot_power(curves, ax, title=title), figsize=(9.0, 4.0))
