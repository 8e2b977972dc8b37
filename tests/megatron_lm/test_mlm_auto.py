"""`--kareus-plan auto` on Megatron-LM's own pretrain_gpt.py: the patched core_v0.19.0 tree's entry point, with the
patch's --kareus-workload (the drop-in takes the generic launcher's path, tests/runtime/test_auto_run.py). 2 gloo
ranks, PP=2, the simulated GPU with a truth (KAREUS_SIMULATED_TRUTH) equal to the preset but for its time scale. The
job profiles itself, calibrates, plans in a side process and every rank switches to the new plan at the same
iteration; the plan then holds against its prediction (checked, no re-plan). A run on the idle 2-core machine:
calibrated from iterations 0-16, switched at 22, checked over 23-30; ITERATIONS leaves room for a slower machine."""

from __future__ import annotations

import json

import pytest
from mlm_runs import CONFIGS, GPU, child_env, megatron_losses, mlm_command, rank_output, run_torchrun

from kareus_megatron.report.measurements import run_events
from kareus_megatron.report.runlog import read_run_log

ITERATIONS = 40


@pytest.mark.parametrize("tag,native", [("core_v0.19.0", True)], ids=["0.19.0-patched"])
def test_pretrain_gpt_closes_the_loop(tag, native, megatron_lm_tree, plan_dir, tmp_path):
    config = CONFIGS["pp2"]
    tree = megatron_lm_tree(tag, patched=native)
    plans = plan_dir("pp2")
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps({"format": "kareus-calibration/1", "gpu": GPU, "params": {"time_scale": 300.0}}))
    args = mlm_command(tree, native, config, plans, tmp_path / "run", extra=("--train-iters", str(ITERATIONS)))
    k = args.index("--kareus-plan")
    args[k : k + 4] = ["--kareus-plan", "auto", "--kareus-workload", str(plans)]  # instead of plan + point
    r = run_torchrun(args, tmp_path, child_env(KAREUS_SIMULATED_TRUTH=str(truth)))
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{rank_output(tmp_path, 0)}\n{rank_output(tmp_path, 1)}"
    assert len(megatron_losses(tmp_path)) == ITERATIONS
    log = read_run_log(tmp_path / "run")
    assert [x["iteration"] for x in log.iterations] == list(range(ITERATIONS)) and not log.partial
    events = run_events(log)
    switches = [e for e in events if e["event"] == "switch"]
    said = [(e["event"], e.get("reason", "")) for e in events if e["event"] not in ("phase",)]
    assert sorted(e["rank"] for e in switches) == [0, 1], said  # both ranks, at the same iteration
    assert len({e["iteration"] for e in switches}) == 1
    versions = {x["iteration"]: {r["plan_version"] for r in x["ranks"]} for x in log.iterations}
    assert all(len(v) == 1 for v in versions.values())  # no iteration where the ranks ran different plans
    (cal,) = [e for e in events if e["event"] == "calibrated"]
    assert cal["iterations"][1] - cal["iterations"][0] + 1 <= 20
    (checked,) = [e for e in events if e["event"] == "checked"]  # the new plan, measured against its prediction
    assert checked["plan_version"] == 1 and checked["iteration"] > switches[0]["iteration"]
    assert not [e for e in events if e["event"] in ("drift", "auto-failed", "objective-unmet")]
