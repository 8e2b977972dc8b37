"""Megatron-LM's own pretrain_gpt.py runs plan points whose instructions run 2 nanobatches, with no --spec.

The entry point (drop-in launch/pretrain_gpt.py or the patched tree's --kareus-plan) builds the model with
kareus's partitioned layer from the plan (runtime/frameworks/layer_choice.py) and says so at rank 0. Each run
(torchrun, gloo, --mock-data, 3 iterations, dropout 0) is checked against a baseline run of the same tree, seed
and layout (Megatron-LM's pretrain_gpt.py without kareus, except for CP: see _baseline_command; one per tree
and layout, shared by the session):
exit 0, the same losses, the plan's clocks on every rank for every iteration, a complete run log, and an
overlap trace (KAREUS_OVERLAP_TRACE) whose partnered collectives carry the plan's comm SMs and launch slot.
Cases x releases x entry points: each layout (TP, TP+SP, CP, PP=2 x TP=2 on 4 ranks) once, on alternating releases
and entry points, so that each release runs through both the drop-in and the native patch. The PP=2 x TP=2 run is the
torchrun line `kareus launch comparison` writes for its kareus point, executed (the drop-in, named by the line), so that
one launch shows that line runs and checks the point; its baseline is the same line without the kareus flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shlex
import shutil
import time
from pathlib import Path

import pytest
from mlm_runs import (
    CONFIGS,
    HERE,
    ITERS,
    MBS,
    MICROBATCHES,
    MLM_RUN_ARGS,
    WRAPPER,
    child_env,
    megatron_losses,
    mlm_command,
    rank_output,
    run_torchrun,
)

from kareus_megatron.cli.main import main
from kareus_megatron.jobs.commands import model_args
from kareus_megatron.plan.points import load_point_plan
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.runtime.overlap.trace import overlap_violations

NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234")
TE = ("--transformer-impl", "transformer_engine")  # Megatron-LM's default; TE is not installed here
# (tag, config, entry point): each layout once, the releases and the entry points alternating so that each release
# runs through both entry points. One run keeps Megatron-LM's default --transformer-impl (docs/layer_choice.md:
# local modules, said in the line); one runs the drop-in as `kareus launch comparison`'s torchrun line names it.
CASES = [
    ("core_v0.16.1", "tp2-nb", "patched+te"),
    ("core_v0.19.0", "tp2sp-nb", "drop-in"),
    ("core_v0.19.0", "cp2-nb", "patched"),
    ("core_v0.16.1", "pp2tp2-nb", "launch-line"),
]
LAUNCH_LINE = "pp2tp2-nb"  # the layout whose run (and baseline) is `kareus launch comparison`'s line
# What the CPU needs on top of a command `kareus launch` writes for a GPU cluster (README.md here); Megatron-LM's
# parser keeps the last value of a repeated flag.
CPU_FLAGS = (
    "--transformer-impl local --distributed-backend gloo --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm --clip-grad 0"
).split()
TIMES: dict[str, float] = {}  # run wall times (s), printed at the end of the session (-s) for the README table


@dataclasses.dataclass(frozen=True)
class LaunchLine:
    """The torchrun line `kareus launch comparison` writes for one point, split up."""

    env: dict[str, str]  # its VAR=VALUE assignments before torchrun
    nproc: int  # its --nproc-per-node
    script_args: list[str]  # from pretrain_gpt.py on: the training script and its arguments


def _launch_line(config, plans: Path, cwd: Path) -> LaunchLine:
    """The line `kareus launch comparison --dry-run` prints for config's point, in cwd with the plan copied to
    cwd/plan: it names the plan as the user gave it (plan/plans/NAME.json) and logs to cwd/runs/NAME/measurement."""
    shutil.copytree(plans, cwd / "plan")
    flags = ["--methods", "kareus", "--point", config.point, "--launcher", "torchrun", "--nodes", "1"]
    flags += ["--gpus-per-node", str(config.world), "--train-iters", str(ITERS), "--log-dir", "runs", "--dry-run"]
    out = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out):
        assert main(["launch", "comparison", "--plan-dir", "plan", *flags]) == 0
    lines = [ln[2:] for ln in out.getvalue().splitlines() if ln.startswith("+ ") and "torchrun" in ln]
    assert len(lines) == 1, lines
    argv = shlex.split(lines[0])
    at = argv.index("torchrun")
    script_at = next(k for k, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    nproc = int(argv[argv.index("--nproc-per-node", at) + 1])
    return LaunchLine(dict(a.split("=", 1) for a in argv[:at] if "=" in a), nproc, argv[script_at:])


def _without_kareus_flags(args: list[str]) -> list[str]:
    """args less every --kareus-* flag and its value (the drop-in's flags take one value each)."""
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("--kareus-"):
            skip = "=" not in a
        else:
            kept.append(a)
    return kept


def _baseline_command(tree: Path, config, plans: Path, cwd: Path) -> list[str]:
    """What a run of `config` is compared with: Megatron-LM's own pretrain_gpt.py with no kareus flags and the
    same model and run flags (with SP, megatron's local layer with SP-capable torch norms: mlm_stock_specs).
    For LAUNCH_LINE: the line's own arguments without its kareus flags, with the CPU flags and NO_DROPOUT, as its run.

    Megatron-LM's local attention refuses context parallelism (only TE's runs it), so a CP=2 layout is compared
    with the same CP=2 job at a 1-nanobatch point (perseus-00) on kareus's partitioned layer, named with
    Megatron-LM's own ``--spec kareus_megatron.megatron_spec partitioned_layer_spec``."""
    if "--context-parallel-size" in config.mlm_flags:
        one_nb = dataclasses.replace(config, point="perseus-00")
        return mlm_command(
            tree,
            False,
            one_nb,
            plans,
            cwd / "run",
            extra=(*NO_DROPOUT, "--spec", "kareus_megatron.megatron_spec", "partitioned_layer_spec"),
        )
    if config.name == LAUNCH_LINE:
        line = _launch_line(config, plans, cwd)
        args = _without_kareus_flags(line.script_args[1:])
        return [str(WRAPPER), str(tree), str(tree / "pretrain_gpt.py"), *args, *CPU_FLAGS, *NO_DROPOUT]
    plan, _ = load_point_plan(str(plans), config.point)
    spec = ("--spec", "mlm_stock_specs", "local_sp_block_spec") if "--sequence-parallel" in config.mlm_flags else ()
    return [
        str(WRAPPER),
        str(tree),
        str(tree / "pretrain_gpt.py"),
        *config.mlm_flags,
        *model_args(plan.model),
        *MLM_RUN_ARGS,
        "--global-batch-size",
        str(MBS * MICROBATCHES),
        *NO_DROPOUT,
        *spec,
    ]


def _env(**extra: str) -> dict[str, str]:
    env = child_env(**{"CUDA_DEVICE_MAX_CONNECTIONS": "1", **extra})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)  # mlm_stock_specs
    return env


