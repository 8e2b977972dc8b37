"""NVMLGPU against a fake pynvml (autospec of the real module): unit conversion and error mapping.

Faking pynvml is confined to this file; everything else uses a real backend.
"""

from __future__ import annotations

import sys
from unittest import mock

import pynvml
import pytest

from kareus_megatron.errors import ClockControlError, ConfigError, DeviceUnavailableError, UnknownPresetError
from kareus_megatron.hardware.device import nvml_access, nvml_report
from kareus_megatron.hardware.device.nvml import NVMLGPU


def _nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # NVMLError.__new__ picks the subclass for `code`


@pytest.fixture
def fake(monkeypatch):
    f = mock.create_autospec(pynvml, instance=False)
    for name in dir(pynvml):  # keep the real constants and exception classes
        if name.startswith(("NVML_", "NVMLError", "nvmlClocks")):
            setattr(f, name, getattr(pynvml, name))
    f.nvmlDeviceGetHandleByIndex.return_value = "handle0"
    f.nvmlDeviceGetName.return_value = "NVIDIA A100-SXM4-40GB"
    f.nvmlDeviceGetClockInfo.side_effect = lambda h, kind: {pynvml.NVML_CLOCK_MEM: 1215, pynvml.NVML_CLOCK_SM: 1410}[
        kind
    ]
    f.nvmlDeviceGetSupportedMemoryClocks.return_value = [405, 1215]
    f.nvmlDeviceGetSupportedGraphicsClocks.return_value = [1200, 1410, 1395, 1410]
    f.nvmlDeviceGetMigMode.return_value = [0, 0]
    f.nvmlDeviceGetTemperature.return_value = 41
    f.nvmlDeviceGetUUID.return_value = "GPU-1111"
    f.nvmlDeviceGetTotalEnergyConsumption.return_value = 1_000_000  # mJ
    f.nvmlDeviceGetCurrentClocksEventReasons.return_value = pynvml.nvmlClocksEventReasonGpuIdle
    f.nvmlDeviceGetApplicationsClock.return_value = 1410
    f.nvmlDeviceGetDefaultApplicationsClock.return_value = 1410
    f.nvmlDeviceGetPersistenceMode.return_value = 1
    f.nvmlDeviceGetAPIRestriction.return_value = 1
    f.nvmlDeviceGetPowerUsage.return_value = 61_250  # mW
    f.nvmlDeviceGetPowerManagementLimit.return_value = 400_000
    monkeypatch.setitem(sys.modules, "pynvml", f)  # what nvml_access.nvml_module imports
    monkeypatch.delenv("KAREUS_GPU_READ_ONLY", raising=False)
    return f


def test_open_reads_name_clocks_and_energy_baseline(fake):
    dev = NVMLGPU(0)
    fake.nvmlInit.assert_called_once_with()
    fake.nvmlDeviceGetHandleByIndex.assert_called_once_with(0)
    fake.nvmlDeviceGetSupportedGraphicsClocks.assert_called_once_with("handle0", 1215)
    assert dev.spec.name == "a100-sxm4-40gb"
    assert dev.supported_sm_clocks_mhz() == (1410, 1395, 1200)
    fake.nvmlDeviceGetTotalEnergyConsumption.return_value = 1_002_500
    assert dev.energy_j() == pytest.approx(2.5)  # mJ -> J, relative to open


def test_set_locks_min_and_max_and_reset(fake):
    dev = NVMLGPU(0)
    dev.set_sm_clock_mhz(1395)
    fake.nvmlDeviceSetGpuLockedClocks.assert_called_once_with("handle0", 1395, 1395)
    assert dev.sm_clock_mhz() == 1410
    dev.reset_clocks()
    fake.nvmlDeviceResetGpuLockedClocks.assert_called_once_with("handle0")
    with pytest.raises(ClockControlError, match="cannot lock 1000 MHz; supported: 1200..1410"):
        dev.set_sm_clock_mhz(1000)
    dev.close()  # nothing locked since the reset: close resets nothing
    assert fake.nvmlDeviceResetGpuLockedClocks.call_count == 1
    fake.nvmlShutdown.assert_called_once_with()


def test_reset_and_close_without_own_lock_touch_nothing(fake):
    """An administrator's lock survives: this object never locked, so it never resets."""
    dev = NVMLGPU(0)
    dev.reset_clocks()
    dev.close()
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()
    dev = NVMLGPU(0)
    fake.nvmlDeviceSetGpuLockedClocks.side_effect = _nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(ClockControlError):
        dev.set_sm_clock_mhz(1200)  # a refused lock is no lock
    dev.close()
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()


