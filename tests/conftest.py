"""Shared pytest setup: the ``gpu`` marker (real NVIDIA GPU through NVML), skipped where NVML is absent."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a real NVIDIA GPU reachable through NVML; skipped when NVML does not initialise"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from kareus_megatron.hardware.device.nvml import nvml_available

    if nvml_available():
        return
    skip = pytest.mark.skip(reason="NVML did not initialise (no NVIDIA driver/GPU on this machine)")
    for item in gpu_items:
        item.add_marker(skip)
