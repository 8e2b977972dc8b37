"""CUDA device -> NVML device: by UUID, CUDA_VISIBLE_DEVICES entries, MIG refused (no torch, no GPU)."""

from __future__ import annotations

import pytest

from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.device.cuda_map import nvml_target


def test_torch_uuid_wins_and_gets_the_nvml_prefix():
    t = nvml_target(1, cuda_uuid="8932f937-d72c-4106-c12f-20bd9faed9f6", visible="3,2")
    assert t.uuid == "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6" and t.cuda_index == 1
    assert nvml_target(0, cuda_uuid="GPU-ab", visible="").uuid == "GPU-ab"


def test_integer_visible_devices_map_to_nvml_indices():
    assert nvml_target(0, visible="3,1").index == 3 and nvml_target(1, visible="3,1").index == 1
    assert nvml_target(1, visible="3,1").uuid is None
    assert nvml_target(2, visible="").index == 2  # nothing hidden: the same index


def test_uuid_entries_and_invalid_tail():
    t = nvml_target(1, visible="GPU-aaaa,GPU-bbbb")
    assert t.uuid == "GPU-bbbb"
    with pytest.raises(ConfigError, match="not among CUDA_VISIBLE_DEVICES.*1 visible"):
        nvml_target(1, visible="2,-1,3")  # CUDA stops at the first invalid entry


def test_mig_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="MIG") as e:
        nvml_target(0, visible="MIG-5c89a4c4-1d2e-5b3f-8d1e-7c4e1f2a3b4c")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="MIG"):
        nvml_target(0, cuda_uuid="MIG-1234")


def test_environment_is_read_when_not_given(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert nvml_target(0).index == 5
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_target(0).index == 0