def test_close_resets_own_lock(fake):
    dev = NVMLGPU(0)
    dev.set_sm_clock_mhz(1200)
    assert dev.locked
    dev.close()
    fake.nvmlDeviceResetGpuLockedClocks.assert_called_once_with("handle0")


def test_read_only_reads_real_and_applies_nothing(fake):
    dev = NVMLGPU(0, read_only=True)
    assert dev.read_only
    dev.reset_clocks()  # nothing (would have been) locked: not even recorded
    dev.set_sm_clock_mhz(1200)
    dev.reset_clocks()
    dev.set_sm_clock_mhz(1395)
    dev.close()
    assert list(dev.recorded) == [("set", 1200), ("reset", None), ("set", 1395), ("reset", None)]  # close resets
    fake.nvmlDeviceSetGpuLockedClocks.assert_not_called()
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()


def test_temperature_reads_the_gpu_sensor(fake):
    dev = NVMLGPU(0)
    assert dev.temperature_c() == 41.0
    fake.nvmlDeviceGetTemperature.assert_called_once_with("handle0", pynvml.NVML_TEMPERATURE_GPU)


def test_supported_clocks_at_the_highest_memory_clock(fake):
    """A GDDR board idling in a low memory P-state: the current memory clock would list few clocks."""
    fake.nvmlDeviceGetClockInfo.side_effect = lambda h, kind: {pynvml.NVML_CLOCK_MEM: 405, pynvml.NVML_CLOCK_SM: 210}[
        kind
    ]
    NVMLGPU(0)
    fake.nvmlDeviceGetSupportedGraphicsClocks.assert_called_once_with("handle0", 1215)
    fake.nvmlDeviceGetSupportedMemoryClocks.side_effect = _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    NVMLGPU(0)  # cannot list memory clocks: falls back to the current one
    fake.nvmlDeviceGetSupportedGraphicsClocks.assert_called_with("handle0", 405)


def test_not_found_is_named(fake):
    fake.nvmlDeviceGetSupportedGraphicsClocks.side_effect = _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
    with pytest.raises(DeviceUnavailableError, match="NVML_ERROR_NOT_FOUND.*kareus env"):
        NVMLGPU(0)


def test_open_by_uuid_and_by_prefix(fake):
    fake.nvmlDeviceGetHandleByUUID.return_value = "handle-u"
    dev = NVMLGPU(3, uuid="GPU-abcd-1234")
    fake.nvmlDeviceGetHandleByUUID.assert_called_once_with("GPU-abcd-1234")
    fake.nvmlDeviceGetHandleByIndex.assert_not_called()
    dev.set_sm_clock_mhz(1200)
    fake.nvmlDeviceSetGpuLockedClocks.assert_called_once_with("handle-u", 1200, 1200)
    # CUDA_VISIBLE_DEVICES may hold a UUID prefix, which NVML's lookup does not accept
    fake.nvmlDeviceGetHandleByUUID.side_effect = _nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
    fake.nvmlDeviceGetCount.return_value = 2
    fake.nvmlDeviceGetHandleByIndex.side_effect = lambda i: f"h{i}"
    fake.nvmlDeviceGetUUID.side_effect = lambda h: {"h0": "GPU-0000-aaaa", "h1": "GPU-abcd-1234"}[h]
    dev = NVMLGPU(0, uuid="GPU-abcd")
    dev.set_sm_clock_mhz(1200)
    fake.nvmlDeviceSetGpuLockedClocks.assert_called_with("h1", 1200, 1200)
    assert dev.uuid == "GPU-abcd" and dev.nvml_uuid() == "GPU-abcd-1234"  # what the driver says of the handle
    with pytest.raises(DeviceUnavailableError, match="0 GPUs whose UUID starts with 'GPU-ffff'"):
        NVMLGPU(0, uuid="GPU-ffff")


def test_mig_mode_is_refused(fake):
    fake.nvmlDeviceGetMigMode.return_value = [1, 1]
    with pytest.raises(ConfigError, match="MIG mode on"):
        NVMLGPU(0)
    fake.nvmlShutdown.assert_called_once_with()


def test_no_permission_names_the_fix(fake):
    dev = NVMLGPU(0)
    fake.nvmlDeviceSetGpuLockedClocks.side_effect = _nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(ClockControlError, match="no permission.*root.*--kareus-on-error warn"):
        dev.set_sm_clock_mhz(1200)


