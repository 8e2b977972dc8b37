"""Shared pytest setup: the ``gpu`` marker (real NVIDIA GPU through NVML), skipped where NVML is absent, and the
``xdist_group`` of every test for ``make test``'s two workers (``pytest -n 2 --dist loadgroup``): a file's tests stay
on one worker (module fixtures that start real runs are built once), and all of ``tests/megatron_lm/`` shares one
(its session fixtures extract and patch the Megatron-LM trees)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a real NVIDIA GPU reachable through NVML; skipped when NVML does not initialise"
    )


SHARED_SESSION_DIRS = ("megatron_lm",)  # test directories whose files share session fixtures: one worker each


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = item.path.relative_to(config.rootpath).as_posix()
        parts = rel.split("/")
        shared = len(parts) > 2 and parts[1] in SHARED_SESSION_DIRS
        item.add_marker(pytest.mark.xdist_group("/".join(parts[:2]) if shared else rel))
    _skip_gpu_tests_without_nvml(items)


def _skip_gpu_tests_without_nvml(items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from kareus_megatron.hardware.device.nvml import nvml_available

    if nvml_available():
        return
    skip = pytest.mark.skip(reason="NVML did not initialise (no NVIDIA driver/GPU on this machine)")
    for item in gpu_items:
        item.add_marker(skip)
