"""Read-only means no GPU setting changes, on every command and runtime path that opens NVML (issue 23).

Each path runs as a user runs it, in its own processes, against the stand-in pynvml of tests/fake_nvml, which
appends every changing NVML call (locks, resets, power limits, anything not a getter) of every process to one
log. With KAREUS_GPU_READ_ONLY=1, or with the command's own read-only flag, that log must stay empty; the same
command without read-only mode must write to it (so the harness can see a change when one happens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "fake_nvml"


def _env(tmp_path: Path, read_only: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAREUS_", "CUDA_VISIBLE"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(FAKE), str(ROOT), env.get("PYTHONPATH", "")]),
        KAREUS_FAKE_NVML_LOG=str(tmp_path / "nvml-calls.jsonl"),
        KAREUS_GPU_BACKEND="nvml",
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        **extra,
    )
    if read_only:
        env["KAREUS_GPU_READ_ONLY"] = "1"
    return env


def _changes(tmp_path: Path) -> list[dict]:
    log = tmp_path / "nvml-calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _kareus(tmp_path: Path, args: list[str], read_only: bool, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kareus_megatron.cli.main", *args],
        cwd=tmp_path,
        env=_env(tmp_path, read_only),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_the_stand_in_is_what_the_commands_import(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", "import pynvml; print(pynvml.__file__)"],
        env=_env(tmp_path, False),
        capture_output=True,
        text=True,
    )
    assert r.stdout.strip() == str(FAKE / "pynvml.py")


def test_env_check_permission_changes_nothing(tmp_path):
    for read_only in (True, False):
        r = _kareus(tmp_path, ["env", "--check-permission", "--json"], read_only)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["read_only"] is read_only and rep["nvml"]["name"] == "NVIDIA A40"
        assert "clock_settings" in rep["nvml"]
    assert _changes(tmp_path) == []


def test_env_try_lock_is_refused_read_only_and_locks_once_otherwise(tmp_path):
    r = _kareus(tmp_path, ["env", "--check-permission", "--try-lock"], read_only=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "KAREUS_GPU_READ_ONLY" in r.stderr
    assert _changes(tmp_path) == []
    r = _kareus(tmp_path, ["env", "--check-permission", "--try-lock", "--json"], read_only=False)
    assert r.returncode == 0, r.stderr
    if json.loads(r.stdout)["nvml"]["capability"]:  # root here: the harness sees the one lock and its reset
        assert [c["call"] for c in _changes(tmp_path)] == [
            "nvmlDeviceSetGpuLockedClocks",
            "nvmlDeviceResetGpuLockedClocks",
        ]


@pytest.mark.parametrize("how", ["env", "flag"])
def test_validate_read_only_changes_nothing(tmp_path, how):
    """`kareus validate --dry-run` on NVML (CPU kernels) with KAREUS_GPU_READ_ONLY=1 (and no flag: the
    environment wins) or with --no-clock-control: read-only mode, no set or reset anywhere, the runtime
    self-check subprocess included."""
    args = ["validate", "--dry-run", "--out", str(tmp_path / "v")] + (["--no-clock-control"] if how == "flag" else [])
    r = _kareus(tmp_path, args, read_only=how == "env")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "v" / "validate.json").read_text())
    assert report["mode"] == "read_only" and report["backend"] == "nvml"
    assert report["clock_calls"] == {"set": 0, "reset": 0}
    assert report["runtime"]["status"] == "ok", report["runtime"]
    assert _changes(tmp_path) == []


def test_validate_full_mode_is_seen_by_the_harness(tmp_path):
    r = _kareus(tmp_path, ["validate", "--dry-run", "--out", str(tmp_path / "v")], read_only=False)
    assert r.returncode == 0, r.stderr[-2000:]
    calls = [c["call"] for c in _changes(tmp_path)]
    assert calls.count("nvmlDeviceSetGpuLockedClocks") >= 6 and calls[-1] == "nvmlDeviceResetGpuLockedClocks"


def test_calibrate_run_is_refused_read_only(tmp_path):
    r = _kareus(tmp_path, ["calibrate", "--run", "--dry-run", "-o", str(tmp_path / "cal.json")], read_only=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "KAREUS_GPU_READ_ONLY" in r.stderr and not (tmp_path / "cal.json").exists()
    assert _changes(tmp_path) == []


def test_selfcheck_changes_nothing(tmp_path):
    out = tmp_path / "selfcheck.json"
    for read_only in (True, False):  # the self-check opens its device read-only whatever the environment says
        r = subprocess.run(
            [sys.executable, "-m", "kareus_megatron.runtime.selfcheck", "--dry-run", "--out", str(out)],
            cwd=tmp_path,
            env=_env(tmp_path, read_only),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(out.read_text())["megatron_patch"]["status"] == "ok"
    assert _changes(tmp_path) == []


def _train(tmp_path: Path, read_only: bool, name: str) -> subprocess.CompletedProcess:
    """The generic launcher on 2 gloo ranks (real megatron-core schedule) under a perseus plan for 2 A40s, the
    clock controller in its side process on the (stand-in) NVML device."""
    plan_dir = tmp_path / "plan"
    if not plan_dir.exists():
        r = _kareus(
            tmp_path,
            [
                "plan",
                "--model",
                str(ROOT / "examples" / "tiny-gpt.yaml"),
                "--gpu",
                "a40",
                "--tp",
                "1",
                "--pp",
                "2",
                "--mbs",
                "2",
                "--seq",
                "16",
                "--microbatches",
                "4",
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--precision",
                "fp32",
                "--recompute",
                "none",
                "--methods",
                "perseus",
                "--band-samples",
                "0",  # the run reads perseus-00's clocks, no band
                "--out",
                str(plan_dir),
            ],
            read_only=False,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        (tmp_path / "nvml-calls.jsonl").unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "kareus_megatron.launch",
        "--kareus-plan",
        str(plan_dir),
        "--kareus-point",
        "perseus-00",
        "--kareus-log",
        str(tmp_path / name),
        "--",
        str(ROOT / "examples" / "tiny_train.py"),
        "--iterations",
        "3",
        "--model",
        str(ROOT / "examples" / "tiny-gpt.yaml"),
        "--pp",
        "2",
        "--mbs",
        "2",
        "--seq",
        "16",
        "--microbatches",
        "4",
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path, read_only), capture_output=True, text=True, timeout=240)


def test_launcher_read_only_changes_nothing_and_full_mode_locks(tmp_path):
    r = _train(tmp_path, read_only=True, name="run-ro")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    header = json.loads((tmp_path / "run-ro" / "rank-00000.jsonl").read_text().splitlines()[0])
    assert header.get("read_only") is True
    assert _changes(tmp_path) == []
    r = _train(tmp_path, read_only=False, name="run-full")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "nvmlDeviceSetGpuLockedClocks" in {c["call"] for c in _changes(tmp_path)}
