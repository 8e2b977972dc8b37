"""Megatron-LM's own pretrain_gpt.py (vendored core_v0.16.1 and core_v0.19.0) runs a kareus plan on CPU.

Each run: `kareus plan` for the tiny GPT, then torchrun with 2 gloo ranks, --mock-data, 3 iterations,
simulated GPUs, through (a) the drop-in launch/pretrain_gpt.py --megatron-lm-dir TREE and (b) the tree
patched with patches/megatron-lm/<tag>/ and its own pretrain_gpt.py --kareus-plan. Upstream files are
never edited; tests/megatron_lm/mlm_cpu_shim.py makes them run on a CPU (see README.md here).
About 8-14 s per run on 2 cores.
"""

from __future__ import annotations

import json

import pytest
from mlm_runs import CONFIGS, ITERS, MBS, child_env, megatron_losses, mlm_command, rank_output, run_ranks, run_torchrun

from kareus_megatron.cli.main import main
from kareus_megatron.plan.points import load_point_plan
from kareus_megatron.report.runlog import read_run_log

PATHS = {"drop-in": False, "patched": True}
# Each layout on both releases, the entry point alternating between them (the drop-in and the native patch reach
# the same runtime; what differs per release is Megatron-LM's own code around it); the interleaved schedule (vp2)
# on the newer release's native patch. Each run ~11-16 s on 2 cores.
CASES = [
    ("core_v0.16.1", "pp2", "drop-in"),
    ("core_v0.16.1", "tp2", "patched"),
    ("core_v0.19.0", "pp2", "patched"),
    ("core_v0.19.0", "tp2", "drop-in"),
    ("core_v0.19.0", "vp2", "patched"),
]


def _clock_sequences(log_text: str, world: int) -> list[list[int]]:
    """Per GPU (index = local rank), the SM clocks (MHz) the simulated devices were given, in order."""
    recs = [json.loads(line) for line in log_text.splitlines() if line.strip()]
    return [[x["mhz"] for x in recs if x["gpu"] == g and x["event"] in ("set", "skip")] for g in range(world)]


@pytest.mark.parametrize("tag,config_name,path", CASES, ids=[f"{t[6:]}-{c}-{p}" for t, c, p in CASES])
def test_pretrain_gpt_runs_the_plan(tag, config_name, path, megatron_lm_tree, plan_dir, tmp_path, capsys):
    config = CONFIGS[config_name]
    native = PATHS[path]
    tree = megatron_lm_tree(tag, patched=native)
    plans = plan_dir(config_name)
    plan, plan_file = load_point_plan(str(plans), config.point)
    extra = {"KAREUS_SIMULATED_LOG": str(tmp_path / "clocks.jsonl")}
    if native and plan.parallel.tp > 1:
        extra["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron-LM's own requirement; the drop-in sets it itself
    r = run_torchrun(mlm_command(tree, native, config, plans, tmp_path / "run"), tmp_path, child_env(**extra))
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{rank_output(tmp_path, 0)}\n{rank_output(tmp_path, 1)}"
    losses = megatron_losses(tmp_path)
    assert len(losses) == ITERS and all(4.0 < x < 7.0 for x in losses), losses  # untrained: near ln(128) = 4.85

    # every iteration on every rank ran the plan's clocks (TP ranks share their pipeline rank's sequence)
    got = _clock_sequences((tmp_path / "clocks.jsonl").read_text(), 2)
    for rank in range(2):
        pp_rank = rank if config.pp == 2 else 0
        assert got[rank] == plan.clock_sequence(pp_rank) * ITERS, f"rank {rank}"
    run = read_run_log(tmp_path / "run")  # the --kareus-log directory: rank-NNNNN.jsonl
    assert run.header["world"] == 2 and not run.partial and not run.truncated
    assert [x["iteration"] for x in run.iterations] == list(range(ITERS))
    for x in run.iterations:
        assert {s["pp_rank"] for s in x["stages"]} == set(range(config.pp)), x
    assert main(["report", str(tmp_path / "run"), "--plan", plan_file, "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert all(f"stage {s} energy" in out for s in range(config.pp)), out


@pytest.mark.parametrize(
    ("path", "tag"),
    [("drop-in", "core_v0.16.1"), ("patched", "core_v0.19.0")],
    ids=["drop-in-0.16.1", "patched-0.19.0"],
)
def test_mismatched_plan_is_refused_before_step_one(tag, path, megatron_lm_tree, plan_dir, tmp_path):
    """A plan for 8 microbatches against a run of 4: each rank exits 2 with one line on stderr, untrained (each
    path on one release: the refusal is the runtime's own check, the same on both)."""
    native = PATHS[path]
    tree = megatron_lm_tree(tag, patched=native)
    config = CONFIGS["pp2"]
    cmd = mlm_command(tree, native, config, plan_dir("pp2", microbatches=8), tmp_path / "run", global_batch=MBS * 4)
    results = run_ranks(cmd, tmp_path, child_env(KAREUS_SIMULATED_LOG=str(tmp_path / "clocks.jsonl")))
    for rank, r in enumerate(results):
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (
            f"rank {rank}: exit {r.returncode}\n{r.stderr[-3000:]}"
        )
        assert "microbatches per iteration: plan 8, run 4" in lines[0] and "perseus-05" in lines[0], lines[0]
        assert "iteration        1/" not in r.stdout  # Megatron-LM's log line of step 1
    clocks = tmp_path / "clocks.jsonl"
    assert not clocks.exists() or _clock_sequences(clocks.read_text(), 2) == [[], []]


def test_megatron_tensorboard_writer_gets_the_kareus_figures(megatron_lm_tree, plan_dir, tmp_path):
    """--tensorboard-dir: Megatron's own writer (last rank) gets each iteration's measured GPU energy at its step."""
    tree = megatron_lm_tree("core_v0.16.1", patched=False)
    config = CONFIGS["pp2"]
    tb = tmp_path / "tb"
    env = child_env(KAREUS_SIMULATED_LOG=str(tmp_path / "clocks.jsonl"), KAREUS_TEST_TENSORBOARD_LOG=str(tb))
    cmd = mlm_command(tree, False, config, plan_dir("pp2"), tmp_path / "run", extra=("--tensorboard-dir", str(tb)))
    r = run_torchrun(cmd, tmp_path, env)
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{rank_output(tmp_path, 1)}"
    calls = [json.loads(line) for line in (tb / "tb-rank-1.jsonl").read_text().splitlines()]
    assert not (tb / "tb-rank-0.jsonl").exists()  # Megatron keeps its writer on the last rank only
    scalars = {(c["args"][0], c["args"][2]): c["args"][1] for c in calls if c["call"] == "add_scalar"}
    assert ("lm loss", 1) in scalars  # Megatron's own metrics, beside ours
    log = [json.loads(line) for line in (tmp_path / "run" / "rank-00001.jsonl").read_text().splitlines()]
    energy = {rec["iteration"]: rec["energy_j"] for rec in log if rec.get("kind") == "iteration"}
    assert sorted(energy) == list(range(ITERS))
    for i, e in energy.items():  # Megatron numbers the iteration after kareus's i as i + 1
        assert scalars[("kareus/gpu_energy_j", i + 1)] == pytest.approx(e)
        assert ("kareus/planned_iteration_time_s", i + 1) in scalars