def test_not_supported_maps_to_clock_error(fake):
    dev = NVMLGPU(0)
    dev.set_sm_clock_mhz(1200)
    fake.nvmlDeviceResetGpuLockedClocks.side_effect = _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(ClockControlError, match="NOT_SUPPORTED"):
        dev.reset_clocks()


def test_library_not_found_is_device_unavailable(fake):
    fake.nvmlInit.side_effect = _nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(DeviceUnavailableError, match="KAREUS_GPU_BACKEND=simulated"):
        NVMLGPU(0)


def test_unknown_device_name_shuts_down(fake):
    fake.nvmlDeviceGetName.return_value = "NVIDIA Mystery 9000"
    with pytest.raises(UnknownPresetError, match="Mystery 9000.*KAREUS_GPU"):
        NVMLGPU(0)
    fake.nvmlShutdown.assert_called_once_with()
    dev = NVMLGPU(0, gpu="a100-sxm4-40gb")  # an explicit preset wins
    assert dev.spec.name == "a100-sxm4-40gb"


def test_closed_device_refuses_calls(fake):
    dev = NVMLGPU(0)
    dev.close()
    with pytest.raises(DeviceUnavailableError, match="closed"):
        dev.set_sm_clock_mhz(1410)


def test_environment_report(fake, monkeypatch):
    fake.nvmlSystemGetDriverVersion.return_value = "550.54.15"
    fake.nvmlDeviceGetCount.return_value = 2
    monkeypatch.setattr(nvml_report, "may_administer", lambda: True)
    rep = nvml_report.nvml_report(1, check_permission=True)
    assert rep["nvml"] and rep["driver_version"] == "550.54.15" and rep["device_count"] == 2
    assert rep["name"] == "NVIDIA A100-SXM4-40GB" and rep["preset"] == "a100-sxm4-40gb"
    assert rep["supported_sm_clocks_mhz"] == [1410, 1395, 1200] and rep["energy_counter_mj"] == 1_000_000
    assert rep["power_w"] == 61.25 and rep["power_limit_w"] == 400.0
    # root: likely allowed, but --check-permission alone never touches the GPU
    assert rep["clock_permission"] is None and "not tried" in rep["permission_note"]
    assert rep["clock_settings"]["persistence_mode"] is True and not rep["clock_settings"]["user_clock_setting"]
    fake.nvmlDeviceSetGpuLockedClocks.assert_not_called()
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()
    fake.nvmlDeviceGetHandleByIndex.assert_called_with(1)
    fake.nvmlShutdown.assert_called_once_with()
    assert "out of range" in nvml_report.nvml_report(5)["error"]


def test_permission_check_without_capability_changes_nothing(fake, monkeypatch):
    monkeypatch.setattr(nvml_report, "may_administer", lambda: False)
    rep = nvml_report.nvml_report(0, check_permission=True, try_lock=True)
    assert rep["clock_permission"] is False and rep["permission_method"] == "capability"
    fake.nvmlDeviceSetGpuLockedClocks.assert_not_called()
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()


def test_try_lock_resets_only_its_own_lock(fake, monkeypatch):
    monkeypatch.setattr(nvml_report, "may_administer", lambda: True)
    fake.nvmlDeviceGetClockInfo.side_effect = lambda h, kind: {pynvml.NVML_CLOCK_MEM: 1215, pynvml.NVML_CLOCK_SM: 1390}[
        kind
    ]
    rep = nvml_report.nvml_report(0, check_permission=True, try_lock=True)
    assert rep["clock_permission"] is True and rep["permission_method"] == "lock" and rep["locked_mhz"] == 1395
    fake.nvmlDeviceSetGpuLockedClocks.assert_called_once_with("handle0", 1395, 1395)  # nearest supported
    fake.nvmlDeviceResetGpuLockedClocks.assert_called_once_with("handle0")
    assert rep["temperature_c"] == 41.0 and rep["uuid"] == "GPU-1111"


def test_try_lock_without_permission_resets_nothing(fake, monkeypatch):
    monkeypatch.setattr(nvml_report, "may_administer", lambda: True)
    fake.nvmlDeviceSetGpuLockedClocks.side_effect = _nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    rep = nvml_report.nvml_report(0, check_permission=True, try_lock=True)
    assert rep["clock_permission"] is False and "root" in rep["permission_error"]
    fake.nvmlDeviceSetGpuLockedClocks.assert_called_once_with("handle0", 1410, 1410)  # at the current clock
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()  # nothing was locked: nothing reset


