"""`kareus calibrate --from-log RUN --plan PLAN`: the fit end to end, `kareus plan --calibration`, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from synthetic_log import TINY, make_plan, truth_calibration, write_log  # noqa: E402

from kareus_megatron.cli.main import main  # noqa: E402
from kareus_megatron.cost.calibration import load_calibration  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(tmp dir, plan file, log dir) of a tiny PP=2 run at 6 clocks under the truth."""
    tmp = tmp_path_factory.mktemp("from_log")
    plan = make_plan(tmp / "plan", TINY)
    return tmp, plan, write_log(tmp / "log", plan, truth_calibration(), iters_per_clock=30)


def _calibrate(*args: str) -> list[str]:
    return ["calibrate", "--seconds", "0.01", *args]


def test_from_log_writes_a_calibration_that_kareus_plan_uses(run, capsys):
    tmp, plan, log = run
    out = tmp / "calib.json"
    assert main(_calibrate("--from-log", str(log), "--plan", str(plan), "-o", str(out))) == 0
    text = capsys.readouterr().out
    assert "identified" in text and "window energy" in text and "p_blocked_w" in text
    cal = load_calibration(out)
    params = cal.fit["parameters"]
    assert params["p_blocked_w"]["identified"] and params["nvlink_efficiency"]["status"] == "prior"
    assert cal.fit["columns"]["energy"]["after"]["rms_pct"] < 3 < cal.fit["columns"]["energy"]["before"]["rms_pct"]
    assert (
        main(
            [
                "plan",
                *TINY,
                "--calibration",
                str(out),
                "--methods",
                "megatron,perseus",
                "--points",
                "2",
                "--out",
                str(tmp / "replanned"),
            ]
        )
        == 0
    )
    replanned = json.loads((tmp / "replanned" / "plans" / "megatron-00.json").read_text())
    assert replanned["calibration_sha256"] == cal.sha256


def test_several_runs_with_one_plan(run, capsys):
    tmp, plan, log = run
    log2 = write_log(tmp / "log2", plan, truth_calibration(), clocks=(1410, 960), iters_per_clock=20, seed=1)
    assert main(_calibrate("--from-log", str(log), "--from-log", str(log2), "--plan", str(plan))) == 0
    cal = json.loads(capsys.readouterr().out)  # without -o: the JSON alone on stdout
    assert cal["fit"]["runs"] == [str(log), str(log2)]


@pytest.mark.parametrize(
    "problem", ["no_instructions", "other_plan", "one_clock", "plan_count", "plan_alone", "unwritable", "no_log"]
)
def test_bad_input_is_one_line_and_status_2(run, problem, capsys, tmp_path):
    tmp, plan, log = run
    args = ["--from-log", str(log), "--plan", str(plan)]
    if problem == "no_instructions":
        bare = write_log(tmp_path / "bare", plan, truth_calibration(), iters_per_clock=3, instructions=False)
        args, want = ["--from-log", str(bare), "--plan", str(plan)], "has no per-instruction measurements"
    elif problem == "other_plan":
        args, want = ["--from-log", str(log), "--plan", str(plan.with_name("perseus-00.json"))], "is not the plan"
    elif problem == "one_clock":
        one = write_log(tmp_path / "one", plan, truth_calibration(), clocks=(1410,), iters_per_clock=10)
        args, want = ["--from-log", str(one), "--plan", str(plan)], "too few SM clocks"
    elif problem == "plan_count":
        args, want = [*args, "--from-log", str(log), "--from-log", str(log), "--plan", str(plan)], "--plan files"
    elif problem == "plan_alone":
        args, want = ["--profile", "x.csv", "--plan", str(plan)], "go with --from-log"
    elif problem == "unwritable":
        args, want = [*args, "-o", "/proc/calib.json"], "/proc"
    else:
        args, want = ["--from-log", str(tmp_path / "missing"), "--plan", str(plan)], "no such run log"
    assert main(_calibrate(*args)) == 2
    err = capsys.readouterr().err
    assert want in err and err.count("\n") == 1, err


def test_force_accepts_another_plan_of_the_same_workload(run, capsys):
    tmp, plan, log = run
    other = plan.with_name("perseus-00.json")  # same schedule: only the clocks differ
    assert main(_calibrate("--from-log", str(log), "--plan", str(other), "--force")) == 0


def test_the_subcommand_starts_without_the_fit_machinery():
    code = (
        "import sys; from kareus_megatron.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in ('scipy', 'numpy', 'kareus_megatron.cost.calibrate_log') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
