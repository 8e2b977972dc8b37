"""The simulated GPU's per-edge busy power override and truth power model (hardware/device/sim.py).

Edges are given at past times (after the device opened, before now), so every reading is of the past."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.gpus import gpu_spec

NAN = math.nan
MS = 1e-3


def _opened() -> tuple[SimulatedGPU, float]:
    """A simulated GPU and its open time (s); 60 ms have passed since."""
    dev = SimulatedGPU(gpu_spec("a100-sxm4-40gb"), latency_s=0.0)
    t0 = dev._t_last
    time.sleep(0.06)
    return dev, t0


def _model_busy_w(dev: SimulatedGPU) -> float:
    with dev._lock:
        busy, dev._busy = dev._busy, True
        p = dev._power_w()
        dev._busy = busy
    return p


def test_busy_edges_draw_the_given_power_and_the_model_where_none():
    dev, t0 = _opened()
    p_idle, p_model = dev.spec.p_blocked_w, _model_busy_w(dev)
    # idle 1 ms; busy 10 ms at 123 W; idle 10 ms; busy 10 ms at the model's power; idle 10 ms
    dev.busy_edges([t0 + 1 * MS, 1.0, t0 + 11 * MS, 0.0, t0 + 21 * MS, 1.0, t0 + 31 * MS, 0.0], [123.0, NAN, NAN, NAN])
    assert dev.energy_j_at(t0 + 41 * MS) == pytest.approx(
        p_idle * 1 * MS + 123.0 * 10 * MS + p_idle * 10 * MS + p_model * 10 * MS + p_idle * 10 * MS, rel=1e-9
    )


def test_power_override_on_the_general_path_and_set_busy():
    """With a scheduled clock change among the edges (the general path) the override still holds."""
    dev, t0 = _opened()
    dev.schedule_sm_clock(990, t0 + 5 * MS)
    dev.busy_edges([t0 + 2 * MS, 1.0, t0 + 12 * MS, 0.0], [200.0, NAN])
    dev.set_busy(True, t0 + 22 * MS, power_w=50.0)
    dev.set_busy(False, t0 + 32 * MS)
    assert dev.energy_j_at(t0 + 32 * MS) == pytest.approx(
        dev.spec.p_blocked_w * 12 * MS + 200.0 * 10 * MS + 50.0 * 10 * MS, rel=1e-9
    )


def test_use_power_model_sets_blocked_power_and_limit():
    dev, t0 = _opened()
    dev.use_power_model(dataclasses.replace(dev.spec, p_blocked_w=40.0, power_limit_w=300.0))
    assert dev.spec.p_blocked_w == 40.0 and dev.power_limit_w() == 300.0
    t, e = time.monotonic(), dev.energy_j()
    time.sleep(0.05)
    e2, dt = dev.energy_j(), time.monotonic() - t  # the time that really passed (a loaded host oversleeps)
    assert (e2 - e) / dt == pytest.approx(40.0, rel=0.2)  # idle: the truth's blocked power


def test_temperature_reading_leaves_late_edges_their_own_times():
    """Reading the sensor commits nothing: an idle edge that arrives afterwards with an earlier time still
    ends the busy interval then (else the time until the reading would count as busy)."""
    dev, t0 = _opened()
    p_idle = dev.spec.p_blocked_w
    dev.busy_edges([t0 + 1 * MS, 1.0], [300.0])
    dev.temperature_c()
    dev.busy_edges([t0 + 11 * MS, 0.0])
    assert dev.energy_j_at(t0 + 41 * MS) == pytest.approx(
        p_idle * 1 * MS + 300.0 * 10 * MS + p_idle * 30 * MS, rel=1e-9
    )
