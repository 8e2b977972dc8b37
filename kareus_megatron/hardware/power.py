"""GPU board power (W) as a function of the SM clock (MHz) and of compute and memory activity (0..1).

Model (parameters in GPUSpec, presets in gpus.toml):

    P_raw(f) = static + (f / f_max) * v(f)^2 * (idle_dynamic + compute_dynamic * compute_activity)
               + memory_dynamic * memory_activity
    P(f)     = min(P_raw(f), power_limit)

*v(f)* is the core voltage relative to its value at f_max: flat at ``voltage_floor`` up to
``voltage_knee_mhz`` and rising linearly to 1 at f_max (the corner is rounded over ~25 MHz so that the
curve is smooth for fitting). *compute_activity* is the fraction of SM issue capacity in use,
*memory_activity* the fraction of peak HBM bandwidth in use. When P_raw at the locked clock exceeds the
board limit, the driver lowers the clock until power equals the limit: ``sustained_clock_mhz``.
Everything is numpy and broadcasts over its array arguments.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from kareus_megatron.hardware.gpus import GPUSpec

_KNEE_WIDTH_MHZ = 25.0
_NEWTON_MAX_STEPS = 60  # a bound only: from any clock to 1e-9 MHz takes under 10 (tests/hardware/test_gpus.py)
_TINY_W_PER_MHZ = 1e-300  # a slope of 0 (no clock-dependent power) steps to the lowest clock


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def relative_voltage(spec: GPUSpec, sm_clock_mhz: ArrayLike) -> np.ndarray:
    """Core voltage at sm_clock_mhz (MHz) relative to the voltage at the max clock (dimensionless)."""
    f = np.asarray(sm_clock_mhz, dtype=float)
    fmax = float(spec.max_sm_clock_mhz)
    knee = min(float(spec.voltage_knee_mhz), fmax - 1.0)
    w = _KNEE_WIDTH_MHZ
    ramp = _softplus((f - knee) / w) / _softplus(np.asarray((fmax - knee) / w))
    return spec.voltage_floor + (1.0 - spec.voltage_floor) * ramp


def raw_power_w(
    spec: GPUSpec, sm_clock_mhz: ArrayLike, compute_activity: ArrayLike, memory_activity: ArrayLike
) -> np.ndarray:
    """Power (W) the board would draw at sm_clock_mhz (MHz) if no power limit applied."""
    f = np.asarray(sm_clock_mhz, dtype=float)
    ca = np.clip(np.asarray(compute_activity, dtype=float), 0.0, 1.0)
    ma = np.clip(np.asarray(memory_activity, dtype=float), 0.0, 1.0)
    v = relative_voltage(spec, f)
    dyn = (f / spec.max_sm_clock_mhz) * v * v * (spec.idle_dynamic_w + spec.compute_dynamic_w * ca)
    return spec.static_power_w + dyn + spec.memory_dynamic_w * ma


def power_w(
    spec: GPUSpec, sm_clock_mhz: ArrayLike, compute_activity: ArrayLike, memory_activity: ArrayLike
) -> np.ndarray:
    """Board power (W) at a locked sm_clock_mhz (MHz) and activities (0..1), clamped at the board limit."""
    return np.minimum(raw_power_w(spec, sm_clock_mhz, compute_activity, memory_activity), spec.power_limit_w)


def sustained_clock_mhz(
    spec: GPUSpec, sm_clock_mhz: ArrayLike, compute_activity: ArrayLike, memory_activity: ArrayLike
) -> np.ndarray:
    """SM clock (MHz) actually reached when locked at sm_clock_mhz: lowered until power ≤ the board limit, but not
    below the lowest supported clock (the driver's power capping stops there; a load that still draws more than a
    low power limit at that clock runs over it, as NVML documents for limits below what the load needs).

    Newton's method on the elements over the limit only, from the locked clock down: raw power is increasing and
    convex in the clock (clock × voltage², the voltage convex and increasing), so each step lands at or above the
    root and the iterates fall to it, quadratically near it, stopping at the lowest clock. An element stops once a
    step no longer changes it; the loop ends when none changes, so each element's result depends on its own inputs
    only (a scalar call gives what a vector call gives it). It is the planner's hottest loop: 40 rounds of
    bisection took 30% of the default `kareus plan` (2026-12-07); this takes about 6 and agrees with that bisection
    within its resolution (1e-9 MHz)."""
    f = np.asarray(sm_clock_mhz, dtype=float)
    ca = np.asarray(compute_activity, dtype=float)
    ma = np.asarray(memory_activity, dtype=float)
    f, ca, ma = np.broadcast_arrays(f, ca, ma)
    over = raw_power_w(spec, f, ca, ma) > spec.power_limit_w
    if not np.any(over):
        return f.astype(float, copy=True)
    out = np.broadcast_to(f, over.shape).astype(float, copy=True)  # spec fields may be arrays (parameter draws)

    def sub(x: ArrayLike) -> np.ndarray | float:
        """x on the over elements (x broadcast against them first); a scalar stays one (same values)."""
        a = np.asarray(x, dtype=float)
        return float(a) if a.ndim == 0 else np.broadcast_to(a, over.shape)[over]

    # raw_power_w's terms on the over elements: static + (m / f_max) * v(m)^2 * load + memory
    load = sub(spec.idle_dynamic_w) + sub(spec.compute_dynamic_w) * np.clip(sub(ca), 0.0, 1.0)
    memory = sub(spec.memory_dynamic_w) * np.clip(sub(ma), 0.0, 1.0)
    static, floor, limit = sub(spec.static_power_w), sub(spec.voltage_floor), sub(spec.power_limit_w)
    fmax = float(spec.max_sm_clock_mhz)
    knee = min(float(spec.voltage_knee_mhz), fmax - 1.0)
    w = _KNEE_WIDTH_MHZ
    ramp_scale = _softplus(np.asarray((fmax - knee) / w))
    m = out[over]
    lowest = np.minimum(m, sub(spec.min_sm_clock_mhz))  # returned where even it draws more than the limit
    for _ in range(_NEWTON_MAX_STEPS):
        x = (m - knee) / w
        soft = _softplus(x)
        v = floor + (1.0 - floor) * (soft / ramp_scale)
        dv = (1.0 - floor) * (np.exp(x - soft) / (ramp_scale * w))  # the logistic function: softplus's slope
        excess = static + (m / fmax) * v * v * load + memory - limit
        slope = np.maximum((load / fmax) * (v * v + 2.0 * m * v * dv), _TINY_W_PER_MHZ)
        step = np.maximum(np.minimum(m, m - excess / slope), lowest)  # never up, never below the lowest clock
        if np.array_equal(step, m):
            break
        m = step
    out[over] = m
    return out
