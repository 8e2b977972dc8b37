"""The run-log fit (cost/calibrate_log.py) on synthetic runs under a hidden truth (benchmarks/synthetic_log.py)."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from synthetic_log import BIG, CLOCKS, TINY, TRUTH_PARAMS, make_plan, plan_prediction, truth_calibration, write_log  # noqa: E402

from kareus_megatron.cost.calibrate_log import LogRun, fit_from_logs  # noqa: E402
from kareus_megatron.cost.calibrate_log_data import FitData, column_errors, prepare  # noqa: E402
from kareus_megatron.cost.calibration import Calibration  # noqa: E402
from kareus_megatron.cost.kernel import KernelModel  # noqa: E402
from kareus_megatron.cost.params import KernelParams  # noqa: E402
from kareus_megatron.errors import CalibrationError  # noqa: E402
from kareus_megatron.hardware.gpus import GPUSpec  # noqa: E402
from kareus_megatron.plan.io import load_plan  # noqa: E402
from kareus_megatron.plan.workload import plan_workload  # noqa: E402
from kareus_megatron.report.measurements import energy_windows, instruction_samples  # noqa: E402
from kareus_megatron.report.runlog import read_run_log  # noqa: E402


def _run(log_dir: Path, plan_path: Path, min_window_s: float) -> tuple[GPUSpec, LogRun]:
    gpu, model, par = plan_workload(load_plan(plan_path))
    log = read_run_log(log_dir)
    return gpu, LogRun(
        label=str(log_dir),
        model=model,
        par=par,
        samples=instruction_samples(log),
        windows=energy_windows(log, min_window_s=min_window_s),
    )


def _truth_value(gpu: GPUSpec, name: str) -> float:
    if name in TRUTH_PARAMS:
        return TRUTH_PARAMS[name]
    return float(getattr(gpu, name) if hasattr(gpu, name) else getattr(KernelParams(), name))


NO_BANDS = ["--band-samples", "0"]  # the plans' prediction bands: none is read here


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> Path:
    """megatron-00 of `kareus plan` of TINY, shared: the tests only read it (each writes its own log)."""
    return make_plan(tmp_path_factory.mktemp("tiny-plan") / "plan", [*TINY, *NO_BANDS])


@pytest.fixture(scope="module")
def big_plan(tmp_path_factory) -> Path:
    """megatron-00 of `kareus plan` of BIG (llama3.2-3b, PP=4, a100-sxm4-40gb), shared like tiny_plan."""
    return make_plan(tmp_path_factory.mktemp("big-plan") / "plan", [*BIG, *NO_BANDS])


@pytest.fixture(scope="module", params=["tiny", "big"])
def case(request, tmp_path_factory):
    """(name, plan dir, fitted calibration, fit wall time s) of one synthetic run."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "tiny":
        plan, iters, window = request.getfixturevalue("tiny_plan"), 40, 0.01
    else:
        plan, iters, window = request.getfixturevalue("big_plan"), 4, 1.0
    log = write_log(tmp / "log", plan, truth_calibration(), iters_per_clock=iters)
    gpu, run = _run(log, plan, window)
    t0 = time.perf_counter()
    cal = fit_from_logs([run], gpu)
    return request.param, plan.parents[1], cal, time.perf_counter() - t0


def test_identified_parameters_are_recovered_within_5_percent(case):
    name, _, cal, fit_s = case
    gpu = plan_workload(load_plan(case[1] / "plans" / "megatron-00.json"))[0]
    params = cal.fit["parameters"]
    identified = [n for n, p in params.items() if p["identified"]]
    assert identified, params
    for n in identified:
        assert params[n]["value"] == pytest.approx(_truth_value(gpu, n), rel=0.05), (n, params[n])
    # parameters with no effect on these instructions (TP=1: no TP collective) stay at their prior
    for n in ("nvlink_efficiency", "comm_compute_activity"):
        assert params[n]["status"] == "prior" and params[n]["value"] == params[n]["prior"], params[n]
    print(f"{name}: fit took {fit_s:.1f} s; identified {identified}")
    assert fit_s < 60


def test_the_fit_records_its_posterior_correlations_for_the_prediction_bands(case):
    """Issue 24 item 5: the posterior's correlations are in the file, and the bands' draws use them."""
    from kareus_megatron.cost.uncertainty import parameter_prior

    _, plan_dir, cal, _ = case
    rec = cal.fit["correlation"]
    assert rec["names"] == list(cal.fit["parameters"])
    corr = np.array(rec["matrix"])
    assert np.allclose(corr, corr.T)
    assert np.allclose(np.diag(corr), 1.0)
    assert np.abs(corr[~np.eye(len(corr), dtype=bool)]).max() > 0.1  # the fit's parameters are not independent
    gpu = plan_workload(load_plan(plan_dir / "plans" / "megatron-00.json"))[0]
    prior = parameter_prior(KernelModel(gpu, cal))
    a, b = (prior.names.index(n) for n in ("gemm_efficiency", "time_scale"))
    i, j = (rec["names"].index(n) for n in ("gemm_efficiency", "time_scale"))
    assert prior.correlation[a, b] == pytest.approx(corr[i, j])
    assert prior.calibrated


