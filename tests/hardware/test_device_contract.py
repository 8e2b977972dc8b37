"""The GPUDevice contract, run on both backends (nvml only where NVML initialises)."""

from __future__ import annotations

import json
import time

import pytest

from kareus_megatron.errors import ClockControlError, ConfigError, DeviceUnavailableError
from kareus_megatron.hardware.device import GPUDevice, SimulationHooks, nearest_supported_mhz, open_gpu, simulation_of
from kareus_megatron.hardware.device.nvml import nvml_available
from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.device.sim_model import DEFAULT_COMPUTE_ACTIVITY as ACT_C
from kareus_megatron.hardware.device.sim_model import DEFAULT_MEMORY_ACTIVITY as ACT_M
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.hardware.power import power_w


@pytest.fixture(params=["simulated", pytest.param("nvml", marks=pytest.mark.gpu)])
def gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "2")
    monkeypatch.setenv("KAREUS_SIMULATED_LOG", str(tmp_path / "sim.jsonl"))
    dev = open_gpu(0, backend=request.param, gpu="a100-sxm4-40gb" if request.param == "simulated" else None)
    yield dev
    dev.close()


def test_satisfies_protocol(gpu):
    assert isinstance(gpu, GPUDevice)
    assert gpu.index == 0


def test_supported_clocks_descending_and_lockable(gpu):
    clocks = gpu.supported_sm_clocks_mhz()
    assert len(clocks) >= 2
    assert list(clocks) == sorted(set(clocks), reverse=True)
    target = clocks[len(clocks) // 3]
    gpu.set_sm_clock_mhz(target)
    if isinstance(gpu, SimulatedGPU):
        assert gpu.sm_clock_mhz() == target
    else:  # a real GPU reports the clock it runs at, never above the lock
        assert gpu.sm_clock_mhz() <= target
    gpu.reset_clocks()


def test_unsupported_clock_is_refused(gpu):
    clocks = gpu.supported_sm_clocks_mhz()
    with pytest.raises(ClockControlError, match="cannot lock"):
        gpu.set_sm_clock_mhz(clocks[0] + 1)


def _energy_over(gpu, seconds):
    """(energy J, elapsed s) of `gpu` over about `seconds` of wall time."""
    e0, t0 = gpu.energy_j(), time.monotonic()
    time.sleep(seconds)
    return gpu.energy_j() - e0, time.monotonic() - t0


def test_energy_grows_by_power_times_time(gpu):
    """The counter grows strictly, by power x elapsed time (a counter stuck at any value fails)."""
    spec, sim = gpu.spec, simulation_of(gpu)
    assert gpu.energy_j() >= 0.0
    if sim is None:  # a real GPU: at least a few watts even when idle, never far above its board limit
        energy, dt = _energy_over(gpu, 1.0)
        assert energy > 0.0 and 5.0 <= energy / dt <= 1.5 * spec.power_limit_w
        return
    sim.set_busy(False)  # idle: the preset's blocked power
    energy, dt = _energy_over(gpu, 0.1)
    assert energy > 0.0 and energy == pytest.approx(spec.p_blocked_w * dt, rel=0.1)
    sim.set_busy(True)  # an instruction runs: the power model at the present clock
    energy, dt = _energy_over(gpu, 0.1)
    busy_w = float(power_w(spec, gpu.sm_clock_mhz(), ACT_C, ACT_M))
    assert busy_w > spec.p_blocked_w and energy == pytest.approx(busy_w * dt, rel=0.1)


def test_simulation_hooks_only_for_the_simulated_backend(gpu):
    sim = simulation_of(gpu)
    if isinstance(gpu, SimulatedGPU):
        assert sim is gpu and isinstance(sim, SimulationHooks)
    else:
        assert sim is None and not isinstance(gpu, SimulationHooks)


def _resets_in_log(tmp_path):
    log = tmp_path / "sim.jsonl"
    return [r for r in _records(log) if r["event"] == "reset"] if log.exists() else []


def test_reset_and_close_touch_only_what_this_object_locked(gpu, tmp_path):
    """An administrator's lock survives a process that never locked: reset/close without a lock do nothing."""
    assert not gpu.read_only and not gpu.locked
    gpu.reset_clocks()
    gpu.close()
    assert _resets_in_log(tmp_path) == []


def test_reset_after_own_lock(gpu, tmp_path):
    clocks = gpu.supported_sm_clocks_mhz()
    gpu.set_sm_clock_mhz(clocks[-1])
    assert gpu.locked
    gpu.reset_clocks()
    assert not gpu.locked
    gpu.reset_clocks()  # the second reset has nothing left to undo
    gpu.set_sm_clock_mhz(clocks[-1])
    gpu.close()  # resets the lock it made
    if isinstance(gpu, SimulatedGPU):
        assert len(_resets_in_log(tmp_path)) == 2


@pytest.fixture(params=["simulated", pytest.param("nvml", marks=pytest.mark.gpu)])
def read_only_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "0")
    monkeypatch.setenv("KAREUS_SIMULATED_LOG", str(tmp_path / "sim.jsonl"))
    monkeypatch.setenv("KAREUS_GPU_READ_ONLY", "1")
    dev = open_gpu(0, backend=request.param, gpu="a100-sxm4-40gb" if request.param == "simulated" else None)
    yield dev
    dev.close()


