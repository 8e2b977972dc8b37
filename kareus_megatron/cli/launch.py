"""`kareus launch run|comparison`: run a plan directory's points on a cluster (torchrun or Slurm).

    kareus launch run --plan-dir DIR [--method kareus] [--point iso-time|fastest|min-energy|all|NN|METHOD-NN]
        [--robust] ...
    kareus launch comparison --plan-dir DIR --log-dir LOGS [--plan-arg=--model ...] ... [-- TRAINING ARGS]

`run` starts one job per selected frontier point of one method; `comparison` plans (when DIR has no
frontier.json yet), runs every point of every method, then renders `kareus compare LOGS`.
`--launcher torchrun` runs the same command on every node (c10d rendezvous at --master-addr);
`--launcher slurm` runs `srun ... torchrun ...` inside an allocation, and outside one submits itself
with `sbatch launch/slurm.sbatch`. `--dry-run` prints the exact commands and runs nothing. Arguments
after `--` are appended to every training command (e.g. real data flags). The flow is jobs/orchestrate.py,
the commands jobs/commands.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
from typing import Any

from kareus_megatron.cli.parsing import OneLineParser
from kareus_megatron.errors import ConfigError
from kareus_megatron.report.summary import DEFAULT_SKIP_ITERATIONS
from kareus_megatron.vocab import METHODS

# lazy (`kareus --help` imports every command module): jobs.commands and jobs.orchestrate (~58 ms).

MAX_ITERATIONS = 10**7  # the largest --train-iters (and --skip-iterations, --node-rank) accepted
HELP = "run a plan directory's frontier points on a cluster (torchrun or Slurm), then kareus compare"


class _LaunchParser(OneLineParser):
    """A `kareus launch` subcommand: one-line usage errors; arguments after '--' go to the training command."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        own, extra = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
        ns, rest = super().parse_known_args(own, namespace)
        ns.extra_args = extra
        ns.launch_argv = [self.prog.rsplit(" ", 1)[-1], *args]  # resubmitted as is by sbatch
        return ns, rest


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan-dir", required=True, help="a `kareus plan --out` directory (frontier.json, plans/)")
    p.add_argument(
        "--point",
        default=None,
        help="iso-time, fastest, min-energy, all, an index NN or METHOD-NN (plan/points.py's syntax; "
        "run: iso-time, the least energy no slower than Megatron; comparison: all)",
    )
    p.add_argument(
        "--robust",
        action="store_true",
        help="--point iso-time or min-energy is met across the prediction bands (95th percentiles), as "
        "kareus plan --robust and --kareus-robust; needs a frontier with bands",
    )
    p.add_argument("--launcher", choices=("torchrun", "slurm"), default="torchrun")
    p.add_argument("--nodes", type=int, default=None, help="nodes of the job (default: the plan's)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the plan's)")
    p.add_argument("--master-addr", default=None, help="rendezvous host (default $MASTER_ADDR, else localhost)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--rdzv-id", default=None, help="rendezvous id prefix (default $SLURM_JOB_ID, else kareus)")
    p.add_argument("--container-image", default=None, help="Slurm+pyxis: srun --container-image")
    p.add_argument(
        "--container-mounts",
        default=None,
        help="Slurm+pyxis: srun --container-mounts (default: this directory at the same path)",
    )
    p.add_argument("--log-dir", default="runs", help="measured logs go to LOG_DIR/NAME-NN/ (default ./runs)")
    p.add_argument("--train-iters", type=int, default=20, help="iterations per run (default 20)")
    p.add_argument(
        "--script",
        default=None,
        help="training script instead of Megatron-LM pretrain_gpt.py (required for DeepSpeed plans)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="torchrun without Slurm: 0 on the node that plans, writes run.json and compares; "
        "1.. on the others (default 0)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace measurement logs left by earlier runs")
    p.add_argument("--dry-run", action="store_true", help="print the exact commands; run nothing")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus launch run` and `kareus launch comparison`."""
    sub = parser.add_subparsers(
        dest="launch_command", required=True, metavar="{run,comparison}", parser_class=_LaunchParser
    )
    run_p = sub.add_parser(
        "run",
        help="run one method at one or more frontier points",
        description="run one method at one or more frontier points (default: iso-time, the least "
        "predicted energy no slower than Megatron's max-clock plan)",
    )
    run_p.add_argument(
        "--method", default=None, choices=METHODS, help="the method (default: the point's METHOD-, else kareus)"
    )
    _add_job_args(run_p)
    cmp_p = sub.add_parser(
        "comparison",
        help="plan, run every method, collect logs, kareus compare",
        description="plan, run every point of every method, collect logs, kareus compare",
    )
    cmp_p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated methods out of {', '.join(METHODS)} (default: all)",
    )
    cmp_p.add_argument(
        "--plan-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="argument for `kareus plan` when DIR has no frontier.json (repeatable; use --plan-arg=--x)",
    )
    cmp_p.add_argument(
        "--skip-iterations",
        type=int,
        default=DEFAULT_SKIP_ITERATIONS,
        metavar="N",
        help=f"passed to kareus compare (default {DEFAULT_SKIP_ITERATIONS})",
    )
    _add_job_args(cmp_p)


def _on_interrupt(signum: int, frame: Any) -> None:
    """SIGINT during a launch: pass it on to the commands started (torchrun, srun, their workers), then stop.

    A Ctrl-C at the terminal reaches the whole foreground process group already; a SIGINT sent to
    `kareus launch` alone does not, so when this process leads its group, SIGINT goes to the group
    (this process ignores the copy it sends itself) before subprocess.run, interrupted, kills its child.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getpgrp() == os.getpid():  # else not our group to signal; its Ctrl-C reaches everyone anyway
        os.killpg(os.getpgrp(), signal.SIGINT)
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """Build the job and carry out the launch; 0 on success, 1 when a started command fails."""
    from kareus_megatron.jobs.children import sigterm_passed_on
    from kareus_megatron.jobs.commands import JobSpec
    from kareus_megatron.jobs.orchestrate import Launch, launch_jobs

    for flag, v, low in (
        ("--train-iters", args.train_iters, 1),
        ("--node-rank", args.node_rank, 0),
        ("--skip-iterations", getattr(args, "skip_iterations", 0), 0),
    ):
        if not low <= v <= MAX_ITERATIONS:
            raise ConfigError(f"{flag} {v} must be an integer from {low} to {MAX_ITERATIONS}")
    job = JobSpec(
        nodes=1 if args.nodes is None else args.nodes,  # left out: the plans' (jobs/orchestrate.py)
        gpus_per_node=1 if args.gpus_per_node is None else args.gpus_per_node,
        master_addr=args.master_addr or os.environ.get("MASTER_ADDR") or "localhost",
        master_port=args.master_port,
        rdzv_id=args.rdzv_id or os.environ.get("SLURM_JOB_ID") or "kareus",
        container_image=args.container_image,
        container_mounts=args.container_mounts,
        workdir=os.getcwd(),
    )
    comparison = args.launch_command == "comparison"
    if args.robust and comparison and args.point is None:  # before planning: 'all' is refused with --robust
        raise ConfigError(
            "--robust picks iso-time or min-energy across the prediction bands, but comparison runs every "
            "point by default; add --point iso-time (or min-energy), or drop --robust"
        )
    launch = Launch(
        command=args.launch_command,
        plan_dir=args.plan_dir,
        job=job,
        method=getattr(args, "method", None),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()) if comparison else METHODS,
        point=args.point,
        robust=args.robust,
        launcher=args.launcher,
        log_dir=args.log_dir,
        train_iters=args.train_iters,
        script=args.script,
        extra_args=tuple(args.extra_args),
        node_rank=args.node_rank,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        plan_args=tuple(getattr(args, "plan_arg", ())),
        skip_iterations=getattr(args, "skip_iterations", DEFAULT_SKIP_ITERATIONS),
        argv=tuple(args.launch_argv),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
    )
    # signal handlers live on the main thread only; an ignored SIGINT (a script's background job) stays ignored, as
    # it does for the commands started, which inherit the ignore
    handle = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN
    previous = signal.signal(signal.SIGINT, _on_interrupt) if handle else None
    try:
        with sigterm_passed_on():  # SIGTERM to kareus alone (`kill PID`): to the command running, then exit 143
            return launch_jobs(launch)  # KeyboardInterrupt: the boundary in cli/main.py, one line and exit 130
    except subprocess.CalledProcessError as e:
        sys.stderr.write(f"kareus launch: error: command failed with exit status {e.returncode}: {shlex.join(e.cmd)}\n")
        return 1
    finally:
        if handle:
            signal.signal(signal.SIGINT, previous)
