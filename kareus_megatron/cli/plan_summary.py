"""`kareus plan`'s printed summary: the frontier ends, the prediction bands, the reductions and where the outputs went.

Bands (frontier.json ``*_band``): the [5th, 95th] percentile over the cost model's parameter draws
(plan/frontier.py); a reduction whose band holds 0 prints "not distinguishable" (n.d.).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kareus_megatron.cli.band_cells import band_cell, not_distinguishable_notes, reduction_cell
from kareus_megatron.plan.frontier import REDUCTION_KEYS
from kareus_megatron.plotting.units import energy_unit, time_unit
from kareus_megatron.vocab import FRAMEWORK_DEEPSPEED, MEGATRON, PERSEUS


def _swing_cell(fast: dict[str, Any], slow: dict[str, Any]) -> str:
    """Predicted power swing of the fastest and the least-energy plan, as % of each one's peak."""

    def pct(p: dict[str, Any]) -> str:
        return f"{100 * p['swing_w'] / p['peak_power_w']:.0f}" if p.get("peak_power_w") else "n/a"

    return pct(fast) if fast is slow else f"{pct(fast)} / {pct(slow)}"


def _bands_table(doc: dict[str, Any], tf: float, tu: str, ef: float, eu: str) -> Any:
    """The table of the frontier ends' bands (None when the document has none)."""
    from rich import box
    from rich.table import Table

    record = doc.get("bands")
    if not record:
        return None
    lo, hi = record["percentiles"]
    table = Table(
        title=f"bands: {lo:g}th-{hi:g}th percentile over {record['draws']} draws of the model's parameters",
        box=box.SIMPLE,
    )
    table.add_column("method", no_wrap=True)
    for col in (f"fastest ({tu})", f"({eu})", f"min-energy ({tu})", f"({eu})"):
        table.add_column(col, justify="right")
    for name, entry in doc["methods"].items():
        fast, slow = entry["points"][0], entry["points"][-1]
        table.add_row(
            name,
            band_cell(fast, "time_s", tf),
            band_cell(fast, "energy_j", ef),
            band_cell(slow, "time_s", tf),
            band_cell(slow, "energy_j", ef),
        )
    return table


def quantity(value: float, unit_of: Callable[[Iterable[float | None]], tuple[float, str]]) -> str:
    """`value` (s or J) in the unit plotting/units.py picks for it, e.g. '5.223 ms', '2.2 J', '1.313 MJ'."""
    factor, unit = unit_of([value])
    return f"{value * factor:.4g} {unit}"


def na_notes(doc: dict[str, Any]) -> list[str]:
    """Why a reduction reads n/a: the method has no plan as fast as (or as frugal as) Perseus's, by how much."""
    perseus = doc["methods"][PERSEUS]["points"]
    t_ref, e_ref = perseus[0]["time_s"], min(p["energy_j"] for p in perseus)
    notes = []
    for name, entry in doc["methods"].items():
        if name == MEGATRON:  # the one-plan baseline: its iso-energy n/a is by construction
            continue
        pts, r = entry["points"], doc["reductions"][name]
        if r["iso_time_energy"] is None:
            dt = pts[0]["time_s"] - t_ref
            notes.append(
                f"note: {name} iso-time energy n/a: its fastest plan is {quantity(dt, time_unit)} "
                f"({100 * dt / t_ref:.2g}%) slower than Perseus's fastest, so it has no plan at that time."
            )
        if r["iso_energy_time"] is None:
            de = min(p["energy_j"] for p in pts) - e_ref
            notes.append(
                f"note: {name} iso-energy time n/a: its least-energy plan uses {quantity(de, energy_unit)} "
                f"({100 * de / e_ref:.2g}%) more than Perseus's, so it has no plan at that energy."
            )
    return notes


