"""What the simulated GPU (hardware/device/sim.py) models beside the power model: its NVML call latency, the
activity of a busy instruction the caller gives none for, and its temperature (a first-order lag toward ambient
SIM_AMBIENT_C plus SIM_RISE_C at the board power limit, time constant SIM_THERMAL_TAU_S).
"""

from __future__ import annotations

import math

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import DeviceUnavailableError

DEFAULT_LATENCY_MS = 15.0
# Activity (fraction of peak) of a busy instruction when the caller gives none: the planner's cost model's
# time-weighted mean over every op of the default job's forward and backward instructions at the maximum
# clock (0.695 compute, 0.308 memory; tests/hardware/test_sim_activity.py recomputes them). The simulator
# sits below the cost model, so it uses these means rather than each op's own activity.
DEFAULT_COMPUTE_ACTIVITY = 0.69
DEFAULT_MEMORY_ACTIVITY = 0.31
# Simulated temperature: a plain first-order lag toward ambient + rise * power / power limit (typical
# air-cooled data-center GPUs idle near 30-35 °C and sit near 70-80 °C at their limit).
SIM_AMBIENT_C = 30.0
SIM_RISE_C = 45.0
SIM_THERMAL_TAU_S = 20.0


def latency_from_env() -> float:
    """Simulated NVML call latency (s) from KAREUS_SIMULATED_LATENCY_MS (default 15 ms)."""
    raw = kareus_settings().simulated_latency_ms
    if raw is None or raw == "":
        return DEFAULT_LATENCY_MS / 1000.0
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms >= 0:
        raise DeviceUnavailableError(
            f"KAREUS_SIMULATED_LATENCY_MS={raw!r} is not a non-negative number of milliseconds; e.g. 15"
        )
    return ms / 1000.0


def steady_temperature_c(power_w: float, power_limit_w: float) -> float:
    """The temperature (°C) a GPU drawing `power_w` W steadily settles at, its board limit `power_limit_w` W."""
    return SIM_AMBIENT_C + SIM_RISE_C * power_w / power_limit_w


def lagged_temperature_c(temp_c: float, target_c: float, dt_s: float) -> float:
    """The temperature (°C) `dt_s` seconds after `temp_c`, moving toward `target_c` (first-order lag)."""
    return target_c + (temp_c - target_c) * math.exp(-dt_s / SIM_THERMAL_TAU_S)