def test_read_only_records_and_changes_nothing(read_only_gpu, tmp_path):
    gpu = read_only_gpu
    assert gpu.read_only
    clocks = gpu.supported_sm_clocks_mhz()
    before = gpu.sm_clock_mhz()
    gpu.set_sm_clock_mhz(clocks[-1])
    with pytest.raises(ClockControlError, match="cannot lock"):  # still checked like a real lock
        gpu.set_sm_clock_mhz(clocks[0] + 1)
    gpu.reset_clocks()
    assert list(gpu.recorded) == [("set", clocks[-1]), ("reset", None)]
    assert not gpu.locked
    if isinstance(gpu, SimulatedGPU):
        assert gpu.sm_clock_mhz() == before == clocks[0]
        assert gpu.schedule_sm_clock(clocks[-1], time.monotonic()) > 0
        assert gpu.sm_clock_mhz() == clocks[0]
    assert gpu.energy_j() >= 0.0
    gpu.close()
    assert _resets_in_log(tmp_path) == []
    assert (
        not [r for r in _records(tmp_path / "sim.jsonl") if r["event"] == "set"]
        if isinstance(gpu, SimulatedGPU)
        else True
    )


def test_read_only_environment_wins_over_the_argument(monkeypatch):
    """KAREUS_GPU_READ_ONLY=1 makes every device read-only, whatever a flag asks (issue 23: `kareus validate`
    without --no-clock-control passed read_only=False and so ignored it)."""
    monkeypatch.setenv("KAREUS_GPU_READ_ONLY", "1")
    assert open_gpu(0, backend="simulated", read_only=False).read_only
    monkeypatch.setenv("KAREUS_GPU_READ_ONLY", "0")
    assert not open_gpu(0, backend="simulated").read_only
    assert open_gpu(0, backend="simulated", read_only=True).read_only


def test_temperature_is_plausible(gpu):
    assert 0.0 < gpu.temperature_c() < 110.0


def test_nvml_uuid_names_the_gpu_in_nvml_form(gpu):
    uuid = gpu.nvml_uuid()
    assert uuid.startswith("GPU-") and uuid == gpu.nvml_uuid()


def test_simulated_temperature_rises_with_power():
    dev = SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0, latency_s=0.0)
    idle = dev.temperature_c()
    dev.set_busy(True)
    time.sleep(0.3)  # about 1.5% of the way (tau 20 s) toward ~65 °C from ~39 °C
    busy = dev.temperature_c()
    assert idle + 0.1 < busy < idle + 2.0
    dev.set_busy(False)
    time.sleep(0.3)
    assert dev.temperature_c() < busy
    dev.close()


def test_close_is_idempotent_and_final(gpu):
    gpu.close()
    gpu.close()
    with pytest.raises(DeviceUnavailableError):
        gpu.energy_j()


# ---- simulated backend specifics -----------------------------------------------------------


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_simulated_log_records_every_change_with_latency(tmp_path):
    log = tmp_path / "clocks.jsonl"
    dev = SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 3, log_path=log, latency_s=0.02)
    t0 = time.monotonic()
    dev.set_sm_clock_mhz(1200)
    assert time.monotonic() - t0 >= 0.02
    dev.set_sm_clock_mhz(990)
    dev.close()  # a locked clock is reset on close
    recs = _records(log)
    assert [(r["event"], r["mhz"]) for r in recs] == [
        ("open", 1410),
        ("set", 1200),
        ("set", 990),
        ("reset", 1410),
        ("close", 1410),
    ]
    assert all(r["gpu"] == 3 for r in recs)
    ts = [r["t"] for r in recs]
    assert ts == sorted(ts) and ts[1] - t0 >= 0.02


