"""A `kareus solve` plan runs: solved from a Perseus-format profile of the tiny GPT's job, then executed
by the generic launcher on 2 gloo ranks (real megatron-core 1F1B schedule, simulated GPUs)."""

from __future__ import annotations

import csv
import sys

import plans
from test_launchers import ITERS, STANDIN_TRAIN, _check_run, _run_two

from kareus_megatron.cli.main import main
from kareus_megatron.plan.io import load_plan

CLOCKS_MHZ = (1410, 1290, 1170, 1050)  # on the A100's 15 MHz grid


def _profile(path):
    """Per stage and instruction: time grows as the clock falls, energy has its minimum mid-range."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stage", "instruction", "frequency", "time", "energy"])
        for stage in range(2):
            for kind, t0 in (("forward", 0.002), ("backward", 0.004)):
                for f_mhz in CLOCKS_MHZ:
                    t = t0 * (1410 / f_mhz) ** 0.8 * (1.0 + 0.1 * stage)
                    w.writerow([stage, kind, f_mhz, t, t * (90.0 + 0.00012 * f_mhz**2)])
    return path


def test_a_solved_plan_runs_on_the_job_it_names(tmp_path, capsys):
    assert (
        main(
            [
                "solve",
                "--profile",
                str(_profile(tmp_path / "p.csv")),
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--points",
                "3",
                "--gpu",
                plans.GPU,
                "--mbs",
                str(plans.MBS),
                "--seq",
                str(plans.SEQ),
                "--layers-per-stage",
                "1,1",
                "--out",
                str(tmp_path / "solved"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    plan = load_plan(tmp_path / "solved" / "plans" / "solve-01.json")
    assert len({c for r in range(2) for c in plan.clock_sequence(r)}) > 1  # not all at one clock
    (tmp_path / "train.py").write_text(STANDIN_TRAIN)
    cmd = [
        sys.executable,
        "-m",
        "kareus_megatron.launch",
        "--kareus-plan",
        "solved",
        "--kareus-point",
        "solve-01",
        "--kareus-log",
        "run.jsonl",
        "--",
        "train.py",
        "--iters",
        str(ITERS),
        "--microbatches",
        "4",
        "--out",
        str(tmp_path),
    ]
    _check_run(tmp_path, plan, _run_two(cmd, tmp_path))
