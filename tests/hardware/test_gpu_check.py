"""benchmarks/gpu_check.py, the read-only GPU check, in its dry run: every step runs (CPU kernels) against the
stand-in pynvml and nvidia-smi, nothing changes a GPU setting, and a setting that does change fails the check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = (
    "nvidia_smi_before",
    "env",
    "energy_counter",
    "selfcheck",
    "host_syncs",
    "nccl_comms",
    "controller",
    "kernels",
    "nvidia_smi_after",
)


def _check(tmp_path: Path, *args: str, **extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAREUS_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "fake_nvml"), str(ROOT)]),
        PATH=os.pathsep.join([str(ROOT / "tests" / "data" / "fake_smi"), env["PATH"]]),
        KAREUS_GPU_BACKEND="nvml",
        KAREUS_FAKE_NVML_LOG=str(tmp_path / "nvml-calls.jsonl"),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        **extra,
    )
    out = tmp_path / "check"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
    return r, report


def test_dry_run_runs_every_step_and_changes_nothing(tmp_path):
    r, report = _check(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert report["format"] == "kareus-gpu-check/1" and report["ok"] and report["read_only"] == "1"
    assert tuple(report["steps"]) == STEPS
    assert {n: s["status"] for n, s in report["steps"].items()} == dict.fromkeys(STEPS, "ok")
    assert report["settings_unchanged"] is True and report["nvml_changes_refused"] == []
    smi = report["steps"]["nvidia_smi_before"]
    assert smi["unknown_fields"] == ["clocks_event_reasons.applications_clocks_setting"]  # asked one by one
    energy = report["steps"]["energy_counter"]
    assert energy["power_usage_w"]["mean_w"] == 150.0  # the stand-in's draw
    assert abs(energy["power_usage_w"]["counter_over_integral"] - 1.0) < 0.05
    assert report["steps"]["host_syncs"]["total_syncs"] == 0
    assert report["steps"]["controller"]["exit_status"] == 0 and report["steps"]["controller"]["read_only"]
    assert report["steps"]["kernels"]["clock_calls"] == {"set": 0, "reset": 0}
    assert not (tmp_path / "nvml-calls.jsonl").exists()  # no process of the check changed a setting
    page = (tmp_path / "check" / "gpu_check.txt").read_text()
    assert page.startswith("kareus GPU check (dry run, read-only)") and "verdict: OK" in page
    assert len(page.splitlines()) <= 60 and all(name in page for name in STEPS)


def test_a_changed_setting_fails_the_check(tmp_path):
    r, report = _check(
        tmp_path,
        "--skip",
        "env,energy_counter,selfcheck,host_syncs,nccl_comms,controller,kernels",
        KAREUS_FAKE_SMI_CHANGE=str(tmp_path / "changed"),
    )
    assert r.returncode == 1
    assert report["settings_unchanged"] is False and not report["ok"]
    assert "verdict: FAILED" in (tmp_path / "check" / "gpu_check.txt").read_text()
