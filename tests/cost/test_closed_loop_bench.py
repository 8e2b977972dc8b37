"""benchmarks/closed_loop.py --quick (the closed loop's figures on the tiny GPT) and synthetic_log.py's counter."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module("closed_loop")


def test_quick_mode_prints_every_figure(bench, tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for head in ("[1] PP=2:", "[1] PP=2, energy counter steps", "[2] auto plan", "[3] overhead"):
        assert head in text, text
    doc = json.loads(out.read_text())
    (prof,) = doc["profiling"]
    assert all(prof["smallest"][k] is not None for k in ("max_clock", "kareus")), prof
    assert prof["smallest"]["kareus"]["iterations"] <= bench.WARMUP_ITERATIONS + 5 * 3
    # the exact counter's first schedule against the quantised one's: real counters cost accuracy
    assert doc["quantised"]["rows"][0]["max_clock"] > 2 * prof["rows"][0]["max_clock"]
    (auto,) = doc["auto"]
    assert auto["energy_ratio"] < 1.02 and auto["time_ratio"] < 1 + 1e-6, auto
    assert auto["saving_vs_max"] > 0.02 and auto["profile_iterations"] == 17
    for key in ("overhead_energy_j", "overhead_time_s", "payback_iterations", "planning_s", "planning_energy_j"):
        assert math.isfinite(auto[key]), (key, auto)
    pay = max(auto["overhead_energy_j"], 0) / (auto["iteration_energy_j"] * auto["saving_vs_max"])
    assert auto["payback_iterations"] == pytest.approx(pay)


def test_quantised_counter_telescopes_and_tags_leave_out_each_clocks_first(bench, tmp_path):
    from synthetic_log import TINY, make_plan, truth_calibration, write_log

    from kareus_megatron.report.measurements import energy_windows
    from kareus_megatron.report.runlog import read_run_log

    plan = make_plan(tmp_path / "plan", TINY)
    logs = {
        q: read_run_log(
            write_log(
                tmp_path / f"log-{q}",
                plan,
                truth_calibration(),
                clocks=(1410, 705),
                iters_per_clock=3,
                tags=True,
                energy_quantum_s=q,
            )
        )
        for q in (0.0, 5e-4)
    }

    def energies(log):
        return np.array([[r["energy_j"] for r in rec["ranks"]] for rec in log.iterations])

    exact, stale = energies(logs[0.0]), energies(logs[5e-4])
    assert np.abs(stale / exact - 1).max() > 0.05  # per iteration the stale counter is far off ...
    power = exact.sum(axis=0) / sum(rec["time_s"] for rec in logs[0.0].iterations)
    assert np.all(np.abs(stale.sum(axis=0) - exact.sum(axis=0)) <= 5e-4 * power * 1.5)  # ... its sum is not
    windows = energy_windows(logs[0.0], min_window_s=1e-6)
    # 2 warm-up + 2 x 3 iterations: the warm-up and the first at each clock are left out
    assert sorted({w.iterations[0] for w in windows}) == [3, 4, 6, 7]
