"""Megatron-LM's own pretrain_gpt.py (vendored, patched with the native --kareus-plan flag) with
--cuda-graph-impl local: the hook sees Megatron-LM's checked arguments and every rank exits 2 with one line
naming the flag, before step 1 (the drop-in refuses the flag before Megatron-LM starts:
tests/runtime/test_cuda_graphs.py). On the newer release: the refusal is the runtime's own check of the arguments the
hook receives, which test_mlm_pretrain_gpt.py shows both releases' patches deliver."""

from __future__ import annotations

import pytest
from mlm_runs import CONFIGS, child_env, mlm_command, run_ranks


@pytest.mark.parametrize("tag", ["core_v0.19.0"])
def test_native_patch_refuses_cuda_graphs_before_step_one(tag, megatron_lm_tree, plan_dir, tmp_path):
    tree = megatron_lm_tree(tag, patched=True)
    config = CONFIGS["pp2"]
    cmd = mlm_command(tree, True, config, plan_dir("pp2"), tmp_path / "run", extra=("--cuda-graph-impl", "local"))
    results = run_ranks(cmd, tmp_path, child_env(KAREUS_SIMULATED_LOG=str(tmp_path / "clocks.jsonl")))
    for rank, r in enumerate(results):
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and "Traceback" not in r.stderr, (
            f"rank {rank}: exit {r.returncode}\n{r.stderr[-3000:]}"
        )
        assert len(lines) == 1 and "CUDA graphs are on" in lines[0] and "--cuda-graph-impl local" in lines[0], lines
        assert "iteration        1/" not in r.stdout  # Megatron-LM's log line of step 1
    assert not (tmp_path / "clocks.jsonl").exists()  # no session was started
