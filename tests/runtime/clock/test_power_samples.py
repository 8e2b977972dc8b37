"""Power samples (runtime/clock/power_samples.py): the simulated GPU's model on the time line, exact per grid
interval, and NVML's wall-time sampler thread, both carried with the mark answers (issue 26)."""

from __future__ import annotations

import time

import pytest

from kareus_megatron.hardware.device import simulation_of
from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.device.sim_model import DEFAULT_COMPUTE_ACTIVITY as ACT_C
from kareus_megatron.hardware.device.sim_model import DEFAULT_MEMORY_ACTIVITY as ACT_M
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.hardware.power import power_w
from kareus_megatron.runtime.clock.controller import ClockController
from kareus_megatron.runtime.clock.power_samples import SAMPLE_HZ
from kareus_megatron.runtime.clock.wire import CODE_MARK, begin_record, encode_records

NAN = float("nan")


def test_simulated_samples_follow_the_power_model_at_the_records_own_times():
    spec = gpu_spec("a100-sxm4-40gb")
    dev = SimulatedGPU(spec, 0, log_path=None, latency_s=0.0)
    replies = []
    ctl = ClockController(dev, replies.append, simulation=simulation_of(dev))
    ctl.probe()
    dt = 1.0 / SAMPLE_HZ
    t0 = (int(time.monotonic() / dt) + 1) * dt  # on the sampling grid
    time.sleep(0.45)
    # mark 1 at t0; one instruction busy t0+0.1 .. t0+0.3 s at 1410 MHz; mark 2 at t0+0.4 (all in one batch)
    ctl.feed(
        encode_records(
            [
                CODE_MARK,
                t0,
                NAN,
                1.0,
                0.0,
                0.0,
                0.0,
                0.0,
                *begin_record(t0 + 0.1, 0, 0, 1410, "forward"),
                CODE_MARK,
                t0 + 0.4,
                t0 + 0.3,
                2.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ]
        )
    )
    assert replies[0]["power"] is None  # nothing before the first mark
    p = replies[1]["power"]
    assert p["reading"] == "model" and p["dt_s"] == pytest.approx(dt) and SAMPLE_HZ >= 20
    assert p["t0"] == pytest.approx(t0, abs=1e-9) and len(p["w"]) == round(0.4 / dt)
    busy = float(power_w(spec, 1410, ACT_C, ACT_M))
    want = [spec.p_blocked_w] * 5 + [busy] * 10 + [spec.p_blocked_w] * 5
    assert p["w"] == pytest.approx([round(w, 1) for w in want], abs=0.051)
    # the samples integrate to the energy the marks measured
    assert sum(p["w"]) * dt == pytest.approx(replies[1]["energy_j"] - replies[0]["energy_j"], rel=1e-3)


class _Board:
    """A plain GPUDevice (simulated GPU driven on wall time) with NVML's power reading: steps to 300 W."""

    def __init__(self):
        self._dev = SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0, log_path=None, latency_s=0.0)
        self.power_reading = "nvml_instant"
        self.t_step = time.monotonic() + 0.15

    def power_w(self):
        return 300.0 if time.monotonic() >= self.t_step else 100.0

    def __getattr__(self, name):
        return getattr(self._dev, name)


def test_nvml_path_samples_on_its_own_thread_and_answers_with_the_marks():
    board = _Board()
    replies = []
    ctl = ClockController(board, replies.append, simulation=None, power=(board.power_w, board.power_reading))
    ctl.probe()
    import threading

    loop = threading.Thread(target=ctl.run, daemon=True)
    loop.start()
    try:
        t0 = time.monotonic()
        ctl.feed(encode_records([CODE_MARK, t0, NAN, 1.0, 0.0, 0.0, 0.0, 0.0]))
        time.sleep(0.4)
        t1 = time.monotonic()
        ctl.feed(encode_records([CODE_MARK, t1, NAN, 2.0, 0.0, 0.0, 0.0, 0.0]))
    finally:
        ctl.stop()
        loop.join(timeout=5)
    p = replies[-1]["power"]
    assert p["reading"] == "nvml_instant"
    assert len(p["w"]) >= 0.4 * 20 and p["dt_s"] <= 1 / 20  # >= 20 Hz even on a loaded CPU
    assert set(p["w"]) == {100.0, 300.0} and p["w"][-1] == 300.0
    assert p["t0"] + (len(p["w"]) - 1) * p["dt_s"] <= t1 + 1e-6  # no sample after the mark
