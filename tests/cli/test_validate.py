"""`kareus validate --dry-run` and `kareus calibrate --run --dry-run`: the GPU kits on the simulated backend.

The simulated GPU writes every clock call to KAREUS_SIMULATED_LOG, so the read-only mode's promise (no
set, no reset) is checked on what the device saw, not on what the kit says it did.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kareus_megatron.cli.main import main
from kareus_megatron.cost.calibration import calibration_from_dict
from kareus_megatron.hardware.gpus import gpu_spec

REPORT_KEYS = {
    "format",
    "mode",
    "dry_run",
    "backend",
    "gpu",
    "sizes",
    "identity",
    "clocks",
    "energy_counter",
    "planned_sweep_s",
    "sweep",
    "kernels",
    "accuracy",
    "clock_calls",
    "device_recorded",
    "not_run",
    "elapsed_s",
    "budget_s",
    "runtime",
}
KERNELS = {"gemm", "attention", "copy", "idle"}
RUNTIME_CHECKS = {"megatron_patch", "event_alignment", "partitioned_layer"}


def _check_runtime(report):
    """The runtime checks ran (subprocess, read-only device) and are no longer listed as not run."""
    rt = report["runtime"]
    assert rt["status"] == "ok" and rt["format"] == "kareus-selfcheck/1" and rt["dry_run"], rt.get("message")
    assert {c: rt[c]["status"] for c in RUNTIME_CHECKS} == dict.fromkeys(RUNTIME_CHECKS, "ok")
    assert rt["megatron_patch"]["losses_identical"] and rt["megatron_patch"]["read_only"]
    assert not RUNTIME_CHECKS & set(report["not_run"])
    assert report["elapsed_s"] >= rt["wall_s"] > 0


def _events(log):
    return [json.loads(line)["event"] for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def sim_log(tmp_path, monkeypatch):
    log = tmp_path / "sim.jsonl"
    monkeypatch.setenv("KAREUS_SIMULATED_LOG", str(log))
    monkeypatch.delenv("KAREUS_GPU_READ_ONLY", raising=False)
    return log


def test_full_dry_run_writes_report_plot_and_calibration(tmp_path, sim_log, capsys):
    out = tmp_path / "v"
    assert main(["validate", "--dry-run", "--out", str(out)]) == 0
    report = json.loads((out / "validate.json").read_text())
    assert REPORT_KEYS | {"lock_reset", "calibration"} <= set(report)
    assert report["format"] == "kareus-validate/1" and report["mode"] == "full" and report["dry_run"]
    assert set(report["kernels"]) == KERNELS
    for row in report["kernels"].values():  # >= 6 locked clocks per kernel, each with the preset's prediction
        assert len(row["clocks_mhz"]) >= 6 and len(row["preset_power_w"]) == len(row["clocks_mhz"])
        assert "calibrated_power_w" in row
    assert set(report["accuracy"]) == {"preset", "calibrated"}
    assert {"time_ratio_mape_pct", "power_mape_pct"} <= set(report["accuracy"]["preset"])
    lock = report["lock_reset"]
    assert lock["locked_ok"] == lock["tried"] >= 6 and lock["applied_s_median"] > 0
    assert lock["preset_clock_latency_s"] == gpu_spec(report["gpu"]).clock_latency_s  # the latency plans assume
    calibration_from_dict(json.loads((out / "validate.calib.json").read_text()))
    assert (out / "validate.png").stat().st_size > 10_000
    ev = _events(sim_log)
    assert ev.count("set") == report["clock_calls"]["set"] > 0 and "reset" in ev
    _check_runtime(report)
    printed = capsys.readouterr().out
    assert "wrote" in printed and "runtime checks" in printed
    assert "plans assume 15 ms (kareus plan --clock-latency-ms)" in printed
    # a dry run is simulated and says so; no Python None nor a 0.0 ms counter period (a newcomer's first hour)
    assert printed.startswith("kareus validate (full, dry run) on simulated GPU 0 "), printed
    assert "UUID matches CUDA: n/a (CUDA not initialised)" in printed and "None" not in printed
    assert re.search(r"energy counter updates every (\d+ µs|\d+\.\d ms)\n", printed) and " 0.0 ms" not in printed


def test_read_only_dry_run_changes_nothing_on_the_gpu(tmp_path, sim_log):
    out = tmp_path / "v"
    assert main(["validate", "--dry-run", "--no-clock-control", "--out", str(out)]) == 0
    report = json.loads((out / "validate.json").read_text())
    assert REPORT_KEYS <= set(report) and "lock_reset" not in report and "calibration" not in report
    assert report["mode"] == "read_only"
    assert report["clock_calls"] == {"set": 0, "reset": 0} and report["device_recorded"] == []
    _check_runtime(report)
    ev = _events(sim_log)
    assert ev and "set" not in ev and "reset" not in ev, ev
    assert not (out / "validate.calib.json").exists()
    # every kernel measured once per repeat at the running clock, power against the preset's at that clock:
    # the simulated GPU draws the model's power for the model's activity, so only the wiring can be off
    assert {len(r["clocks_mhz"]) for r in report["kernels"].values()} == {1}
    assert report["accuracy"]["preset"]["power_mape_pct"] < 5.0


def test_calibrate_run_dry_run_is_randomised_interleaved_and_records_temperature(tmp_path, sim_log, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--run", "--dry-run", "-o", str(out)]) == 0
    cal = calibration_from_dict(json.loads(out.read_text()))
    proto = cal.fit["protocol"]
    windows = proto["windows"]
    assert proto["repeats"] >= 2 and proto["warmup"]["seconds"] > 0
    assert all(w["temperature_start_c"] is not None and w["temperature_end_c"] is not None for w in windows)
    clocks = [w["clock_mhz"] for w in windows if w["repeat"] == 0]
    assert clocks != sorted(clocks) and clocks != sorted(clocks, reverse=True)  # not a monotone sweep
    last_of_first = max(i for i, w in enumerate(windows) if w["repeat"] == 0)
    assert all(w["repeat"] == 1 for w in windows[last_of_first + 1 :])  # repeats interleaved, not back to back
    assert {w["kernel"] for w in windows} == {"gemm", "copy", "idle"}
    assert "reset" in _events(sim_log)


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "--dry-run", "--seconds", "0"],
        ["validate", "--dry-run", "--seconds", "1e9"],
        ["calibrate", "--dry-run", "--profile", "x.csv"],
    ],
)
def test_bad_flags_are_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("--seconds" in err[0] or "--dry-run" in err[0]), err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "signum"),
    [
        (["validate", "--dry-run"], signal.SIGTERM),
        (["calibrate", "--run", "--dry-run", "--seconds", "0.2"], signal.SIGTERM),
        (["validate", "--dry-run"], signal.SIGHUP),
    ],
    ids=["validate-term", "calibrate-term", "validate-hup"],
)
def test_a_kit_stopped_by_a_signal_resets_the_clocks_it_locked(tmp_path, argv, signum):
    """`timeout`, a job's time limit (SIGTERM) or a closed terminal (SIGHUP) ended the kit at once, and an NVML clock
    lock outlives its process: the GPU stayed locked. Now the kit resets what it locked, then one line and 143."""
    log = tmp_path / "sim.jsonl"
    env = {**os.environ, "KAREUS_SIMULATED_LOG": str(log)}
    env.pop("KAREUS_GPU_READ_ONLY", None)
    cmd = [sys.executable, "-m", "kareus_megatron.cli.main", *argv]
    if argv[0] == "validate":
        cmd += ["--out", str(tmp_path / "v")]
    else:
        cmd += ["-o", str(tmp_path / "c.json")]
    p = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # the signal as a terminal leaves it: under nohup (a suite started so) SIGHUP is ignored, and stays so in kareus
        preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while "set" not in _events(log):  # a clock is locked
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1]
        time.sleep(0.02)
    p.send_signal(signum)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert err.strip().splitlines()[-1] == f"kareus {argv[0]}: terminated", err
    ev = [e for e in _events(log) if e in ("set", "reset")]
    assert ev[-1] == "reset", ev  # the last clock call: the lock undone
