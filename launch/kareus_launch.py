#!/usr/bin/env python3
"""Launch the methods of a `kareus plan` output directory on a cluster (torchrun or Slurm).

    kareus_launch.py run --method kareus --plan-dir DIR [--point fastest|min-energy|all|NN] ...
    kareus_launch.py comparison --plan-dir DIR --log-dir LOGS [--plan-arg=--model ...] ...

`run` starts one job per selected frontier point of one method; `comparison` plans (when DIR has
no frontier.json yet), runs every point of every method, then renders `kareus compare LOGS`.
`--launcher torchrun` runs the same command on every node (c10d rendezvous at --master-addr);
`--launcher slurm` runs `srun ... torchrun ...` inside an allocation, and outside one submits itself
with `sbatch launch/slurm.sbatch`. `--dry-run` prints the exact commands and runs nothing.
Arguments after `--` are appended to every training command (e.g. real data flags).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

LAUNCH_DIR = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(LAUNCH_DIR.parent))  # run from a checkout without installing

from kareus_megatron.cluster import (  # noqa: E402
    MANIFEST_FILE,
    MEASUREMENT_FILE,
    JobSpec,
    RunCommand,
    manifest,
    parse_point,
    read_frontier,
    run_command,
    select_points,
)
from kareus_megatron.errors import KareusError  # noqa: E402
from kareus_megatron.plan.io import write_json_atomic  # noqa: E402
from kareus_megatron.plan.schema import METHODS  # noqa: E402


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan-dir", required=True, help="a `kareus plan --out` directory (frontier.json, plans/)")
    p.add_argument("--point", default=None, help="fastest, min-energy, all or an index NN")
    p.add_argument("--launcher", choices=("torchrun", "slurm"), default="torchrun")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the job (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--master-addr", default=None, help="rendezvous host (default $MASTER_ADDR, else localhost)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--rdzv-id", default=None, help="rendezvous id prefix (default $SLURM_JOB_ID, else kareus)")
    p.add_argument("--container-image", default=None, help="Slurm+pyxis: srun --container-image")
    p.add_argument("--container-mounts", default=None,
                   help="Slurm+pyxis: srun --container-mounts (default: this directory at the same path)")
    p.add_argument("--log-dir", default="runs", help="measured logs go to LOG_DIR/NAME-NN/ (default ./runs)")
    p.add_argument("--train-iters", type=int, default=20, help="iterations per run (default 20)")
    p.add_argument("--script", default=None,
                   help="training script instead of Megatron-LM pretrain_gpt.py (required for DeepSpeed plans)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="torchrun without Slurm: 0 on the node that plans, writes run.json and compares; "
                        "1.. on the others (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace measurement logs left by earlier runs")
    p.add_argument("--dry-run", action="store_true", help="print the exact commands; run nothing")


def build_parser() -> argparse.ArgumentParser:
    """Parser of kareus_launch.py (subcommands run and comparison)."""
    parser = argparse.ArgumentParser(prog="kareus_launch.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one method at one or more frontier points")
    run.add_argument("--method", required=True, choices=METHODS)
    _add_job_args(run)
    cmp_ = sub.add_parser("comparison", help="plan, run every method, collect logs, kareus compare")
    cmp_.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (default all four)")
    cmp_.add_argument("--plan-arg", action="append", default=[], metavar="ARG",
                      help="argument for `kareus plan` when DIR has no frontier.json (repeatable; use --plan-arg=--x)")
    cmp_.add_argument("--skip-iterations", type=int, default=2, help="passed to kareus compare (default 2)")
    _add_job_args(cmp_)
    return parser


def _job(args: argparse.Namespace) -> JobSpec:
    master = args.master_addr or os.environ.get("MASTER_ADDR") or "localhost"
    rdzv = args.rdzv_id or os.environ.get("SLURM_JOB_ID") or "kareus"
    return JobSpec(nodes=args.nodes, gpus_per_node=args.gpus_per_node, master_addr=master,
                   master_port=args.master_port, rdzv_id=rdzv, container_image=args.container_image,
                   container_mounts=args.container_mounts, launch_dir=LAUNCH_DIR, workdir=os.getcwd())


def _kareus_cli() -> list[str]:
    exe = shutil.which("kareus")
    return [exe] if exe else [sys.executable, "-m", "kareus_megatron.cli.main"]


def _execute(argv: list[str], env: dict[str, str] | None = None) -> None:
    rc = subprocess.run(argv, env={**os.environ, **(env or {})}).returncode
    if rc:
        raise SystemExit(f"kareus_launch: command failed with exit status {rc}: {shlex.join(argv)}")


def _sbatch(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """Resubmit this very invocation inside an allocation of the job's size."""
    passthrough = [a for a in argv if a != "--dry-run"]
    return ["sbatch", "--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node),
            "--job-name", f"kareus-{args.command}", str(LAUNCH_DIR / "slurm.sbatch"), *passthrough]


