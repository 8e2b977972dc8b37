"""The flow of ``kareus launch``: start the runs of a plan directory, or the whole measured comparison.

``run`` starts one job per selected point of one method (default point: iso-time); ``comparison`` plans
when DIR has no frontier.json yet (``kareus plan --out DIR PLAN_ARGS``), runs every point (default: all)
of every method, then renders ``kareus compare LOG_DIR``. The job's nodes and GPUs per node are the plans'
unless given (``with_plan_shape``). With the slurm launcher outside an allocation
(no SLURM_JOB_ID) the invocation resubmits itself, ``sbatch launch/slurm.sbatch ARGS``, and the batch
script re-enters ``kareus launch ARGS`` inside the allocation. Without Slurm every node runs the same
command, and node rank 0 keeps the books: it plans, refuses to append to earlier logs, writes each run's
manifest and compares. A dry run prints every command (``+ `` first) and runs nothing.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kareus_megatron.errors import ConfigError, KareusError
from kareus_megatron.jobs import children
from kareus_megatron.jobs.commands import JobSpec, RunCommand, manifest, run_command
from kareus_megatron.jobs.torchrun import run_summarised
from kareus_megatron.plan.io import load_plan, write_json_atomic
from kareus_megatron.plan.points import ALL, DEFAULT_POINT, FRONTIER_FILE, read_frontier, select_frontier_points
from kareus_megatron.report.runlog import MANIFEST_FILE, MEASUREMENT_FILE
from kareus_megatron.report.summary import DEFAULT_SKIP_ITERATIONS
from kareus_megatron.vocab import FRAMEWORK_DEEPSPEED, METHODS, NANOBATCH_PERSEUS

RUN, COMPARISON = "run", "comparison"


@dataclass(frozen=True, kw_only=True)
class Launch:
    """One ``kareus launch`` invocation: what to run, on which job, and how."""

    command: str  # RUN or COMPARISON
    plan_dir: str
    job: JobSpec
    method: str | None = None  # run: the method (None: the point's, else vocab.DEFAULT_METHOD)
    methods: tuple[str, ...] = METHODS  # comparison: the methods
    point: str | None = None  # plan/points.py syntax; default DEFAULT_POINT, iso-time (run) or all (comparison)
    robust: bool = False  # iso-time / min-energy met across the prediction bands (plan/points.py)
    launcher: str = "torchrun"
    log_dir: str = "runs"
    train_iters: int = 20
    script: str | None = None
    extra_args: tuple[str, ...] = ()  # appended to every training command
    node_rank: int = 0
    overwrite: bool = False
    dry_run: bool = False
    plan_args: tuple[str, ...] = ()  # comparison: arguments of `kareus plan` when DIR has no frontier.json
    skip_iterations: int = DEFAULT_SKIP_ITERATIONS  # comparison: passed to kareus compare
    argv: tuple[str, ...] = ()  # this invocation's arguments after `kareus launch` (resubmitted by sbatch)
    nodes: int | None = None  # as given (--nodes); None: the plans' (job.nodes is then filled in, with_plan_shape)
    gpus_per_node: int | None = None  # as given (--gpus-per-node); None: the plans'


Say = Callable[[str], None]


def _say(line: str) -> None:
    print(line, flush=True)


def with_plan_shape(launch: Launch) -> Launch:
    """`launch` with the job's nodes and GPUs per node the user left out read from the plan directory's plans
    (the printed torchrun/srun/sbatch commands show them).

    Both left out: the plans' own shape. One given: the other divides the plans' GPUs by it (when it divides
    them; else the plans' value, and check_job_fits names the flags that fit)."""
    if launch.nodes is not None and launch.gpus_per_node is not None:
        return launch
    doc = read_frontier(launch.plan_dir)
    method = next((m for m, v in doc["methods"].items() if v.get("points")), None)
    if method is None:
        raise ConfigError(
            f"{launch.plan_dir}/{FRONTIER_FILE} holds no plans to read the job's nodes from; "
            "pass --nodes and --gpus-per-node"
        )
    par = load_plan(select_frontier_points(launch.plan_dir, 0, method=method, flag="--point")[0].plan_path).parallel
    world = par.nodes * par.gpus_per_node
    nodes, per = launch.nodes, launch.gpus_per_node
    if nodes is None and per is None:
        nodes, per = par.nodes, par.gpus_per_node
    elif nodes is None:
        assert per is not None
        nodes = world // per if world % per == 0 else par.nodes
    elif per is None:
        per = world // nodes if world % nodes == 0 else par.gpus_per_node
    return replace(launch, job=replace(launch.job, nodes=nodes, gpus_per_node=per), nodes=nodes, gpus_per_node=per)


def kareus_cli() -> list[str]:
    """How to run the `kareus` command here: the console script, else this interpreter's module."""
    exe = shutil.which("kareus")
    return [exe] if exe else [sys.executable, "-m", "kareus_megatron.cli.main"]


def execute(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Run a command with `env` added; subprocess.CalledProcessError when it fails."""
    rc = children.run(argv, env)
    if rc:
        raise subprocess.CalledProcessError(rc, argv)


def execute_training(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Run a training command (torchrun, srun): RankError (jobs/torchrun.py; one line, exit status 2) when a
    kareus error stopped a rank, subprocess.CalledProcessError for other failures."""
    rc = run_summarised(argv, env)
    if rc:
        raise subprocess.CalledProcessError(rc, argv)


def sbatch_command(launch: Launch) -> list[str]:
    """Resubmit this very invocation inside an allocation of the job's size."""
    passthrough = [a for a in launch.argv if a != "--dry-run"]
    return [
        "sbatch",
        "--nodes",
        str(launch.job.nodes),
        "--gpus-per-node",
        str(launch.job.gpus_per_node),
        "--job-name",
        f"kareus-{launch.command}",
        str(launch.job.launch_dir / "slurm.sbatch"),
        *passthrough,
    ]


def run_commands(launch: Launch, methods: list[str | None], default_point: str) -> list[RunCommand]:
    """The commands of every selected point of `methods`, in order."""
    cmds = []
    for method in methods:
        for point in select_frontier_points(
            launch.plan_dir,
            launch.point or default_point,
            method=method,
            allow_all=True,
            flag="--point",
            robust=launch.robust,
            robust_flag="--robust",
        ):
            cmds.append(
                run_command(
                    point,
                    launch.job,
                    launch.log_dir,
                    launcher=launch.launcher,
                    train_iters=launch.train_iters,
                    script=launch.script,
                    extra_args=launch.extra_args,
                )
            )
    return cmds


def start(cmds: list[RunCommand], launch: Launch, say: Say = _say) -> None:
    """Run each command in turn; the bookkeeping node writes run.json and guards earlier logs."""
    keeper = launch.node_rank == 0 and not launch.dry_run
    if not launch.dry_run:
        missing = next((c.needs for c in cmds if c.needs is not None and not c.needs.is_file()), None)
        if missing is not None:
            raise ConfigError(
                f"{missing} does not exist; set KAREUS_LAUNCH_DIR to the launch/ directory of a "
                "kareus-megatron checkout, or pass --script"
            )
    if keeper:
        old = [c.log_dir / MEASUREMENT_FILE for c in cmds if (c.log_dir / MEASUREMENT_FILE).exists()]
        if old and not launch.overwrite:
            raise KareusError(
                f"{old[0]} exists ({len(old)} earlier log(s) in {launch.log_dir}); a run does not "
                "write over a log, so choose a new --log-dir or pass --overwrite"
            )
    for c in cmds:
        say(f"+ {c.shell()}")
        if launch.dry_run:
            continue
        if keeper:
            c.log_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(c.log_dir / MEASUREMENT_FILE, ignore_errors=True)  # a directory of rank logs
            write_json_atomic(c.log_dir / MANIFEST_FILE, manifest(c, launch.job))
        execute_training(c.argv, c.env)


def _comparison(launch: Launch, say: Say) -> int:
    methods = list(launch.methods)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ConfigError(f"--methods: unknown {', '.join(bad) or '(none given)'}; use some of {', '.join(METHODS)}")
    cli = kareus_cli()
    if not (Path(launch.plan_dir) / FRONTIER_FILE).exists():
        if launch.node_rank != 0:
            raise KareusError(
                f"{launch.plan_dir}/{FRONTIER_FILE} does not exist; plan on node rank 0 first "
                "(or run this comparison there first)"
            )
        plan_cmd = ["plan", "--out", launch.plan_dir, *launch.plan_args]
        say(f"+ {shlex.join(['kareus', *plan_cmd])}")
        if launch.dry_run:
            say(f"# then one run per frontier point of {', '.join(methods)}, then kareus compare {launch.log_dir}")
            return 0
        execute([*cli, *plan_cmd])
    launch = with_plan_shape(launch)
    doc = read_frontier(launch.plan_dir)
    present = [m for m in methods if doc["methods"].get(m, {}).get("points")]
    if doc.get("config", {}).get("framework") == FRAMEWORK_DEEPSPEED and NANOBATCH_PERSEUS in methods:
        # kareus plan --framework deepspeed no longer plans it; an older frontier may still hold its points
        if NANOBATCH_PERSEUS in present:
            present.remove(NANOBATCH_PERSEUS)
        say(
            f"# {NANOBATCH_PERSEUS} skipped: DeepSpeed runs microbatches whole (no nanobatch overlap engine); "
            "its kareus plans set clocks only"
        )
    start(run_commands(launch, list(present), ALL), launch, say)
    if launch.node_rank != 0:
        return 0
    compare = ["compare", launch.log_dir, "--skip-iterations", str(launch.skip_iterations)]
    say(f"+ {shlex.join(['kareus', *compare])}")
    if not launch.dry_run:
        execute([*cli, *compare])
    return 0


def launch_jobs(launch: Launch, say: Say = _say) -> int:
    """Carry out `launch` (see the module doc); return the exit status. Bad input raises a KareusError."""
    if launch.command not in (RUN, COMPARISON):
        raise ConfigError(f"unknown launch command {launch.command!r}; use {RUN} or {COMPARISON}")
    if launch.command == RUN or (Path(launch.plan_dir) / FRONTIER_FILE).exists():
        launch = with_plan_shape(launch)
    elif launch.nodes is None or launch.gpus_per_node is None:
        if launch.launcher == "slurm" and not os.environ.get("SLURM_JOB_ID"):
            raise ConfigError(
                f"{launch.plan_dir} has no plans yet to read the job's nodes from; pass --nodes and "
                "--gpus-per-node for the allocation"
            )
    if launch.launcher == "slurm" and not os.environ.get("SLURM_JOB_ID"):
        sb = sbatch_command(launch)
        say(f"+ {shlex.join(sb)}")
        if not launch.dry_run:
            execute(sb)
            return 0
        say("# inside the allocation, it runs:")
    if launch.command == RUN:
        start(run_commands(launch, [launch.method], DEFAULT_POINT), launch, say)
        return 0
    return _comparison(launch, say)
