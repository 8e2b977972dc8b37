"""Pipeline timeline (Gantt chart) of one plan: a row per pipeline rank, a bar per instruction.

A *bar* is one executed pipeline instruction: its rank, start and end (s from the iteration start),
locked SM clock (MHz, the bar's colour, on a scale from the plan's lowest to its highest clock), kind
(forward/backward), microbatch, virtual chunk and nanobatch count (2 nanobatches are hatched). The bars
come from the planner's event simulation; this module only draws them (and exports them as a Perfetto
trace). matplotlib is imported lazily (Agg canvas only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus_megatron.plotting.frontier import save_png
from kareus_megatron.plotting.units import time_unit


@dataclass(frozen=True, kw_only=True, slots=True)
class Bar:
    """One instruction on the timeline; times in s from the start of the iteration, clock in MHz."""

    rank: int
    start_s: float
    end_s: float
    clock_mhz: int
    kind: str
    microbatch: int
    chunk: int = 0
    nanobatches: int = 1


def plot_timeline(
    bars: Sequence[Bar], ax: Any, *, clock_range_mhz: tuple[int, int] | None = None, title: str | None = None
) -> Any:
    """Draw `bars` on `ax`, coloured by SM clock (MHz) with a colour bar in MHz; return `ax`.

    The colour scale spans the bars' own lowest to highest clock (MHz), so the plan's clock choices
    stand apart; `clock_range_mhz` overrides it (e.g. to draw several plans on one scale). The time
    axis is in ms or s, whichever suits the iteration's length.
    """
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator

    if not bars:
        raise ValueError("a timeline needs at least one instruction")
    clocks = [b.clock_mhz for b in bars]
    lo, hi = clock_range_mhz or (min(clocks), max(clocks))
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    norm = Normalize(vmin=lo, vmax=hi)
    cmap = colormaps["viridis"]
    ranks = sorted({b.rank for b in bars})
    span = max(b.end_s for b in bars) - min(b.start_s for b in bars)
    tf, tu = time_unit([b.end_s for b in bars])
    for b in bars:
        width = b.end_s - b.start_s
        ax.barh(
            b.rank,
            width * tf,
            left=b.start_s * tf,
            height=0.8,
            color=cmap(norm(b.clock_mhz)),
            edgecolor="black",
            linewidth=0.4,
            hatch="///" if b.nanobatches > 1 else None,
        )
        if width > span / 60:
            tag = ("F" if b.kind == "forward" else "B") + str(b.microbatch)
            if b.chunk:
                tag += f".{b.chunk}"
            shade = norm(b.clock_mhz)
            ax.text(
                (b.start_s + width / 2) * tf,
                b.rank,
                tag,
                ha="center",
                va="center",
                fontsize=6,
                color="white" if shade < 0.6 else "black",
                bbox={"facecolor": cmap(shade), "edgecolor": "none", "pad": 0.6},  # readable over the hatch
            )
    ax.set_yticks(ranks, [f"stage {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"time in iteration ({tu})")
    sm = ScalarMappable(norm=norm, cmap=cmap)
    cbar = ax.figure.colorbar(sm, ax=ax, label="SM clock (MHz)", pad=0.01)
    distinct = sorted(set(clocks))
    if len(distinct) <= 6 and clock_range_mhz is None:
        cbar.set_ticks(spaced_ticks(distinct))  # few clocks: tick the ones the plan locks, never overlapping
    else:
        cbar.locator = MaxNLocator(nbins=6, integer=True)
        cbar.update_ticks()
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def spaced_ticks(values_mhz: Sequence[int], min_gap_fraction: float = 0.08) -> list[int]:
    """The sorted clocks (MHz) a colour bar can label without overlap: the lowest and the highest, and each other
    clock at least `min_gap_fraction` of the range away from its labelled neighbours (1395/1410 next to 1980: one)."""
    vals = sorted(set(values_mhz))
    if len(vals) <= 2:
        return vals
    gap = min_gap_fraction * (vals[-1] - vals[0])
    kept = [vals[0]]
    for v in vals[1:-1]:
        if v - kept[-1] >= gap and vals[-1] - v >= gap:
            kept.append(v)
    return [*kept, vals[-1]]


def trace_events(bars: Sequence[Bar], name: str = "plan") -> dict[str, Any]:
    """The bars as a Chrome/Perfetto trace (open in ui.perfetto.dev): one thread per pipeline rank, times in µs."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for r in sorted({b.rank for b in bars}):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"stage {r}"}})
    for b in bars:
        events.append(
            {
                "name": f"{'F' if b.kind == 'forward' else 'B'}{b.microbatch}" + (f".{b.chunk}" if b.chunk else ""),
                "ph": "X",
                "pid": 0,
                "tid": b.rank,
                "ts": b.start_s * 1e6,
                "dur": (b.end_s - b.start_s) * 1e6,
                "args": {
                    "kind": b.kind,
                    "microbatch": b.microbatch,
                    "chunk": b.chunk,
                    "sm_clock_mhz": b.clock_mhz,
                    "nanobatches": b.nanobatches,
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_timeline_png(
    path: str | Path, bars: Sequence[Bar], clock_range_mhz: tuple[int, int] | None = None, title: str | None = None
) -> None:
    """Write the timeline of `bars` to `path` (PNG); hatched bars run 2 nanobatches."""
    rows = len({b.rank for b in bars})
    save_png(
        path,
        lambda ax: plot_timeline(bars, ax, clock_range_mhz=clock_range_mhz, title=title),
        figsize=(10.0, 1.2 + 0.6 * rows),
    )
