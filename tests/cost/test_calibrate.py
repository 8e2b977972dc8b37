"""Perseus profile reader (cost/profile.py), calibration files and the least-squares fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kareus_megatron.cost import KernelModel
from kareus_megatron.cost.calibrate import fit_calibration, profile_series, series_metrics
from kareus_megatron.cost.calibration import Calibration, load_calibration, save_calibration
from kareus_megatron.cost.profile import (
    COLUMNS,
    StageProfile,
    format_perseus_csv,
    parse_perseus_profile,
    read_perseus_profile,
)
from kareus_megatron.errors import CalibrationError, ProfileError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.parallel import make_parallel

FIXTURE = Path(__file__).parents[1] / "data" / "perseus_gpt3_stage0_7.csv"
HEADER = ",".join(COLUMNS) + "\n"


def test_reads_the_fixture():
    p = read_perseus_profile(FIXTURE)
    assert len(p) == 52 and p.series() == [(0, "backward"), (0, "forward"), (7, "backward"), (7, "forward")]
    f, t, e = p.select(0, "forward")
    assert f[0] == 1410 and np.all(np.diff(f) < 0)
    assert 450 < (e / t)[0] < 500  # ~475 W at 1410 MHz (PROVENANCE.md)


@pytest.mark.parametrize(
    "text, match",
    [
        ("stage,instruction,frequency,time\n0,forward,1410,1\n", "lacks column"),
        (HEADER + "0,forward,fast,1,1\n", "frequency = 'fast' is not a number"),
        (HEADER + "0,forward,1410,nan,1\n", "finite"),
        (HEADER + "0,forward,1410,1,-2\n", "must be positive"),
        (HEADER + "0,forward,1410,0,1\n", "must be positive"),
        (HEADER + "0,forward,1410,1,1\n0,forward,1410,2,2\n", "duplicate of line 2"),
        (HEADER + "0,sideways,1410,1,1\n", "instruction = 'sideways'"),
        (HEADER + "-1,forward,1410,1,1\n", "stage"),
        (HEADER + "0,forward,1410.5,1,1\n", "whole number"),
        (HEADER + "0,forward,1410,,1\n", "time is empty"),
        (HEADER, "no rows"),
    ],
)
def test_bad_profiles_name_the_problem(text, match):
    with pytest.raises(ProfileError, match=match):
        parse_perseus_profile(text)


def test_missing_file():
    with pytest.raises(ProfileError, match="cannot read"):
        read_perseus_profile("/nonexistent/profile.csv")


_cell = st.one_of(
    st.integers(-5, 2000).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["forward", "backward", "", "x", "1e400", " 3 "]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_cell, _cell, _cell, _cell, _cell), max_size=6), st.permutations(list(COLUMNS)))
@example([("1", "forward", "0", "1", "9.223372036854776e+18")], ["time", "instruction", "stage", "energy", "frequency"])
@example([("1e300", "forward", "1", "1", "1")], ["stage", "instruction", "frequency", "time", "energy"])
def test_parser_accepts_or_raises_profile_error(rows, header):
    text = ",".join(header) + "\n" + "".join(",".join(r) + "\n" for r in rows)
    try:
        p = parse_perseus_profile(text)
    except ProfileError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(p, StageProfile) and len(p) == len(rows)
    assert np.all(p.time_s > 0) and np.all(p.energy_j > 0) and np.all(np.isfinite(p.power_w))
    assert set(p.instruction) <= {"forward", "backward"}


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 7),
            st.sampled_from(["forward", "backward"]),
            st.integers(200, 2000),
            st.floats(1e-6, 1e3),
            st.floats(1e-6, 1e5),
        ),
        max_size=8,
        unique_by=lambda r: (r[0], r[1], r[2]),
    )
)
def test_csv_round_trip(rows):
    if not rows:
        return
    p = parse_perseus_profile(format_perseus_csv(rows))
    assert [
        (int(s), str(i), int(f), float(t), float(e))
        for s, i, f, t, e in zip(p.stage, p.instruction, p.frequency_mhz, p.time_s, p.energy_j)
    ] == rows


def _gpt3():
    m = model_spec("gpt3-175b")
    return m, make_parallel(m, tp=8, pp=8, micro_batch_size=1, seq_length=2048)


def test_fit_reproduces_the_measured_profile(tmp_path, capsys):
    m, par = _gpt3()
    gpu = gpu_spec("a100-sxm4-80gb")
    prof = read_perseus_profile(FIXTURE)
    cal = fit_calibration(prof, gpu, m, par, fit_abs_time=False)
    assert "time ratio" in capsys.readouterr().out  # the per-column report is printed
    after = series_metrics(KernelModel(gpu, cal), profile_series(prof, m, par))
    assert after["time_ratio_mape_pct"] <= 3 and after["power_mape_pct"] <= 5
    assert after["argmin_clock_err_max_mhz"] <= 45
    assert cal.fit["calibrated"]["power_mape_pct"] == pytest.approx(after["power_mape_pct"])
    path = tmp_path / "cal.json"
    save_calibration(cal, path)
    again = load_calibration(path)
    assert again == cal and again.sha256 == cal.sha256


def test_fit_rejects_a_profile_from_another_layout():
    m = model_spec("gpt3-175b")
    par = make_parallel(m, tp=8, pp=4, micro_batch_size=1, seq_length=2048)
    with pytest.raises(CalibrationError, match="--pp 4"):
        fit_calibration(read_perseus_profile(FIXTURE), gpu_spec("a100-sxm4-80gb"), m, par)
    fast = parse_perseus_profile(HEADER + "0,forward,1500,1,400\n0,forward,1410,1.1,420\n")
    with pytest.raises(CalibrationError, match="1500 MHz is not lockable"):
        fit_calibration(fast, gpu_spec("a100-sxm4-80gb"), *_gpt3())


@pytest.mark.parametrize("time_s, energy_j", [([0.1, -0.02], [5.0, 4.0]), ([0.1, 0.2], [5.0, float("nan")])])
def test_fit_refuses_non_positive_measurements(time_s, energy_j):
    # e.g. a backward figure taken as (forward+backward) - forward on a noisy machine
    from kareus_megatron.cost.calibrate import Series, fit_series

    gpu = gpu_spec("a100-sxm4-80gb")
    f = np.array([1410.0, 1200.0])
    bad = Series("stage 0 backward", f, np.array(time_s), np.array(energy_j), lambda km: (f / 1e4, f / 1e2))
    with pytest.raises(CalibrationError, match="'stage 0 backward'.*> 0"):
        fit_series([bad], gpu)


@pytest.mark.parametrize(
    "content, match",
    [
        ("not json", "not JSON"),
        ("[]", "JSON object"),
        ('{"format": "kareus-calibration/9", "gpu": "a40", "params": {}}', "kareus-calibration/9"),
        ('{"format": "kareus-calibration/1", "gpu": "a40", "params": {"warp_speed": 1}}', "warp_speed"),
        ('{"format": "kareus-calibration/1", "gpu": "a40", "params": {"gemm_efficiency": -1}}', "gemm_efficiency"),
        ('{"format": "kareus-calibration/1", "params": {}}', "gpu"),
    ],
)
def test_bad_calibration_files(tmp_path, content, match):
    p = tmp_path / "c.json"
    p.write_text(content)
    with pytest.raises(CalibrationError, match=match):
        load_calibration(p)
    with pytest.raises(CalibrationError, match="cannot read"):
        load_calibration(tmp_path / "missing.json")


def test_calibration_overrides_model():
    cal = Calibration(gpu="a40", params={"gemm_efficiency": 0.5, "static_power_w": 20.0})
    km = KernelModel(gpu_spec("a40"), cal)
    assert km.params.gemm_efficiency == 0.5 and km.gpu.static_power_w == 20.0
    assert json.loads(cal.to_json())["format"] == "kareus-calibration/1"


def test_microbenchmark_fit_recovers_a_known_gpu():
    """Measurements synthesised from a GPU with known parameters; the fit starts from the preset."""
    import dataclasses

    from kareus_megatron.cost.calibrate import (
        MICROBENCH_CLOCK_STEP_MHZ,
        MICROBENCH_LOWEST_FRACTION,
        fit_microbenchmarks,
        microbench_ops,
        microbench_series,
    )
    from kareus_megatron.cost.params import KernelParams
    from kareus_megatron.hardware.gpus import clock_grid_mhz

    preset = gpu_spec("a100-sxm4-40gb")
    true_gpu = dataclasses.replace(
        preset,
        static_power_w=45.0,
        idle_dynamic_w=60.0,
        compute_dynamic_w=420.0,
        memory_dynamic_w=70.0,
        voltage_floor=0.75,
        voltage_knee_mhz=1050.0,
    )
    truth = KernelModel.from_params(true_gpu, KernelParams(gemm_efficiency=0.72, memory_efficiency=0.8))
    clocks = list(
        clock_grid_mhz(preset.sm_clocks_mhz, MICROBENCH_CLOCK_STEP_MHZ, MICROBENCH_LOWEST_FRACTION)
    )  # as --run
    meas = {}
    for label, op in microbench_ops().items():
        prof = truth.op_profile([op], np.asarray(clocks, float))
        meas[label] = list(zip(prof.time_s[0], prof.energy_j[0]))
    idle_w = truth.power_w(np.asarray(clocks, float), 0.0, 0.0)
    meas["idle"] = [(1.5, 1.5 * p) for p in idle_w]
    cal = fit_microbenchmarks(preset, clocks, meas, "synthetic", verbose=False)
    fitted = KernelModel(preset, cal)
    m = series_metrics(fitted, microbench_series(clocks, meas))
    assert m["time_abs_mape_pct"] < 1.0 and m["power_mape_pct"] < 1.5
    assert cal.params["gemm_efficiency"] == pytest.approx(0.72, rel=0.05)
    assert cal.params["memory_efficiency"] == pytest.approx(0.8, rel=0.05)
    assert cal.params["p_blocked_w"] == pytest.approx(float(np.median(idle_w)))
    f = np.asarray(clocks, float)
    assert np.allclose(fitted.power_w(f, 0.0, 0.0), idle_w, rtol=0.03)
    assert np.allclose(fitted.power_w(f, 1.0, 0.1), truth.power_w(f, 1.0, 0.1), rtol=0.03)
