"""plan/objective.py (the closed loop's objectives) and plan/workload.py (a plan's own workload, re-planned)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kareus_megatron.cost import KernelModel
from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.evaluate import evaluate_plan
from kareus_megatron.plan.io import load_plan
from kareus_megatron.plan.objective import FrontierPoint, Objective, ObjectiveError, parse_objective, select_point
from kareus_megatron.plan.workload import plan_cli_args, plan_workload, write_model_file

ROOT = Path(__file__).resolve().parents[2]
JOB = [
    "--model",
    str(ROOT / "examples" / "tiny-gpt.yaml"),
    "--gpu",
    "a100-sxm4-40gb",
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
]
# `kareus plan` of 4 points without prediction bands or figures: no test here reads one, and the 32 draws were most of
# its time
PLAN = [sys.executable, "-m", "kareus_megatron.cli.main", "plan", "--points", "4", "--band-samples", "0"]
PLAN += ["--no-figures"]


def _pt(i: int, t: float, e: float) -> FrontierPoint:
    return FrontierPoint(method="kareus", index=i, plan_path=Path(f"p{i}"), time_s=t, energy_j=e)


POINTS = [_pt(0, 1.0, 10.0), _pt(1, 1.1, 8.0), _pt(2, 1.3, 7.0), _pt(3, 1.6, 6.5)]


@pytest.mark.parametrize(
    "text, want",
    [
        ("iso-time", Objective("iso-time")),
        ("min-energy", Objective("min-energy")),
        ("max-time=1.5", Objective("max-time", 1.5)),
        (" energy=7.5 ", Objective("energy", 7.5)),
    ],
)
def test_parse(text: str, want: Objective) -> None:
    assert parse_objective(text) == want


@pytest.mark.parametrize("text", ["fastest", "max-time", "max-time=-1", "energy=abc", "iso-time=3", "energy=inf"])
def test_parse_bad(text: str) -> None:
    with pytest.raises(ConfigError, match="--kareus-objective"):
        parse_objective(text)


def test_select() -> None:
    assert select_point(POINTS, Objective("iso-time"), reference_time_s=1.1).index == 1
    assert select_point(POINTS, Objective("iso-time"), reference_time_s=1.0).index == 0
    assert select_point(POINTS, Objective("min-energy")).index == 3
    assert select_point(POINTS, Objective("max-time", 1.35)).index == 2
    assert select_point(POINTS, Objective("energy", 7.5)).index == 2  # the fastest within 7.5 J
    with pytest.raises(ObjectiveError, match="fastest is 1"):
        select_point(POINTS, Objective("max-time", 0.5))
    with pytest.raises(ObjectiveError, match="least is 6.5"):
        select_point(POINTS, Objective("energy", 1.0))


def test_iso_time_allows_the_planners_tolerance_and_agrees_with_the_point_syntax() -> None:
    """The calibrated job of tests/megatron_lm/test_mlm_auto.py under load: the least-energy plan is 0.017% slower
    than the max-clock plan (clock-change lag) and saves 7.7%. iso-time takes it, in the closed loop's objective
    and in --kareus-point iso-time alike; one 0.2% slower is another time; max-time=S stays exact."""
    from kareus_megatron.plan.objective import frontier_choice
    from kareus_megatron.vocab import ISO_REL_TOL

    mega = 1.0166450081633176
    pts = [
        FrontierPoint(method="perseus", index=0, plan_path=Path("p0"), time_s=1.0168138211904123, energy_j=161.1),
        FrontierPoint(method="perseus", index=1, plan_path=Path("p1"), time_s=1.111351958396094, energy_j=153.4),
    ]
    assert select_point(pts, Objective("iso-time"), reference_time_s=mega).index == 0
    ref = [FrontierPoint(method="megatron", index=0, plan_path=Path("m0"), time_s=mega, energy_j=170.0)]
    assert frontier_choice(pts, Objective("iso-time"), reference=ref, fastest_if_none=True).index == 0
    with pytest.raises(ObjectiveError, match="no plan is as fast"):
        select_point(pts, Objective("iso-time"), reference_time_s=pts[0].time_s / (1 + 2 * ISO_REL_TOL))
    with pytest.raises(ObjectiveError, match="no plan is as fast"):
        select_point(pts, Objective("max-time", mega))


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "p"
    subprocess.run([*PLAN, *JOB, "--out", str(out)], check=True, capture_output=True)
    return out


def test_cli_args_replan_the_same_job(planned: Path, tmp_path: Path) -> None:
    """The flags rebuilt from a plan's record plan exactly the same job again."""
    plan = load_plan(planned / "plans" / "kareus-01.json")
    args = plan_cli_args(plan, write_model_file(plan, tmp_path / "model.json"))
    again = tmp_path / "again"
    subprocess.run([*PLAN, *args, "--out", str(again)], check=True, capture_output=True)
    for name in ("kareus-01", "megatron-00"):
        a = json.loads((planned / "plans" / f"{name}.json").read_text())
        b = json.loads((again / "plans" / f"{name}.json").read_text())
        assert a["stages"] == b["stages"] and a["predicted"] == b["predicted"]


def test_evaluate_matches_the_planner(planned: Path) -> None:
    """Under the planner's own model a plan's simulated figures are its predicted ones (precision included)."""
    for name in ("megatron-00", "kareus-00", "kareus-03", "perseus-02"):
        plan = load_plan(planned / "plans" / f"{name}.json")
        gpu, model, par = plan_workload(plan)
        assert par.precision == "fp32" and model.name == "tiny-gpt"
        sim = evaluate_plan(plan, KernelModel(gpu))
        assert sim.time_s == pytest.approx(plan.predicted.iteration_time_s, rel=1e-9)
        assert sim.energy_j == pytest.approx(plan.predicted.iteration_energy_j, rel=1e-9)
    kernel = KernelModel(gpu_spec("a100-sxm4-40gb"))
    slow = load_plan(planned / "plans" / "kareus-03.json")
    t, _ = kernel.instruction_cost(model, par, 0, "forward", np.array([1410.0]))
    assert evaluate_plan(slow, kernel).time_s > 8 * t[0]  # 4 forwards + 4 backwards on the critical path
