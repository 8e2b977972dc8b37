"""The board power limit (W) through the device contract: the simulated GPU, and the clock controller
that sets a powercap plan's limit at start and restores it on every way out (the side process too).
The NVML backend's conversions are in test_device_nvml.py (fake pynvml)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kareus_megatron.errors import ClockControlError
from kareus_megatron.hardware.device.base import min_power_limit_w
from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.runtime.clock.controller import ClockController

SPEC = gpu_spec("a100-sxm4-40gb")


def _gpu(tmp_path=None, **kw) -> SimulatedGPU:
    return SimulatedGPU(SPEC, 0, log_path=None if tmp_path is None else tmp_path / "sim.jsonl", latency_s=0.0, **kw)


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_range_set_and_restore():
    g = _gpu()
    assert g.power_limit_range_w() == (min_power_limit_w(SPEC), SPEC.power_limit_w) == (100.0, 400.0)
    assert g.power_limit_w() == 400.0
    g.reset_power_limit()  # nothing set: nothing to restore
    g.set_power_limit_w(250.0)
    assert g.power_limit_w() == 250.0
    g.reset_power_limit()
    assert g.power_limit_w() == 400.0
    with pytest.raises(ClockControlError, match="cannot set a power limit of 90 W; allowed: 100..400 W"):
        g.set_power_limit_w(90.0)


def test_the_cap_lowers_the_modelled_power_and_energy():
    full, capped = _gpu(), _gpu()
    capped.set_power_limit_w(200.0)
    t0 = time.monotonic()
    for g in (full, capped):
        g.set_busy(True, t0)
    assert capped._power_w() == pytest.approx(200.0, rel=1e-6)  # the default activity draws more than 200 W
    assert full._power_w() > 1.2 * capped._power_w()
    e0 = capped.energy_j()
    time.sleep(0.2)
    assert capped.energy_j() - e0 <= 200.0 * (time.monotonic() - t0)
    capped.reset_power_limit()
    assert capped._power_w() == full._power_w()


def test_close_restores_only_a_limit_it_set(tmp_path):
    g = _gpu(tmp_path)
    g.set_power_limit_w(300.0)
    g.close()
    ev = [e["event"] for e in _events(tmp_path / "sim.jsonl")]
    assert ev == ["open", "power_limit", "power_limit_reset", "close"]
    h = _gpu(tmp_path)
    h.close()
    assert [e["event"] for e in _events(tmp_path / "sim.jsonl")][-2:] == ["open", "close"]


def test_read_only_records_and_changes_nothing():
    g = _gpu(read_only=True)
    g.reset_power_limit()
    g.set_power_limit_w(300.0)
    assert g.power_limit_w() == 400.0
    g.close()
    assert list(g.recorded) == [("power_limit", 300), ("power_limit_reset", None)]


def test_controller_sets_the_limit_at_start_and_restores_it_at_close():
    g = _gpu()
    replies: list[dict] = []
    ctl = ClockController(g, replies.append, power_limit_w=220.0)
    ready = ctl.probe()
    assert ready["op"] == "ready" and ready["power_limit_w"] == 220.0
    assert g.power_limit_w() == 220.0
    ctl.submit({"op": "close", "seq": 1})
    assert ctl.run() == "closed"
    assert replies[-1]["op"] == "ack"
    assert g._power_limit_w == 400.0  # restored before the device closed


def test_controller_reports_a_limit_the_gpu_refuses():
    ctl = ClockController(_gpu(), lambda m: None, power_limit_w=50.0)
    ready = ctl.probe()
    assert ready["op"] == "error" and "50 W" in ready["message"]


def test_side_process_restores_the_limit_when_its_trainer_is_killed(tmp_path):
    """The trainer (a child that started the side process) is SIGKILLed: the controller sees stdin close
    and restores the limit within 1 s, as it resets clocks."""
    log = tmp_path / "sim.jsonl"
    trainer = (
        "import sys, time\n"
        "from kareus_megatron.runtime.clock.client import ClockClient\n"
        "c = ClockClient()\n"
        "ready = c.start_process(0, backend='simulated', gpu='a100-sxm4-40gb', power_limit_w=260.0)\n"
        "print(ready['op'], ready['power_limit_w'], flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "KAREUS_SIMULATED_LOG": str(log), "KAREUS_SIMULATED_LATENCY_MS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["ready", "260.0"]
        t_kill = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 5.0
        restored = None
        while restored is None and time.monotonic() < deadline:
            restored = next((e for e in _events(log) if e["event"] == "power_limit_reset"), None)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [e["event"] for e in _events(log)]
    assert "power_limit" in events, events
    assert restored is not None, f"power limit not restored after SIGKILL: {events}"
    assert restored["w"] == 400.0 and restored["t"] - t_kill <= 1.0
