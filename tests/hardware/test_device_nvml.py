"""NVMLGPU against a fake pynvml (autospec of the real module): unit conversion and error mapping.

Faking pynvml is confined to this file; everything else uses a real backend.
"""

from __future__ import annotations

from unittest import mock

import pynvml
import pytest

from kareus_megatron.errors import ClockControlError, DeviceUnavailableError, UnknownPresetError
from kareus_megatron.hardware.device import nvml as nvml_mod
from kareus_megatron.hardware.device.nvml import NVMLGPU


def _nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # NVMLError.__new__ picks the subclass for `code`


@pytest.fixture
def fake(monkeypatch):
    f = mock.create_autospec(pynvml, instance=False)
    for name in dir(pynvml):  # keep the real constants and exception classes
        if name.startswith(("NVML_", "NVMLError")):
            setattr(f, name, getattr(pynvml, name))
    f.nvmlDeviceGetHandleByIndex.return_value = "handle0"
    f.nvmlDeviceGetName.return_value = "NVIDIA A100-SXM4-40GB"
    f.nvmlDeviceGetClockInfo.side_effect = lambda h, kind: {pynvml.NVML_CLOCK_MEM: 1215,
                                                            pynvml.NVML_CLOCK_SM: 1410}[kind]
    f.nvmlDeviceGetSupportedGraphicsClocks.return_value = [1200, 1410, 1395, 1410]
    f.nvmlDeviceGetTotalEnergyConsumption.return_value = 1_000_000  # mJ
    monkeypatch.setattr(nvml_mod, "_pynvml", lambda: f)
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
    dev.close()
    assert fake.nvmlDeviceResetGpuLockedClocks.call_count == 2
    fake.nvmlShutdown.assert_called_once_with()


def test_no_permission_names_the_fix(fake):
    dev = NVMLGPU(0)
    fake.nvmlDeviceSetGpuLockedClocks.side_effect = _nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(ClockControlError, match="no permission.*root.*--kareus-on-error warn"):
        dev.set_sm_clock_mhz(1200)


def test_not_supported_maps_to_clock_error(fake):
    dev = NVMLGPU(0)
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


def test_environment_report(fake):
    fake.nvmlSystemGetDriverVersion.return_value = "550.54.15"
    fake.nvmlDeviceGetCount.return_value = 2
    fake.nvmlDeviceResetGpuLockedClocks.side_effect = _nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    rep = nvml_mod.nvml_report(1, check_permission=True)
    assert rep["nvml"] and rep["driver_version"] == "550.54.15" and rep["device_count"] == 2
    assert rep["name"] == "NVIDIA A100-SXM4-40GB" and rep["preset"] == "a100-sxm4-40gb"
    assert rep["supported_sm_clocks_mhz"] == [1410, 1395, 1200] and rep["energy_counter_mj"] == 1_000_000
    assert rep["clock_permission"] is False and "root" in rep["permission_error"]
    fake.nvmlDeviceGetHandleByIndex.assert_called_with(1)
    fake.nvmlShutdown.assert_called_once_with()
    assert "out of range" in nvml_mod.nvml_report(5)["error"]
