"""`kareus plan --framework deepspeed` plans only what DeepSpeed runs: 1 nanobatch for every instruction.

The schedule's nanobatch counts (search/schedules.py SCHEDULE_NANOBATCHES) flow into the option builder:
on ``deepspeed-train`` kareus plans clocks only (and still appears in frontier.json and the reductions,
so ``kareus launch comparison`` runs it), nanobatch_perseus is skipped by default and refused when asked
for; on Megatron's schedules the same job keeps its 2-nanobatch options. No torch, no DeepSpeed here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kareus_megatron.cost import KernelModel
from kareus_megatron.errors import InfeasibleConfigError
from kareus_megatron.search import options as opt
from kareus_megatron.search.schedules import SCHEDULE_NANOBATCHES, overlap_blocker
from kareus_megatron.vocab import SCHEDULES

JOB = [
    "--model",
    "qwen3-1.7b",
    "--tp",
    "4",
    "--pp",
    "2",
    "--dp",
    "1",
    "--mbs",
    "4",
    "--seq",
    "2048",
    "--microbatches",
    "4",
    "--nodes",
    "1",
    "--gpus-per-node",
    "8",
    "--points",
    "3",
    "--freqs",
    "1410,1200,1005",
]


def test_every_schedule_says_which_nanobatches_it_runs():
    assert set(SCHEDULE_NANOBATCHES) == set(SCHEDULES)
    assert overlap_blocker("deepspeed-train").startswith("DeepSpeed's PipelineEngine runs every microbatch whole")
    assert overlap_blocker("1f1b") is None and overlap_blocker("interleaved-1f1b") is None


def test_options_follow_the_schedule():
    from kareus_megatron.cli.main import build_parser
    from kareus_megatron.cli.workload_args import workload_from_args

    args = build_parser().parse_args(["plan", *JOB])
    gpu, model, par = workload_from_args(args)
    kernel = KernelModel(gpu)
    clocks = (1410, 1200)
    megatron = opt.build_options(gpu, model, par, kernel, "kareus", clocks, schedule="1f1b")
    ds = opt.build_options(gpu, model, par, kernel, "kareus", clocks, schedule="deepspeed-train")
    perseus = opt.build_options(gpu, model, par, kernel, "perseus", clocks, schedule="deepspeed-train")
    assert any(2 in o.nanobatches for o in megatron.values())  # TP=4: overlap pays off on Megatron
    for key, o in ds.items():
        assert set(o.nanobatches.tolist()) == {1}
        np.testing.assert_array_equal(o.time_s, perseus[key].time_s)  # clocks only: perseus's options
    with pytest.raises(InfeasibleConfigError, match="nanobatch_perseus.*no nanobatch overlap engine"):
        opt.build_options(gpu, model, par, kernel, "nanobatch_perseus", clocks, schedule="deepspeed-train")


def test_plan_for_deepspeed_has_one_nanobatch_everywhere(tmp_path, capsys):
    from kareus_megatron.cli import main as cli_main

    out = tmp_path / "p"
    assert cli_main.main(["plan", "--framework", "deepspeed", *JOB, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "nanobatch_perseus skipped: DeepSpeed's PipelineEngine runs every microbatch whole" in " ".join(err.split())
    assert "kareus plans SM clocks only (1 nanobatch) for deepspeed" in " ".join(err.split())
    doc = json.loads((out / "frontier.json").read_text())
    assert list(doc["methods"]) == ["megatron", "perseus", "kareus", "powercap"] and "kareus" in doc["reductions"]
    files = sorted((out / "plans").glob("*.json"))
    assert any(f.name.startswith("kareus-") for f in files)
    for f in files:
        plan = json.loads(f.read_text())
        assert plan["framework"] == "deepspeed"
        assert {i.get("nanobatches", 1) for s in plan["stages"] for i in s["instructions"]} == {1}, f.name


def test_nanobatch_perseus_for_deepspeed_is_one_line_exit_2(tmp_path, capsys):
    from kareus_megatron.cli import main as cli_main

    out = tmp_path / "p"
    code = cli_main.main(
        ["plan", "--framework", "deepspeed", "--methods", "nanobatch_perseus", *JOB, "--out", str(out)]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not out.exists()
    assert "nanobatch_perseus" in err and "no nanobatch overlap engine" in err
