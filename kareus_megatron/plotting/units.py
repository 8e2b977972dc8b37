"""Axis units that scale with the data: ms or s for times, J, kJ or MJ for energies.

Each chooser takes the values in the base unit (s, J) and returns ``(factor, unit)``: multiply a
value by `factor` to draw it in `unit`. The unit is the largest one in which the largest magnitude
drawn is still at least 1, so tick labels read 1 to 999 rather than 0.004 or 24000.
"""

from __future__ import annotations

from collections.abc import Iterable

_TIME_UNITS: tuple[tuple[float, str], ...] = ((1.0, "s"), (1e3, "ms"))
_ENERGY_UNITS: tuple[tuple[float, str], ...] = ((1e-6, "MJ"), (1e-3, "kJ"), (1.0, "J"))


def _choose(values: Iterable[float | None], units: tuple[tuple[float, str], ...]) -> tuple[float, str]:
    top = max((abs(v) for v in values if v is not None), default=0.0)
    for factor, unit in units:
        if top * factor >= 1.0:
            return factor, unit
    return units[-1]


def time_unit(values_s: Iterable[float | None]) -> tuple[float, str]:
    """(factor, unit) for times given in s: ms when every value is under 1 s, else s."""
    return _choose(values_s, _TIME_UNITS)


def energy_unit(values_j: Iterable[float | None]) -> tuple[float, str]:
    """(factor, unit) for energies given in J: MJ from 1e6 J, kJ from 1e3 J, else J."""
    return _choose(values_j, _ENERGY_UNITS)