@pytest.mark.parametrize("setting", ["lock", "application clocks"])
def test_try_lock_leaves_a_clock_setting_in_force_alone(fake, monkeypatch, setting):
    """An administrator's lock (NVML's 'applications clocks setting' event reason) or application clocks off
    their default: --try-lock does not lock, since its reset would end that setting."""
    monkeypatch.setattr(nvml_report, "may_administer", lambda: True)
    if setting == "lock":
        fake.nvmlDeviceGetCurrentClocksEventReasons.return_value = pynvml.nvmlClocksEventReasonApplicationsClocksSetting
    else:
        fake.nvmlDeviceGetApplicationsClock.return_value = 1200
    rep = nvml_report.nvml_report(0, check_permission=True, try_lock=True)
    assert rep["clock_permission"] is None and "left alone" in rep["permission_note"]
    fake.nvmlDeviceSetGpuLockedClocks.assert_not_called()
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()


def test_try_lock_is_refused_in_read_only_mode(fake, monkeypatch):
    monkeypatch.setattr(nvml_report, "may_administer", lambda: True)
    monkeypatch.setenv("KAREUS_GPU_READ_ONLY", "1")
    rep = nvml_report.nvml_report(0, check_permission=True, try_lock=True)
    assert rep["clock_permission"] is False and "read-only" in rep["permission_error"]
    fake.nvmlDeviceSetGpuLockedClocks.assert_not_called()
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()


def test_read_only_environment_wins_over_the_argument(fake, monkeypatch):
    monkeypatch.setenv("KAREUS_GPU_READ_ONLY", "1")
    dev = NVMLGPU(0, read_only=False)
    assert dev.read_only
    dev.set_sm_clock_mhz(1395)
    dev.close()
    assert list(dev.recorded) == [("set", 1395), ("reset", None)]
    fake.nvmlDeviceSetGpuLockedClocks.assert_not_called()
    fake.nvmlDeviceResetGpuLockedClocks.assert_not_called()


def test_the_choke_point_refuses_in_read_only_mode(fake, monkeypatch):
    with pytest.raises(nvml_access.ReadOnlyViolation, match="read-only"):
        nvml_access.change_setting("locking", "nvmlDeviceSetGpuLockedClocks", "handle0", 1410, 1410, read_only=True)
    monkeypatch.setenv("KAREUS_GPU_READ_ONLY", "1")
    with pytest.raises(nvml_access.ReadOnlyViolation):
        nvml_access.change_setting("locking", "nvmlDeviceSetGpuLockedClocks", "handle0", 1410, 1410, read_only=False)
    # the module handed out in read-only mode refuses every changing call, whoever makes it
    guarded = nvml_access.nvml_module()
    for name in (
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceSetPersistenceMode",
        "nvmlDeviceSetApplicationsClocks",
        "nvmlDeviceResetMemoryLockedClocks",
        "nvmlDeviceSetMemoryLockedClocks",
        "nvmlDevicePowerSmoothingSetState",
    ):
        with pytest.raises(nvml_access.ReadOnlyViolation, match=name):
            getattr(guarded, name)("handle0")
        getattr(fake, name).assert_not_called()
    assert guarded.nvmlDeviceGetName("handle0") == "NVIDIA A100-SXM4-40GB"  # getters pass
    with pytest.raises(ValueError, match="reads"):
        nvml_access.change_setting("reading", "nvmlDeviceGetName", "handle0", read_only=False)


def test_every_changing_nvml_function_is_classified():
    """Every nvml* function of the installed nvidia-ml-py is a getter (is_read_call) or is refused read-only."""
    names = [
        n
        for n in dir(pynvml)
        if n.startswith("nvml") and callable(getattr(pynvml, n)) and not isinstance(getattr(pynvml, n), type)
    ]
    changing = {n for n in names if not nvml_access.is_read_call(n)}
    assert {
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceSetPersistenceMode",
        "nvmlDeviceSetApplicationsClocks",
        "nvmlDeviceClearEccErrorCounts",
        "nvmlDeviceSetMigMode",
    } <= changing
    assert not {n for n in changing if "Get" in n}  # no getter is taken for a change
    assert "nvmlDeviceGetTotalEnergyConsumption" not in changing and "nvmlInit" not in changing


