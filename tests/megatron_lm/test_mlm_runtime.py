"""A runtime that never surprises, on Megatron-LM's own pretrain_gpt.py under torchrun (2 gloo ranks, CPU).

A start refused before step 1 (a plan for 8 microbatches against a run of 4) leaves nothing in the
--kareus-log directory that blocks the corrected rerun in the same directory, and the rerun's rank files
each name their own pipeline rank.
"""

from __future__ import annotations

import json

from mlm_runs import CONFIGS, MBS, child_env, mlm_command, rank_output, run_torchrun

TAG = "core_v0.16.1"


def test_a_refused_start_leaves_nothing_that_blocks_the_corrected_rerun(megatron_lm_tree, plan_dir, tmp_path):
    tree = megatron_lm_tree(TAG)
    config = CONFIGS["pp2"]
    log = tmp_path / "run"
    refused, rerun = tmp_path / "refused", tmp_path / "rerun"
    refused.mkdir()
    rerun.mkdir()
    wrong = mlm_command(tree, False, config, plan_dir("pp2", microbatches=8), log, global_batch=MBS * 4)
    r = run_torchrun(wrong, refused, child_env(KAREUS_SIMULATED_LOG=str(refused / "clocks.jsonl")))
    assert r.returncode != 0
    assert not log.exists() or sorted(p.name for p in log.iterdir()) == [], "a refused start left rank files"

    right = mlm_command(tree, False, config, plan_dir("pp2"), log)  # the same --kareus-log directory, mode new
    r = run_torchrun(right, rerun, child_env(KAREUS_SIMULATED_LOG=str(rerun / "clocks.jsonl")))
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{rank_output(rerun, 0)}\n{rank_output(rerun, 1)}"
    for rank in range(2):
        lines = [json.loads(x) for x in (log / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        assert lines[0]["kind"] == "header" and lines[0]["rank"] == rank and lines[0]["pp_rank"] == rank, lines[0]
        assert sum(x["kind"] == "header" for x in lines) == 1
