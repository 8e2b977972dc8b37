"""Shared pytest setup: the ``gpu`` marker (real NVIDIA GPU through NVML), skipped where NVML is absent, and the
``e2e`` marker. ``make test`` runs two workers with ``pytest -n 2 --dist loadfile``: a file's tests stay on one worker,
so its module fixtures (real multi-process runs) are built once. (``--dist loadgroup`` with an ``xdist_group`` per
file did not hold under pytest 9 with xdist 3.8: the group suffix xdist writes into the node id is no longer read, and
tests of one file ran on both workers, each building the file's fixtures.) Tests under END_TO_END (real multi-process
runs of Megatron-LM, megatron-core, DeepSpeed and the try-outs, 5 s to 2 min each) carry the ``e2e`` marker: ``make
test-fast`` leaves them out (``-m "not e2e"``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

# Every process the suite starts (the xdist workers and what the tests launch, which inherit os.environ) imports
# _site/sitecustomize.py: at exit it skips the final collections over torch's objects (its docstring has the figures).
EXIT_QUICKLY = str(Path(__file__).resolve().parent / "_site")


def pytest_configure(config: pytest.Config) -> None:
    # The processes started from here write the .pyc of what they import, where the machine sets
    # PYTHONDONTWRITEBYTECODE (this one and CI): the environment is not compiled ahead (Makefile), so each module is
    # compiled once, by the first process that imports it, not by every rank again.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    # An ignored SIGINT survives exec: a suite started as a script's background job (`make test &`, nohup in a
    # script) would start every trainer ignoring it, and the tests that interrupt one (test_session_signals.py,
    # test_durable_log.py) would see it go on. The suite starts its processes with SIGINT as a terminal leaves it.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if EXIT_QUICKLY not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, EXIT_QUICKLY])
    config.addinivalue_line(
        "markers", "gpu: needs a real NVIDIA GPU reachable through NVML; skipped when NVML does not initialise"
    )
    config.addinivalue_line("markers", "e2e: a real multi-process run (tests/conftest.py END_TO_END); test-fast skips")


# The slowest files of the suite (measured with --durations: together about three quarters of its time), slowest first.
# xdist's default order (files with the most tests first) runs them last, and is kept. Run first
# (--no-loadscope-reorder), they made test_durable_log's SIGINT case hang in 2 of 2 clean-clone runs before the signal
# handler's deadlock was fixed, and after it the suite was slower: 649 s of tests against 620 s in default order (one
# clean-clone `.ci/run` each, 2026-12-06): the heaviest runs then share the cores with each other, not with short tests.
# Also not kept: the files that mostly wait (test_auto_run, test_mlm_auto, test_try_out_kills) in a third pytest process
# beside the workers: 572 -> 552 s for the workers (its CPU slows them); test_auto_run's drift test re-planned twice.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = item.path.relative_to(config.rootpath).as_posix()
        if rel.startswith(END_TO_END):
            item.add_marker(pytest.mark.e2e)
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