def _runs(args: argparse.Namespace, methods: list[str], default_point: str, extra: list[str]) -> list[RunCommand]:
    job = _job(args)
    point = parse_point(args.point or default_point)
    cmds = []
    for method in methods:
        for sel in select_points(args.plan_dir, method, point):
            cmds.append(run_command(sel, job, args.log_dir, launcher=args.launcher, train_iters=args.train_iters,
                                    script=args.script, extra_args=tuple(extra)))
    return cmds


def _start(cmds: list[RunCommand], args: argparse.Namespace) -> None:
    """Run each command in turn; the bookkeeping node writes run.json and guards earlier logs."""
    job = _job(args)
    keeper = args.node_rank == 0 and not args.dry_run
    if keeper:
        old = [c.log_dir / MEASUREMENT_FILE for c in cmds if (c.log_dir / MEASUREMENT_FILE).exists()]
        if old and not args.overwrite:
            raise KareusError(f"{old[0]} exists ({len(old)} earlier log(s) in {args.log_dir}); a run appends to "
                              "its log, so choose a new --log-dir or pass --overwrite")
    for c in cmds:
        print(f"+ {c.shell()}", flush=True)
        if args.dry_run:
            continue
        if keeper:
            c.log_dir.mkdir(parents=True, exist_ok=True)
            (c.log_dir / MEASUREMENT_FILE).unlink(missing_ok=True)
            write_json_atomic(c.log_dir / MANIFEST_FILE, manifest(c, job))
        _execute(c.argv, c.env)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 with one line on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    try:
        if args.launcher == "slurm" and not os.environ.get("SLURM_JOB_ID"):
            sb = _sbatch(args, argv)
            print(f"+ {shlex.join(sb)}", flush=True)
            if not args.dry_run:
                _execute(sb)
                return 0
            print("# inside the allocation, it runs:")
        if args.command == "run":
            _start(_runs(args, [args.method], "fastest", extra), args)
            return 0
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise KareusError(f"--methods: unknown {', '.join(bad)}; use some of {', '.join(METHODS)}")
        plan_cmd = [*_kareus_cli(), "plan", "--out", args.plan_dir, *args.plan_arg]
        if not (Path(args.plan_dir) / "frontier.json").exists():
            if args.node_rank != 0:
                raise KareusError(f"{args.plan_dir}/frontier.json does not exist; plan on node rank 0 first "
                                  "(or run this comparison there first)")
            print(f"+ {shlex.join(['kareus', *plan_cmd[len(_kareus_cli()):]])}", flush=True)
            if args.dry_run:
                print(f"# then one run per frontier point of {', '.join(methods)}, then kareus compare {args.log_dir}")
                return 0
            _execute(plan_cmd)
        doc = read_frontier(args.plan_dir)
        present = [m for m in methods if doc["methods"].get(m, {}).get("points")]
        if doc.get("config", {}).get("framework") == "deepspeed" and "nanobatch_perseus" in present:
            present.remove("nanobatch_perseus")
            print("# nanobatch_perseus skipped: DeepSpeed runs microbatches whole (no nanobatch overlap engine)")
        _start(_runs(args, present, "all", extra), args)
        if args.node_rank != 0:
            return 0
        compare = ["compare", args.log_dir, "--skip-iterations", str(args.skip_iterations)]
        print(f"+ {shlex.join(['kareus', *compare])}", flush=True)
        if not args.dry_run:
            _execute([*_kareus_cli(), *compare])
        return 0
    except KareusError as e:
        print(f"kareus_launch: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
