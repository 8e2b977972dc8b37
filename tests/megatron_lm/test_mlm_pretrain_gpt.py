"""Megatron-LM's own pretrain_gpt.py (vendored core_v0.16.1 and core_v0.19.0) runs a kareus plan on CPU.

Each run: `kareus plan` for the tiny GPT, then torchrun with 2 gloo ranks, --mock-data, 3 iterations,
simulated GPUs, through (a) the drop-in launch/pretrain_gpt.py --megatron-lm-dir TREE and (b) the tree
patched with patches/megatron-lm/<tag>/ and its own pretrain_gpt.py --kareus-plan. Upstream files are
never edited; tests/megatron_lm/mlm_cpu_shim.py makes them run on a CPU (see README.md here).
About 8-14 s per run on 2 cores.

Each run is launched once (case_run, a module fixture) and checked by several tests: the plan's clocks, losses and
run log (test_pretrain_gpt_runs_the_plan), and Megatron's own TensorBoard writer getting kareus's figures
(--tensorboard-dir on every run). A runtime that never surprises: the 0.16.1 drop-in PP=2 run is the corrected rerun
of a start refused before step 1 under `kareus torchrun` (a plan for 8 microbatches against a run of 4), in the same
--kareus-log directory. The refused start ends with the ranks' first kareus error as the last line on stderr and
exit status 2 (not torchrun's ChildFailedError report and status 1) and leaves nothing there that blocks the rerun,
whose rank files each name their own pipeline rank. `kareus report RUN` then finds the plan the run executed from
the log (where the run named it; moved, beside the log by its sha256; or the log's point of a `--plan DIR`) and
refuses another job's plan in one line, exit 2. Started without torchrun, each rank refuses such a plan itself
(test_mismatched_plan_is_refused_before_step_one).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlm_runs import (
    CONFIGS,
    ITERS,
    MBS,
    child_env,
    megatron_losses,
    mlm_command,
    rank_output,
    run_kareus_torchrun,
    run_ranks,
    run_torchrun,
)

from kareus_megatron.cli.main import main
from kareus_megatron.plan.points import load_point_plan
from kareus_megatron.report.runlog import read_run_log

PATHS = {"drop-in": False, "patched": True}
# PP=2 on both releases, the entry point alternating between them (the drop-in and the native patch reach the same
# runtime; what differs per release is Megatron-LM's own code around it); TP=2 on the older release's native patch
# (the newer release's drop-in runs TP=2 in test_mlm_overlap.py, checked alike: clocks, losses, run log); the
# interleaved schedule (vp2) on the newer release's native patch. Each run ~11-16 s on 2 cores.
CASES = [
    ("core_v0.16.1", "pp2", "drop-in"),
    ("core_v0.16.1", "tp2", "patched"),
    ("core_v0.19.0", "pp2", "patched"),
    ("core_v0.19.0", "vp2", "patched"),
]
IDS = [f"{t[6:]}-{c}-{p}" for t, c, p in CASES]
RERUN = ("core_v0.16.1", "pp2", "drop-in")  # the case launched after a refused start in its --kareus-log directory


@dataclass(frozen=True)
class Run:
    """One launched case: torchrun's result and working directory (torchrun-logs/, clocks.jsonl, tb/), its
    --kareus-log directory and plan directory; for RERUN also the refused start before it (cwd: refused_cwd) and
    what it left in the --kareus-log directory (names of its files; the rerun writes there next)."""

    result: subprocess.CompletedProcess
    cwd: Path
    log: Path
    plans: Path
    refused: subprocess.CompletedProcess | None = None
    refused_cwd: Path | None = None
    refused_left: list[str] | None = None


@pytest.fixture(scope="module")
def case_run(megatron_lm_tree, plan_dir, tmp_path_factory):
    """case_run(tag, config_name, path) -> the Run of that case, launched once for the tests of this file."""
    cache: dict[tuple[str, str, str], Run] = {}

    def launch(tag: str, config_name: str, path: str) -> Run:
        if (tag, config_name, path) in cache:
            return cache[tag, config_name, path]
        config = CONFIGS[config_name]
        native = PATHS[path]
        tree = megatron_lm_tree(tag, patched=native)
        top = tmp_path_factory.mktemp(f"{tag[6:]}-{config_name}-{path}")
        refused = refused_cwd = refused_left = None
        if (tag, config_name, path) == RERUN:
            plans = top / "plan"  # a copy: test_a_refused_start_... moves it
            shutil.copytree(plan_dir(config_name), plans)
            cwd, log, refused_cwd = top / "rerun", top / "run", top / "refused"
            cwd.mkdir()
            refused_cwd.mkdir()
            wrong = mlm_command(tree, native, config, plan_dir(config_name, microbatches=8), log, global_batch=MBS * 4)
            env = child_env(KAREUS_SIMULATED_LOG=str(refused_cwd / "clocks.jsonl"))
            refused = run_kareus_torchrun(wrong, refused_cwd, env)
            refused_left = sorted(p.name for p in log.iterdir()) if log.exists() else []
        else:
            plans, cwd, log = plan_dir(config_name), top, top / "run"
        extra = {"KAREUS_SIMULATED_LOG": str(cwd / "clocks.jsonl"), "KAREUS_TEST_TENSORBOARD_LOG": str(cwd / "tb")}
        if native and load_point_plan(str(plans), config.point)[0].parallel.tp > 1:
            extra["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron-LM's own requirement; the drop-in sets it itself
        cmd = mlm_command(tree, native, config, plans, log, extra=("--tensorboard-dir", str(cwd / "tb")))
        result = run_torchrun(cmd, cwd, child_env(**extra))
        cache[tag, config_name, path] = Run(result, cwd, log, plans, refused, refused_cwd, refused_left)
        return cache[tag, config_name, path]

    return launch


def _ran(run: Run) -> None:
    r = run.result
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{rank_output(run.cwd, 0)}\n{rank_output(run.cwd, 1)}"


def _clock_sequences(log_text: str, world: int) -> list[list[int]]:
    """Per GPU (index = local rank), the SM clocks (MHz) the simulated devices were given, in order."""
    recs = [json.loads(line) for line in log_text.splitlines() if line.strip()]
    return [[x["mhz"] for x in recs if x["gpu"] == g and x["event"] in ("set", "skip")] for g in range(world)]


@pytest.mark.parametrize("tag,config_name,path", CASES, ids=IDS)
def test_pretrain_gpt_runs_the_plan(tag, config_name, path, case_run, capsys):
    config = CONFIGS[config_name]
    run = case_run(tag, config_name, path)
    plan, plan_file = load_point_plan(str(run.plans), config.point)
    _ran(run)
    losses = megatron_losses(run.cwd)
    assert len(losses) == ITERS and all(4.0 < x < 7.0 for x in losses), losses  # untrained: near ln(128) = 4.85

    # every iteration on every rank ran the plan's clocks (TP ranks share their pipeline rank's sequence)
    got = _clock_sequences((run.cwd / "clocks.jsonl").read_text(), 2)
    for rank in range(2):
        pp_rank = rank if config.pp == 2 else 0
        assert got[rank] == plan.clock_sequence(pp_rank) * ITERS, f"rank {rank}"
    log = read_run_log(run.log)  # the --kareus-log directory: rank-NNNNN.jsonl
    assert log.header["world"] == 2 and not log.partial and not log.truncated
    assert [x["iteration"] for x in log.iterations] == list(range(ITERS))
    for x in log.iterations:
        assert {s["pp_rank"] for s in x["stages"]} == set(range(config.pp)), x
    assert main(["report", str(run.log), "--plan", plan_file, "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert all(f"stage {s} energy" in out for s in range(config.pp)), out


@pytest.mark.parametrize("tag,config_name,path", CASES, ids=IDS)
def test_megatron_tensorboard_writer_gets_the_kareus_figures(tag, config_name, path, case_run):
    """--tensorboard-dir: Megatron's own writer (last rank) gets each iteration's measured GPU energy at its step."""
    run = case_run(tag, config_name, path)
    _ran(run)
    tb = run.cwd / "tb"
    calls = [json.loads(line) for line in (tb / "tb-rank-1.jsonl").read_text().splitlines()]
    assert not (tb / "tb-rank-0.jsonl").exists()  # Megatron keeps its writer on the last rank only
    scalars = {(c["args"][0], c["args"][2]): c["args"][1] for c in calls if c["call"] == "add_scalar"}
    assert ("lm loss", 1) in scalars  # Megatron's own metrics, beside ours
    log = [json.loads(line) for line in (run.log / "rank-00001.jsonl").read_text().splitlines()]
    energy = {rec["iteration"]: rec["energy_j"] for rec in log if rec.get("kind") == "iteration"}
    assert sorted(energy) == list(range(ITERS))
    for i, e in energy.items():  # Megatron numbers the iteration after kareus's i as i + 1
        assert scalars[("kareus/gpu_energy_j", i + 1)] == pytest.approx(e)
        assert ("kareus/planned_iteration_time_s", i + 1) in scalars


@pytest.mark.parametrize(("path", "tag"), [("patched", "core_v0.19.0")], ids=["patched-0.19.0"])
def test_mismatched_plan_is_refused_before_step_one(tag, path, megatron_lm_tree, plan_dir, tmp_path):
    """A plan for 8 microbatches against a run of 4: each rank exits 2 with one line on stderr, untrained. The
    native patch on the newer release; the drop-in on the older one refuses the same plan under `kareus torchrun`
    (RERUN's refused start, test_a_refused_start_...): the refusal is the runtime's own check, the same on both."""
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


def _report(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["report", *args, "--no-plot"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_refused_start_leaves_nothing_that_blocks_the_corrected_rerun(case_run, plan_dir, capsys):
    """The refused start under `kareus torchrun` and the RERUN case after it in the same --kareus-log directory;
    then `kareus report` finds the rerun's plan (this test moves the run's copy of it)."""
    run = case_run(*RERUN)
    assert run.refused is not None and run.refused_cwd is not None
    r = run.refused
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2, f"exit {r.returncode}: {r.stderr[-3000:]}"
    assert last.startswith("kareus torchrun: error: rank ") and "stopped the job (exit status 1)" in last
    assert "microbatches per iteration: plan 8, run 4" in last and "perseus-05" in last, last
    assert run.refused_left == [], "a refused start left rank files"
    _ran(run)  # the rerun, in the same --kareus-log directory (mode new)
    for rank in range(2):
        lines = [json.loads(x) for x in (run.log / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        assert lines[0]["kind"] == "header" and lines[0]["rank"] == rank and lines[0]["pp_rank"] == rank, lines[0]
        assert sum(x["kind"] == "header" for x in lines) == 1

    # kareus report without --plan: the plan where the run named it, then (moved) beside the log by its sha256
    top = run.plans.parent
    capsys.readouterr()  # what the fixture's kareus plan printed
    code, out, err = _report(capsys, str(run.log))
    assert code == 0 and "plans/perseus-05.json (perseus, " in out and "; recorded in the log)" in out, err
    assert "stage 1 energy" in out
    run.plans.rename(top / "kept")
    code, out, err = _report(capsys, str(run.log))
    assert code == 0 and f"{top}/kept/plans/perseus-05.json (perseus, " in out, err
    assert "; found beside the log by its sha256)" in out
    code, out, err = _report(capsys, str(run.log), "--plan", str(top / "kept"))  # a plan directory: the log's point
    assert code == 0 and "kept/plans/perseus-05.json (perseus, " in out and "; the log's point of --plan)" in out, err
    # another job's plan: one line, exit 2
    others = (
        (plan_dir("pp2", microbatches=8), "microbatches 4 (run) vs 8 (plan)"),
        (plan_dir("tp2") / "plans" / "perseus-05.json", "TP 1 (run) vs 2 (plan); PP 2 (run) vs 1"),
    )
    capsys.readouterr()  # what kareus plan printed
    for other, why in others:
        code, out, err = _report(capsys, str(run.log), "--plan", str(other))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and why in err, err
        assert "is for another job than run log" in err
    (top / "kept").rename(top / "elsewhere-deeper")
    shutil.move(top / "elsewhere-deeper", run.refused_cwd / "a" / "b")
    code, out, err = _report(capsys, str(run.log))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pass --plan PLAN" in err, err
