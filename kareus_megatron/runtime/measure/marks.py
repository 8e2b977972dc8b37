"""Measurement points (marks): the clock client's ticket (.done, .wait, .t, .energy_j and .info, the controller's
answer, filled off the training thread) or, on a CPU without a client, a bare ``time.monotonic()``; what the meter
(runtime/measure/measurement.py) reads of them.
"""

from __future__ import annotations

import math
import time
from typing import Any


def resolved(point: Any) -> bool:
    """Whether `point` has its answer (a bare time always has)."""
    return isinstance(point, float) or point.done


def wait_for(point: Any, deadline: float) -> bool:
    """Whether `point` has resolved, waiting for it until `deadline` (time.monotonic(), s)."""
    if resolved(point):
        return True
    left = deadline - time.monotonic()
    return left > 0 and bool(point.wait(left))


def resolve(point: Any, timeout_s: float = 0.0) -> tuple[float, float]:
    """(time s, energy J) of a measurement point: a ticket (.wait/.t/.energy_j) or a bare time."""
    if isinstance(point, float):
        return point, math.nan
    if point.wait(timeout_s) and point.t is not None:
        return float(point.t), float(point.energy_j)
    return math.nan, math.nan


def finite(x: Any) -> float | None:
    """`x` as a float for a line of the run log, None when it is no finite number (NaN: an unresolved mark)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return None
    return None if (math.isnan(x) or math.isinf(x)) else float(x)


def count_growth(info0: dict[str, Any], info1: dict[str, Any], key: str) -> int | None:
    """How much the controller's running count `key` grew between two mark answers (None: unknown)."""
    a, b = info0.get(key), info1.get(key)
    return b - a if isinstance(a, int) and isinstance(b, int) and b >= a else None