@pytest.fixture(scope="session")
def baseline_losses(megatron_lm_tree, plan_dir, tmp_path_factory):
    """baseline_losses(tag, config_name) -> Megatron-LM's losses of the baseline run (once per session)."""
    cache: dict[tuple[str, str], list[float]] = {}

    def losses(tag: str, name: str) -> list[float]:
        if (tag, name) not in cache:
            config = CONFIGS[name]
            cwd = tmp_path_factory.mktemp(f"baseline-{tag}-{name}")
            t0 = time.perf_counter()
            cmd = _baseline_command(megatron_lm_tree(tag), config, plan_dir(name), cwd)
            r = run_torchrun(cmd, cwd, _env(), nproc=config.world)
            TIMES[f"baseline {tag} {name}"] = time.perf_counter() - t0
            assert r.returncode == 0, f"baseline run failed:\n{r.stderr[-3000:]}\n{rank_output(cwd, 0)}"
            cache[tag, name] = megatron_losses(cwd)
            assert len(cache[tag, name]) == ITERS, cache[tag, name]
        return cache[tag, name]

    return losses


def _stdout(cwd: Path, rank: int) -> str:
    """Rank `rank`'s whole stdout in a torchrun run under cwd."""
    files = sorted(cwd.glob(f"torchrun-logs/*/attempt_*/{rank}/stdout.log"))
    return "".join(f.read_text(errors="replace") for f in files)


def _clock_sequences(path: Path, world: int) -> list[list[int]]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[x["mhz"] for x in recs if x["gpu"] == g and x["event"] in ("set", "skip")] for g in range(world)]


