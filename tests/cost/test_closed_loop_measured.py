"""benchmarks/closed_loop_measured.py --quick: the closed loop on the truth fitted to the measured A40 GPT-3 profile."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> tuple[str, dict]:
    """(printed text, --json figures) of one --quick run, shared by the tests below."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = importlib.import_module("closed_loop_measured")
    out = tmp_path_factory.mktemp("measured") / "figures.json"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert bench.main(["--quick", "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    return text.getvalue(), case


def test_quick_mode_prints_every_figure(figures):
    text, case = figures
    for head in (
        "== A40, GPT-3 175B profile",
        "[1] parameters",
        "[2] the max-clock plan's",
        "[3] energy-min",
        "[4] iso",
    ):
        assert head in text, text
    assert case["case"] == "a40-gpt3"
    assert case["truth_against_profile"]["power_mape_pct"] < 5  # the truth is the measurements' fit, not a preset's


def test_the_fit_predicts_power_far_better_than_the_preset(figures):
    """The preset is 10% off on average (19% at worst); the fit, from 17 iterations, a fraction of that."""
    models = figures[1]["clocks"]["models"]
    preset, fit = models["preset"], models["fit"]
    assert preset["power_err_mean"] > 0.08, preset
    assert fit["power_err_mean"] < preset["power_err_mean"] / 4, (fit, preset)
    assert fit["profiled_power_err_max"] < 0.05, fit  # every instruction at every profiled clock within 5%
    assert fit["profiled_time_err_max"] < 0.03, fit


def test_the_fit_holds_the_board_limit_where_the_truth_does(figures):
    """The truth sits at its board limit at the max clock and holds it down to ~1260 MHz; the preset lets go of it
    ~200 MHz higher; the fit finds the limit (identified, within 5%) and where it stops holding (within 60 MHz)."""
    case = figures[1]
    models = case["clocks"]["models"]
    truth, preset, fit = models["truth"], models["preset"], models["fit"]
    top = max(int(f) for f in truth["at"])
    assert truth["at"][str(top)]["power_w"] == pytest.approx(truth["power_limit_w"], rel=0.01)
    assert truth["limit_share_at_max_clock"] > 0.95
    assert fit["limit_share_at_max_clock"] > 0.5
    assert fit["power_limit_w"] == pytest.approx(truth["power_limit_w"], rel=0.05)
    (limit,) = (p for p in case["parameters"] if p["name"] == "power_limit_w")
    assert limit["status"] == "identified", limit
    assert abs(fit["limit_holds_from_mhz"] - truth["limit_holds_from_mhz"]) <= 60, (fit, truth)
    assert abs(preset["limit_holds_from_mhz"] - truth["limit_holds_from_mhz"]) > 150, (preset, truth)


def test_the_fit_finds_the_energy_minimising_clock(figures):
    """Issue 24's target, 60 MHz: the preset misses it by ~200 MHz, the fit meets it."""
    models = figures[1]["clocks"]["models"]
    assert models["preset"]["min_energy_clock_err_max_mhz"] > 150, models["preset"]
    assert models["fit"]["min_energy_clock_err_max_mhz"] <= 60, models["fit"]


def test_the_auto_plan_is_within_1_percent_of_the_truths_plan(figures):
    """Clock changes at once: the auto plan's energy under the truth within 1% of the truth's own iso-time plan's
    and its time within 0.2%; the preset's plan uses over 3% more energy than the truth's."""
    (lat0,) = figures[1]["plans"]
    assert lat0["latency_ms"] == 0
    plans = lat0["plans"]
    assert all(plans[k]["met"] for k in ("truth", "fit", "preset")), plans
    assert plans["fit"]["energy_vs_truth_plan"] < 1.01, plans
    assert plans["fit"]["time_vs_truth_plan"] < 1.002, plans
    assert plans["truth"]["energy_vs_max"] < 0.95, plans  # there is a saving to find
    assert plans["preset"]["energy_vs_truth_plan"] > 1.03, plans