def test_recorded_calls_are_bounded(fake):
    from kareus_megatron.hardware.device.base import RECORDED_MAX

    dev = NVMLGPU(0, read_only=True)
    for i in range(RECORDED_MAX + 10):
        dev.set_sm_clock_mhz((1410, 1395)[i % 2])
    assert len(dev.recorded) == RECORDED_MAX and dev.recorded_total["set"] == RECORDED_MAX + 10
    dev.close()


def test_may_administer_reads_the_capability(monkeypatch, tmp_path):
    monkeypatch.setattr(nvml_access.os, "geteuid", lambda: 1000)
    status = tmp_path / "status"
    real_open = open

    def fake_open(path, *a, **k):
        return real_open(status if path == "/proc/self/status" else path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    status.write_text("Name:\tpython\nCapEff:\t0000000000200000\n")
    assert nvml_access.may_administer() is True
    status.write_text("Name:\tpython\nCapEff:\t0000000000000000\n")
    assert nvml_access.may_administer() is False
    monkeypatch.setattr(nvml_access.os, "geteuid", lambda: 0)
    assert nvml_access.may_administer() is True


# -- board power limit (issue 16, powercap): W here, mW in NVML; restore only what this object set ------
def _power_fake(fake):
    fake.nvmlDeviceGetPowerManagementLimitConstraints.return_value = (100_000, 400_000)  # mW
    fake.nvmlDeviceGetPowerManagementLimit.return_value = 350_000  # an administrator's 350 W


def test_power_limit_in_watts_and_restore_of_the_limit_found(fake):
    _power_fake(fake)
    dev = NVMLGPU(0)
    assert dev.power_limit_range_w() == (100.0, 400.0)
    assert dev.power_limit_w() == 350.0
    dev.reset_power_limit()  # nothing set yet: nothing touched
    fake.nvmlDeviceSetPowerManagementLimit.assert_not_called()
    dev.set_power_limit_w(250.0)
    fake.nvmlDeviceSetPowerManagementLimit.assert_called_once_with("handle0", 250_000)
    dev.set_power_limit_w(200.0)
    dev.close()  # restores the 350 W found before the first change, once
    assert fake.nvmlDeviceSetPowerManagementLimit.call_args_list[-1] == mock.call("handle0", 350_000)
    assert fake.nvmlDeviceSetPowerManagementLimit.call_count == 3


def test_power_limit_out_of_range_and_read_only(fake):
    _power_fake(fake)
    dev = NVMLGPU(0)
    with pytest.raises(ClockControlError, match="cannot take a power limit of 450 W; allowed: 100..400 W"):
        dev.set_power_limit_w(450.0)
    ro = NVMLGPU(0, read_only=True)
    ro.set_power_limit_w(300.0)
    ro.close()
    assert list(ro.recorded) == [("power_limit", 300), ("power_limit_reset", None)]
    fake.nvmlDeviceSetPowerManagementLimit.assert_not_called()


def test_power_limit_without_permission_names_the_fix(fake):
    _power_fake(fake)
    fake.nvmlDeviceSetPowerManagementLimit.side_effect = _nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(ClockControlError, match="power limit to 250 W: NVML refused"):
        NVMLGPU(0).set_power_limit_w(250.0)


def _field(ret: int, mw: int):
    """A pynvml c_nvmlFieldValue_t as the real one reads: nvmlReturn and the value union's uiVal."""
    fv = pynvml.c_nvmlFieldValue_t()
    fv.fieldId, fv.nvmlReturn = pynvml.NVML_FI_DEV_POWER_INSTANT, ret
    fv.value.uiVal = mw
    return fv


def test_power_reads_the_instant_field_else_the_1s_average(fake):
    """Issue 26: the power samples come from NVML_FI_DEV_POWER_INSTANT where the GPU answers it (mW -> W), else
    from nvmlDeviceGetPowerUsage, which Ampere and later boards average over 1 s; the device says which."""
    fake.nvmlDeviceGetFieldValues.return_value = [_field(pynvml.NVML_SUCCESS, 251_500)]
    dev = NVMLGPU(0)
    assert dev.power_reading == "nvml_instant" and dev.power_w() == pytest.approx(251.5)
    fake.nvmlDeviceGetFieldValues.assert_called_with("handle0", [pynvml.NVML_FI_DEV_POWER_INSTANT])
    fake.nvmlDeviceGetFieldValues.return_value = [_field(pynvml.NVML_ERROR_NOT_SUPPORTED, 0)]
    assert NVMLGPU(0).power_reading == "nvml_average_1s"
    assert dev.power_w() == pytest.approx(61.25)  # the field stopped answering: the average, not 0 W
