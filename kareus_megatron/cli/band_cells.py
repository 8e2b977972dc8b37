"""Table cells of bands, shared by `kareus plan` (predicted) and `kareus compare` (measured).

A *band* is ``[low, high]``, the [5th, 95th] percentile (vocab.BAND_PERCENTILES) of a quantity: a point's time
(s) or energy (J), or a reduction (a fraction, 0.23 = 23%). A reduction whose band holds 0 is *not
distinguishable* (ND, "n.d."): the advantage is inside the spread (the model's error for kareus plan, the
iterations' noise for kareus compare). plan/frontier.py computes the bands; this module only prints them.
"""

from __future__ import annotations

from typing import Any

from kareus_megatron.plan.frontier import REDUCTION_KEYS, distinguishable

ND = "n.d."  # not distinguishable: the reduction's band holds 0

REDUCTION_NAMES = {
    "iso_time_energy": "iso-time energy",
    "iso_energy_time": "iso-energy time",
    "max_throughput_time_vs_megatron": "fastest time",
    "max_throughput_energy_vs_megatron": "fastest energy",
}


def fmt_pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal; rounding noise (|x| < 0.05%) prints as 0.0%."""
    return "n/a" if x is None else f"{100 * x + 0.0:.1f}%" if abs(x) >= 5e-4 else "0.0%"


def not_distinguishable(b: list[float] | None) -> bool:
    """The band holds 0 and is not rounding noise around it (the same plan on both sides: |band| < 0.05%)."""
    return b is not None and distinguishable(b) is False and max(abs(b[0]), abs(b[1])) >= 5e-4


def reduction_cell(r: dict[str, Any], key: str) -> str:
    """A reduction with its band: '20.2% [18.1,22.0]', and ' n.d.' when the band holds 0 (a nonzero band)."""
    value, b = r[key], r.get(f"{key}_band")
    if value is None or b is None:
        return fmt_pct(value)
    cell = f"{fmt_pct(value)} [{100 * b[0] + 0.0:.1f},{100 * b[1] + 0.0:.1f}]"
    return cell + f" {ND}" if not_distinguishable(b) else cell


def band_cell(point: dict[str, Any], key: str, factor: float = 1.0, digits: int = 3) -> str:
    """A point's band of `key` (time_s or energy_j) in the table's unit (`factor` times s or J), `digits`
    significant digits: '4.01-4.25'; '-' without one."""
    b = point.get(f"{key}_band")
    return "-" if b is None else f"{b[0] * factor:.{digits}g}-{b[1] * factor:.{digits}g}"


def not_distinguishable_notes(doc: dict[str, Any], why: str) -> list[str]:
    """One line per method whose advantage over a baseline is inside the band (n.d.), naming the reductions;
    `why` says what the band is (e.g. 'draw by draw, holds 0 -- within the model's error')."""
    notes = []
    for name, r in doc["reductions"].items():
        nd = [REDUCTION_NAMES[k] for k in REDUCTION_KEYS if not_distinguishable(r.get(f"{k}_band"))]
        if nd:
            notes.append(
                f"note: {name}: {', '.join(nd)} not distinguishable ({ND}): the band of the difference, {why}."
            )
    return notes