def print_summary(
    doc: dict[str, Any],
    out: Path,
    built: list[Any],
    chosen: Any,
    elapsed_s: float,
    suggested: bool = True,
    objective: str = "iso-time",
    robust: bool = False,
    figures: bool = True,
) -> None:
    """Print the per-method frontier ends, the reductions, and where the outputs went (figures: the PNGs too)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    cfg = doc["config"]
    console = Console()
    console.print(f"[bold]{cfg['model']}[/] on {cfg['nodes']} × {cfg['gpus_per_node']} {cfg['gpu']}")
    console.print(
        f"TP={cfg['tp']} CP={cfg['cp']} PP={cfg['pp']} VP={cfg['vp']} DP={cfg['dp']}, MBS {cfg['micro_batch_size']}, "
        f"seq {cfg['seq_length']}, {cfg['num_microbatches']} microbatches, {cfg['schedule']}"
    )
    ends = Table(title="frontier ends (model predictions; energy = all GPUs per iteration)", box=box.SIMPLE)
    ends.add_column("method", no_wrap=True)
    ends_pts = [p for entry in doc["methods"].values() for p in (entry["points"][0], entry["points"][-1])]
    tf, tu = time_unit(p["time_s"] for p in ends_pts)  # ms for a small model's plans, else s
    ef, eu = energy_unit(p["energy_j"] for p in ends_pts)  # J, kJ or MJ: never a column of 0.00
    for col in ("plans", f"fastest ({tu})", f"({eu})", f"min-energy ({tu})", f"({eu})", "swing (% peak)"):
        ends.add_column(col, justify="right")
    red = Table(
        title="reductions: iso-* vs Perseus's frontier, fastest plan vs Megatron (+ = better)"
        + (" \\[band]" if doc.get("bands") else ""),
        box=box.SIMPLE,
    )
    red.add_column("method", no_wrap=True)
    for col in ("iso-time energy", "iso-energy time", "fastest time", "fastest energy"):
        red.add_column(col, justify="right")
    for name, entry in doc["methods"].items():
        pts = entry["points"]
        r = doc["reductions"][name]
        fast, slow = pts[0], pts[-1]
        ends.add_row(
            name,
            str(len(pts)),
            f"{fast['time_s'] * tf:.3f}",
            f"{fast['energy_j'] * ef:.2f}",
            f"{slow['time_s'] * tf:.3f}",
            f"{slow['energy_j'] * ef:.2f}",
            _swing_cell(fast, slow),
        )
        red.add_row(name, *(reduction_cell(r, key) for key in REDUCTION_KEYS))
    console.print(ends)
    bands = _bands_table(doc, tf, tu, ef, eu)
    if bands is not None:
        console.print(bands)
    console.print(red)
    for line in not_distinguishable_notes(doc, "draw by draw, holds 0 -- within the model's error"):
        console.print(line, highlight=False, soft_wrap=True)
    for line in na_notes(doc):
        console.print(line, highlight=False, soft_wrap=True)
    pngs = "frontier.png, power.png, timeline.png and " if figures else ""
    console.print(
        f"wrote {out}/frontier.json, {len(built)} plans in {out}/plans/, {pngs}timeline.trace.json ({chosen.name}) "
        f"in {elapsed_s:.1f} s"
    )
    runner = "kareus_megatron.deepspeed" if cfg.get("framework") == FRAMEWORK_DEEPSPEED else "kareus_megatron.launch"
    console.print(
        f"run a plan: torchrun ... -m {runner} --kareus-plan {out} --kareus-point {chosen.name} "
        "-- your_training_script.py ...",
        highlight=False,
        soft_wrap=True,
    )
    console.print(_suggestion(chosen.name, suggested, objective, robust), highlight=False, soft_wrap=True)


def _suggestion(name: str, suggested: bool, objective: str, robust: bool) -> str:
    """The line that says why `name` is the plan drawn and suggested."""
    if not suggested:
        return f"{name}: the plan named by --timeline"
    across = " across the band (95th percentiles, --robust)" if robust else ""
    if objective == "iso-time":
        return f"{name} is the iso-time plan (Megatron's speed{across}, least predicted energy)" + (
            "" if robust else ", which --kareus-point picks by default"
        )
    return f"{name} meets --objective {objective}{across}"