def test_simulated_energy_follows_power_model():
    spec = gpu_spec("a100-sxm4-40gb")
    dev = SimulatedGPU(spec, 0, log_path=None, latency_s=0.0)
    t0 = time.monotonic()
    dev.set_busy(False, t=t0)
    with dev._lock:  # the integral exactly at t0 (energy_j() would advance it to "now")
        e_start = dev._energy_j
    dev.set_busy(True, t=t0 + 1.0, compute_activity=0.9, memory_activity=0.3)  # 1 s blocked
    dev.set_busy(False, t=t0 + 3.0)  # 2 s busy at the default clock
    expected = spec.p_blocked_w * 1.0 + float(power_w(spec, 1410, 0.9, 0.3)) * 2.0
    # energy_j() advances to "now" (past t0 + 3 s is in the future, so it only adds blocked power)
    with dev._lock:  # read the integral at t0 + 3 s exactly
        got = dev._energy_j
    assert got - e_start == pytest.approx(expected, rel=1e-6)
    dev.close()


def test_energy_can_be_read_slightly_in_the_past():
    spec = gpu_spec("a100-sxm4-40gb")
    dev = SimulatedGPU(spec, 0, log_path=None, latency_s=0.0)
    t0 = time.monotonic()
    dev.set_busy(False, t=t0)
    time.sleep(0.05)
    e_past, e_now = dev.energy_j_at(t0), dev.energy_j()
    assert e_now - e_past == pytest.approx(spec.p_blocked_w * (time.monotonic() - t0), rel=0.2)
    assert dev.energy_j_at(time.monotonic() + 5) == pytest.approx(dev.energy_j(), rel=1e-3)
    dev.close()


def test_lower_clock_draws_less_busy_power():
    spec = gpu_spec("a100-sxm4-40gb")
    assert float(power_w(spec, 1005, ACT_C, ACT_M)) < float(power_w(spec, 1410, ACT_C, ACT_M))


def test_simulated_no_permission(monkeypatch):
    monkeypatch.setenv("KAREUS_SIMULATED_NO_PERMISSION", "1")
    dev = SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0, latency_s=0.0)
    with pytest.raises(ClockControlError, match="no permission.*--kareus-on-error warn"):
        dev.set_sm_clock_mhz(1200)
    dev.reset_clocks()  # nothing was locked: nothing to reset, so nothing is refused
    assert not dev.locked
    dev.close()


@pytest.mark.parametrize("raw", ["abc", "-3", "nan"])
def test_bad_latency_env(monkeypatch, raw):
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", raw)
    with pytest.raises(DeviceUnavailableError, match="KAREUS_SIMULATED_LATENCY_MS"):
        SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0)


def test_latency_env_default_and_value(monkeypatch):
    monkeypatch.delenv("KAREUS_SIMULATED_LATENCY_MS", raising=False)
    assert SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0).latency_s == pytest.approx(0.015)
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "7.5")
    assert SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0).latency_s == pytest.approx(0.0075)


# ---- backend selection ---------------------------------------------------------------------


def test_backend_from_env(monkeypatch):
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_GPU", "h100-sxm5-80gb")
    dev = open_gpu(1)
    assert isinstance(dev, SimulatedGPU) and dev.index == 1 and dev.spec.name == "h100-sxm5-80gb"
    dev.close()


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "rocm")
    with pytest.raises(ConfigError, match="KAREUS_GPU_BACKEND='rocm'.*nvml, simulated"):
        open_gpu(0)


@pytest.mark.skipif(nvml_available(), reason="NVML is present here")
def test_no_silent_fallback_without_nvml(monkeypatch):
    monkeypatch.delenv("KAREUS_GPU_BACKEND", raising=False)
    with pytest.raises(DeviceUnavailableError, match="KAREUS_GPU_BACKEND=simulated"):
        open_gpu(0)
    with pytest.raises(DeviceUnavailableError, match="KAREUS_GPU_BACKEND=simulated"):
        open_gpu(0, backend="nvml")


def test_nearest_supported():
    assert nearest_supported_mhz(1203, (1410, 1215, 1200)) == 1200
    assert nearest_supported_mhz(1207, (1215, 1200)) == 1200
    assert nearest_supported_mhz(1208, (1215, 1200)) == 1215