@pytest.mark.parametrize("tag,config_name,path", CASES, ids=[f"{t[6:]}-{c}-{p}" for t, c, p in CASES])
def test_two_nanobatch_point_runs_without_spec(
    tag, config_name, path, megatron_lm_tree, plan_dir, baseline_losses, tmp_path
):
    config = CONFIGS[config_name]
    native = path.startswith("patched")
    te = path.endswith("+te")
    plans = plan_dir(config_name)
    plan, _ = load_point_plan(str(plans), config.point)
    two_nb = {(s.pp_rank, k) for s in plan.stages for k, i in enumerate(s.instructions) if i.nanobatches == 2}
    assert two_nb, f"{config.point} of {config_name} runs no instruction with 2 nanobatches"
    expected = baseline_losses(tag, config_name)
    tree = megatron_lm_tree(tag, patched=native)
    traces = tmp_path / "traces"
    env = _env(KAREUS_SIMULATED_LOG=str(tmp_path / "clocks.jsonl"), KAREUS_OVERLAP_TRACE=str(traces))
    if path == "launch-line":  # the line's script and arguments unchanged, plus the CPU flags and NO_DROPOUT
        assert config_name == LAUNCH_LINE
        line = _launch_line(config, plans, tmp_path)
        assert line.nproc == config.world, line
        env.update(MEGATRON_LM_DIR=str(tree), **line.env)
        cmd = [str(WRAPPER), str(tree), *line.script_args, *CPU_FLAGS, *NO_DROPOUT]
        run_log = tmp_path / "runs" / config.point / "measurement"
    else:
        cmd = mlm_command(tree, native, config, plans, tmp_path / "run", extra=NO_DROPOUT + (TE if te else ()))
        run_log = tmp_path / "run"
    assert "--spec" not in cmd
    t0 = time.perf_counter()
    r = run_torchrun(cmd, tmp_path, env, nproc=config.world)
    TIMES[f"{tag} {config_name} {path}"] = time.perf_counter() - t0
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{rank_output(tmp_path, 0)}\n{rank_output(tmp_path, 1)}"

    said = [ln for ln in _stdout(tmp_path, 0).splitlines() if ln.startswith("kareus: model built with")]
    assert len(said) == 1 and "kareus's partitioned layer" in said[0] and "2 nanobatches" in said[0], said
    assert ("--transformer-impl transformer_engine: built on megatron-core's local modules" in said[0]) == te, said
    assert all("kareus: model built" not in _stdout(tmp_path, r) for r in range(1, config.world))
    # the baseline's --mock-data indices (same release, samples and seed), from the session's cache (mlm_runs)
    assert "Load the MockGPTDataset train indices" in _stdout(tmp_path, 0), "the mock-data index cache was missed"
    assert megatron_losses(tmp_path) == pytest.approx(expected, rel=2e-4), (megatron_losses(tmp_path), expected)

    ranks_per_stage = config.world // config.pp  # Megatron's rank order: TP and CP inside a pipeline stage
    got = _clock_sequences(tmp_path / "clocks.jsonl", config.world)
    for rank in range(config.world):
        assert got[rank] == plan.clock_sequence(rank // ranks_per_stage) * ITERS, f"rank {rank}"
    run = read_run_log(run_log)
    assert run.header["world"] == config.world and not run.partial and not run.truncated
    assert [x["iteration"] for x in run.iterations] == list(range(ITERS))
    for x in run.iterations:
        assert {s["pp_rank"] for s in x["stages"]} == set(range(config.pp)), x

    for rank in range(config.world):
        pp_rank = rank // ranks_per_stage
        doc = json.loads((traces / f"overlap_trace.rank{rank}.json").read_text())
        events = doc["events"]
        assert not doc["truncated"] and overlap_violations(events) == []
        partnered = [e for e in events if e["kind"] == "issue" and e.get("partition")]
        assert {(pp_rank, e["instr"]) for e in partnered} == {k for k in two_nb if k[0] == pp_rank}, f"rank {rank}"
        for e in partnered:
            knobs = plan.stages[pp_rank].instructions[e["instr"]].partitions[e["partition"]]
            assert (e["comm_sms"], e["slot"]) == (knobs.comm_sms, knobs.launch_slot), (rank, e)


def test_print_times():
    """Not a check: the wall time of each run above (pytest -s), for tests/megatron_lm/README.md."""
    for name, s in sorted(TIMES.items()):
        print(f"{name}: {s:.1f} s")
