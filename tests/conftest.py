"""Shared pytest setup: the ``gpu`` marker (real NVIDIA GPU through NVML), skipped where NVML is absent, and the
``e2e`` marker. ``make test`` runs two workers with ``pytest -n 2 --dist loadfile``: a file's tests stay on one worker,
so its module fixtures (real multi-process runs) are built once. (``--dist loadgroup`` with an ``xdist_group`` per
file did not hold under pytest 9 with xdist 3.8: the group suffix xdist writes into the node id is no longer read, and
tests of one file ran on both workers, each building the file's fixtures.) Tests under END_TO_END (real multi-process
runs of Megatron-LM, megatron-core, DeepSpeed and the try-outs, 5 s to 2 min each) carry the ``e2e`` marker: ``make
test-fast`` leaves them out (``-m "not e2e"``)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a real NVIDIA GPU reachable through NVML; skipped when NVML does not initialise"
    )
    config.addinivalue_line("markers", "e2e: a real multi-process run (tests/conftest.py END_TO_END); test-fast skips")


# The real multi-process runs (about three quarters of the suite's time).
END_TO_END = (
    "tests/runtime/test_auto_run.py",
    "tests/megatron_lm/test_mlm_overlap.py",
    "tests/megatron_lm/test_mlm_auto.py",
    "tests/megatron_lm/",
    "tests/examples/",
    "tests/hardware/test_read_only_paths.py",
    "tests/runtime/overlap/",
    "tests/runtime/deepspeed/",
    "tests/runtime/test_framework_versions.py",
    "tests/runtime/test_durable_log.py",
    "tests/cost/test_fidelity_bench.py",
    "tests/hardware/test_gpu_check.py",
    "tests/runtime/test_truth.py",
    "tests/runtime/test_selfcheck.py",
)


# Files run slowest first (`make test` passes --no-loadscope-reorder, which keeps this order): xdist's default, files
# with the most tests first, leaves these few-test files for the end, where one worker can run a minute-long file while
# the other has nothing left; slowest first, the end is made of sub-second tests. Wall seconds of each file on one of
# two workers (clean clone, 2-core machine, 2026-12-06); a file not listed weighs 0 and keeps its place. (Tried before
# the signal handler's deadlock was fixed, this order made test_durable_log's SIGINT case hang in 2 of 2 runs.)
SLOWEST_FIRST_S = {
    "tests/megatron_lm/test_mlm_overlap.py": 106,
    "tests/examples/test_try_runtime.py": 86,
    "tests/runtime/test_auto_run.py": 85,
    "tests/megatron_lm/test_mlm_pretrain_gpt.py": 82,
    "tests/hardware/test_read_only_paths.py": 62,
    "tests/runtime/test_durable_log.py": 60,
    "tests/megatron_lm/test_mlm_auto.py": 56,
    "tests/examples/test_try_out_kills.py": 45,
    "tests/docs/test_doc_blocks.py": 40,
    "tests/runtime/deepspeed/test_deepspeed_example.py": 40,
    "tests/runtime/test_framework_versions.py": 29,
    "tests/hardware/test_gpu_check.py": 27,
    "tests/runtime/overlap/test_overlap_bench.py": 23,
    "tests/cli/test_validate.py": 22,
    "tests/cli/test_cli_plan.py": 21,
    "tests/cost/test_fidelity_bench.py": 19,
    "tests/runtime/test_launchers.py": 19,
    "tests/runtime/overlap/test_planned_is_run.py": 17,
    "tests/runtime/test_truth.py": 15,
    "tests/runtime/overlap/test_overlap_cp.py": 14,
    "tests/docs/test_docs_site.py": 13,
    "tests/runtime/test_session_signals.py": 12,
    "tests/runtime/deepspeed/test_deepspeed_e2e.py": 12,
    "tests/runtime/overlap/test_overlap_layer.py": 11,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    files = {}
    for item in items:
        rel = files.setdefault(item.path, item.path.relative_to(config.rootpath).as_posix())
        if rel.startswith(END_TO_END):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: -SLOWEST_FIRST_S.get(files[item.path], 0))  # stable: a file's tests keep their order
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