def test_plans_predicted_under_the_fit_match_the_truth_within_3_percent(case):
    _, plan_dir, cal, _ = case
    truth = truth_calibration()
    preset = Calibration(gpu=truth.gpu, params={})
    for point in ("megatron-00", "perseus-01"):
        t_true, e_true = plan_prediction(plan_dir / "plans" / f"{point}.json", truth)
        t_fit, e_fit = plan_prediction(plan_dir / "plans" / f"{point}.json", cal)
        t_pre, e_pre = plan_prediction(plan_dir / "plans" / f"{point}.json", preset)
        assert t_fit == pytest.approx(t_true, rel=0.03) and e_fit == pytest.approx(e_true, rel=0.03), point
        assert abs(e_pre / e_true - 1) > 0.1  # the preset starts far off
    cols = cal.fit["columns"]
    assert cols["energy"]["before"]["rms_pct"] > 10 and cols["energy"]["after"]["rms_pct"] < 3
    assert cols["time"]["after"]["rms_pct"] < 2 and cols["ratio"]["after"]["rms_pct"] < 2


def test_a_board_limit_below_the_presets_is_identified(big_plan, tmp_path):
    """Issue 24 item 6: a GPU whose board limit (340 W) is below its preset's (400 W) and binds at the top clocks
    (power flat there, times that stop shrinking): the fit finds the limit, and the plan's predictions follow."""
    truth = truth_calibration({**TRUTH_PARAMS, "power_limit_w": 340.0})
    gpu, run = _run(write_log(tmp_path / "log", big_plan, truth, iters_per_clock=2), big_plan, 1.0)
    cal = fit_from_logs([run], gpu)
    limit = cal.fit["parameters"]["power_limit_w"]
    assert limit["status"] == "identified", limit
    assert limit["value"] == pytest.approx(340.0, rel=0.02)
    (t_true, e_true), (t_fit, e_fit) = plan_prediction(big_plan, truth), plan_prediction(big_plan, cal)
    assert t_fit == pytest.approx(t_true, rel=0.01)
    assert e_fit == pytest.approx(e_true, rel=0.01)


def test_the_truth_reproduces_a_noiseless_run_exactly(tiny_plan, tmp_path):
    """The batched prediction (one op_profile call per workload) is instruction_cost's, energy model included."""
    plan = tiny_plan
    log = write_log(tmp_path / "log", plan, truth_calibration(), iters_per_clock=3, noise=0.0)
    gpu, run = _run(log, plan, 0.001)
    d: FitData = prepare([run], gpu)
    errors = column_errors(KernelModel(gpu, truth_calibration()), d)
    n = len(CLOCKS)  # 2 stages x 2 kinds at every clock; ratios against the highest one
    assert errors["time"]["points"] == 2 * 2 * n and errors["ratio"]["points"] == 2 * 2 * (n - 1)
    for col in ("time", "ratio", "energy"):
        assert errors[col]["max_pct"] < 1e-6, (col, errors[col])
    assert column_errors(KernelModel(gpu), d)["energy"]["max_pct"] > 5


def test_one_clock_is_too_few_to_fit_time_ratios(tiny_plan, tmp_path):
    plan = tiny_plan
    log = write_log(tmp_path / "log", plan, truth_calibration(), clocks=(1410,), iters_per_clock=20)
    gpu, run = _run(log, plan, 0.01)
    with pytest.raises(CalibrationError, match=r"too few SM clocks.*1410 MHz"):
        fit_from_logs([run], gpu)


def test_a_sample_outside_the_plan_is_refused(tiny_plan, tmp_path):
    plan = tiny_plan
    log = write_log(tmp_path / "log", plan, truth_calibration(), iters_per_clock=3)
    gpu, run = _run(log, plan, 0.001)
    bad = dataclasses.replace(run.samples[0], pp_rank=5)
    with pytest.raises(CalibrationError, match="pp_rank 5 outside the plan's 2 stages"):
        fit_from_logs([dataclasses.replace(run, samples=[bad, *run.samples])], gpu)
    with pytest.raises(CalibrationError, match="no instruction samples"):
        fit_from_logs([dataclasses.replace(run, samples=[])], gpu)
