"""A runtime that never surprises, on Megatron-LM's own pretrain_gpt.py under torchrun (2 gloo ranks, CPU).

A start refused before step 1 (a plan for 8 microbatches against a run of 4) leaves nothing in the
--kareus-log directory that blocks the corrected rerun in the same directory, and the rerun's rank files
each name their own pipeline rank. Under `kareus torchrun` the refused start ends with the ranks' first kareus
error as the last line on stderr and exit status 2 (not torchrun's ChildFailedError report and status 1).
`kareus report RUN` then finds the plan the run executed from the log
(where the run named it; moved, beside the log by its sha256; or the log's point of a `--plan DIR`) and refuses
another job's plan in one line, exit 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from mlm_runs import CONFIGS, MBS, RUN_TIMEOUT_S, child_env, mlm_command, rank_output, run_torchrun

from kareus_megatron.cli.main import main

TAG = "core_v0.16.1"


def _kareus_torchrun(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`kareus torchrun --standalone --nproc-per-node 2 ARGS` (each rank's output to cwd/torchrun-logs)."""
    cmd = [
        sys.executable,
        "-m",
        "kareus_megatron.cli.main",
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(cwd / "torchrun-logs"),
        "--redirects",
        "3",
        *args,
    ]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.terminate()  # torchrun stops its workers on SIGTERM
        out, err = p.communicate(timeout=30)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _report(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["report", *args, "--no-plot"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_refused_start_leaves_nothing_that_blocks_the_corrected_rerun(megatron_lm_tree, plan_dir, tmp_path, capsys):
    tree = megatron_lm_tree(TAG)
    config = CONFIGS["pp2"]
    log = tmp_path / "run"
    refused, rerun = tmp_path / "refused", tmp_path / "rerun"
    refused.mkdir()
    rerun.mkdir()
    wrong = mlm_command(tree, False, config, plan_dir("pp2", microbatches=8), log, global_batch=MBS * 4)
    r = _kareus_torchrun(wrong, refused, child_env(KAREUS_SIMULATED_LOG=str(refused / "clocks.jsonl")))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2, f"exit {r.returncode}: {r.stderr[-3000:]}"
    assert last.startswith("kareus torchrun: error: rank ") and "stopped the job (exit status 1)" in last
    assert "microbatches per iteration: plan 8, run 4" in last and "perseus-05" in last, last
    assert not log.exists() or sorted(p.name for p in log.iterdir()) == [], "a refused start left rank files"

    plans = tmp_path / "plan"
    shutil.copytree(plan_dir("pp2"), plans)
    right = mlm_command(tree, False, config, plans, log)  # the same --kareus-log directory, mode new
    r = run_torchrun(right, rerun, child_env(KAREUS_SIMULATED_LOG=str(rerun / "clocks.jsonl")))
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{rank_output(rerun, 0)}\n{rank_output(rerun, 1)}"
    for rank in range(2):
        lines = [json.loads(x) for x in (log / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        assert lines[0]["kind"] == "header" and lines[0]["rank"] == rank and lines[0]["pp_rank"] == rank, lines[0]
        assert sum(x["kind"] == "header" for x in lines) == 1

    # kareus report without --plan: the plan where the run named it, then (moved) beside the log by its sha256
    code, out, err = _report(capsys, str(log))
    assert code == 0 and "plans/perseus-05.json (perseus, " in out and "; recorded in the log)" in out, err
    assert "stage 1 energy" in out
    plans.rename(tmp_path / "kept")
    code, out, err = _report(capsys, str(log))
    assert code == 0 and f"{tmp_path}/kept/plans/perseus-05.json (perseus, " in out, err
    assert "; found beside the log by its sha256)" in out
    code, out, err = _report(capsys, str(log), "--plan", str(tmp_path / "kept"))  # a plan directory: the log's point
    assert code == 0 and "kept/plans/perseus-05.json (perseus, " in out and "; the log's point of --plan)" in out, err
    # another job's plan: one line, exit 2
    others = (
        (plan_dir("pp2", microbatches=8), "microbatches 4 (run) vs 8 (plan)"),
        (plan_dir("tp2") / "plans" / "perseus-05.json", "TP 1 (run) vs 2 (plan); PP 2 (run) vs 1"),
    )
    capsys.readouterr()  # what kareus plan printed
    for other, why in others:
        code, out, err = _report(capsys, str(log), "--plan", str(other))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and why in err, err
        assert "is for another job than run log" in err
    (tmp_path / "kept").rename(tmp_path / "elsewhere-deeper")
    shutil.move(tmp_path / "elsewhere-deeper", tmp_path / "refused" / "a" / "b")
    code, out, err = _report(capsys, str(log))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pass --plan PLAN" in err, err
