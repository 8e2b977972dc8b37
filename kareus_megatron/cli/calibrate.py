"""`kareus calibrate`: fit the kernel time/energy model to a measured profile, or to microbenchmarks.

``--profile FILE.csv``: a Perseus-format stage profile (stage,instruction,frequency,time,energy) of the
workload given by the usual flags. ``--run``: on a GPU machine, a bf16 GEMM, a memory-bound copy and
idle are measured at a sweep of locked SM clocks (MHz) with energy (J) from the NVML counter, after a
warm-up to a steady temperature, in windows of >= --seconds and >= 10 counter updates, clocks in random
order with interleaved repeats and cooldowns, temperature recorded per window (hardware/measure.py), in
at most 5 minutes; the same least-squares fit then runs on those series (cost/microbench.py).
``--run --dry-run`` does the same on the simulated GPU with tiny CPU kernels. torch is imported only for --run.
``--from-log RUN --plan PLAN``: fit time and power parameters to a training run's own per-instruction times
and energy windows (cost/calibrate_log.py); several runs with one --plan each, or one --plan for all.
--seconds is then the shortest energy window (s), --calibration the prior (default: the preset).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path
from typing import Any

from kareus_megatron.cli.workload_args import add_workload_arguments, workload_from_args
from kareus_megatron.errors import ConfigError, DeviceUnavailableError, PlanMismatchError
from kareus_megatron.files import check_writable_location
from kareus_megatron.report.runlog import MEASUREMENT_FILE, read_run_log

# lazy (`kareus --help` imports every command module): the fits (cost.calibrate ~290 ms, cost.microbench ~350 ms),
# cost.calibration and plan.io (~50 ms each), the device layer (hardware.device and NVML, ~7 ms), report.measurements
# (~2.5 ms) and rich (~18 ms).

MAX_SECONDS = 10.0  # longest --seconds per window (s): the sweep must fit in 5 minutes
HELP = "fit the time/energy model to a Perseus-format profile (--profile) or to microbenchmarks on this GPU (--run)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the workload flags plus --profile/--run and -o."""
    add_workload_arguments(parser)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--profile", default=None, help="measured profile CSV: stage,instruction,frequency,time,energy")
    src.add_argument(
        "--from-log",
        action="append",
        default=None,
        metavar="RUN",
        help="a run log (--kareus-log directory or run directory) to fit to; repeat for several runs",
    )
    src.add_argument(
        "--run",
        action="store_true",
        help="run microbenchmarks on this machine's GPU (needs NVML and permission to lock clocks)",
    )
    parser.add_argument(
        "--device", "--gpu-index", dest="device", type=int, default=0, help="GPU index for --run (default 0)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="shortest measurement window for --run (s; default 1; windows also span >= 10 energy counter updates)",
    )
    parser.add_argument(
        "--plan",
        action="append",
        default=None,
        metavar="PLAN",
        help="with --from-log: the plan file the run executed (one per --from-log, or one for all)",
    )
    parser.add_argument(
        "--iterations",
        default=None,
        metavar="A:B",
        help="with --from-log: fit iterations A..B only (inclusive; e.g. a profile phase of the closed loop)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --from-log: accept a plan whose sha256 differs from the one the log recorded",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="with --run: the simulated GPU and tiny CPU kernels (seconds; no GPU needed)",
    )
    parser.add_argument(
        "--ratios-only",
        action="store_true",
        help="fit time ratios and power only, not absolute times (profiles in scaled units)",
    )
    parser.add_argument(
        "-o",
        "--out",
        "--output",
        dest="output",
        default=None,
        metavar="FILE",
        help="write the calibration JSON to FILE and the fit table to stdout (default, or '-': "
        "the JSON to stdout and the fit table to stderr)",
    )


def run(args: argparse.Namespace) -> int:
    """Fit and write the calibration; return the exit status."""
    from kareus_megatron.cost.calibration import save_calibration

    if args.dry_run and not args.run:
        raise ConfigError("--dry-run goes with --run (it simulates the GPU measurements).")
    if not args.profile and not args.run and not args.from_log:
        raise ConfigError(
            "give --profile FILE.csv (a measured Perseus profile), --from-log RUN --plan PLAN (a "
            "training run's log) or --run (microbenchmarks on a GPU)."
        )
    if (args.plan or args.force or args.iterations) and not args.from_log:
        raise ConfigError("--plan, --force and --iterations go with --from-log (the run log they describe).")
    if args.from_log and not args.plan:
        raise ConfigError("--from-log needs --plan PLAN, the plan file the run executed.")
    if args.from_log and len(args.plan) not in (1, len(args.from_log)):
        raise ConfigError(
            f"{len(args.from_log)} --from-log runs but {len(args.plan)} --plan files; give one --plan "
            "per run, or one for all."
        )
    if args.run:
        from kareus_megatron.hardware.device import READ_ONLY_ENV, read_only_from_env

        if read_only_from_env():
            raise ConfigError(
                f"kareus calibrate --run locks the SM clock at each clock it measures, and "
                f"{READ_ONLY_ENV} is set (change nothing on the GPU); unset it to calibrate, or check "
                "the GPU read-only with kareus validate --no-clock-control."
            )
    if not 0 <= args.device < 1024:
        raise ConfigError(f"--device {args.device} must be a GPU index from 0 to 1023.")
    if not 0 < args.seconds <= MAX_SECONDS:
        raise ConfigError(f"--seconds {args.seconds} must be above 0 and at most {MAX_SECONDS} s per measurement.")
    to_file = args.output not in (None, "-")
    if to_file:  # before the fit: a bad path fails now, not after it
        if not Path(args.output).absolute().parent.is_dir():
            parent = str(Path(args.output).parent)
            raise ConfigError(f"-o {args.output}: directory {parent!r} does not exist; create it first.")
        check_writable_location(args.output, "-o", directory=False)
    if args.from_log:
        cal = _from_logs(args)
    else:
        cal = _from_profile(args) if args.profile else _from_run(args)
    fit = cal.fit
    if to_file:
        _fit_report(fit)
        save_calibration(cal, args.output)
        print(f"wrote {args.output} (sha256 {cal.sha256[:12]})")
    else:  # stdout is the JSON alone, so `kareus calibrate ... > cal.json` is a valid file
        with contextlib.redirect_stdout(sys.stderr):
            _fit_report(fit)
        print(cal.to_json(), end="")
    return 0


def _fit_report(fit: dict[str, Any]) -> None:
    from kareus_megatron.cost.calibrate import print_fit_report

    if "parameters" in fit:  # --from-log
        from kareus_megatron.cost.calibrate_log import print_log_fit_report

        print_log_fit_report(fit)
        return

    print_fit_report(fit["uncalibrated"], fit["calibrated"])


def _fitting(what: str) -> Any:
    """A transient progress bar on stderr (a pulsing one: the fit reports no fraction) while `what` runs."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(
        TextColumn(what),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    progress.add_task(what, total=None)
    return progress


def _from_profile(args: argparse.Namespace):
    from kareus_megatron.cost.calibrate import fit_calibration
    from kareus_megatron.cost.profile import read_perseus_profile

    gpu, model, par = workload_from_args(args)
    profile = read_perseus_profile(args.profile)
    with _fitting("fitting the time/energy model"):
        return fit_calibration(profile, gpu, model, par, fit_abs_time=not args.ratios_only, verbose=False)


# ---- --run: microbenchmarks on a real GPU (the fit is cost.calibrate.fit_microbenchmarks) ----------


def _from_run(args: argparse.Namespace):
    """Measure on the GPU (or, with --dry-run, the simulated one) and fit: cost/microbench.py calibrate_run."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from kareus_megatron.cost.microbench import calibrate_run
    from kareus_megatron.hardware.device import dry_run_backend, open_cuda_gpu, simulation_of
    from kareus_megatron.hardware.device.stop_signals import stops_cleanly

    try:  # --device is the CUDA index the kernels run on; NVML finds that GPU by its UUID (cuda_map.py)
        dev = open_cuda_gpu(args.device, backend=dry_run_backend() if args.dry_run else "nvml")
    except DeviceUnavailableError as e:  # also ClockControlError: one line, exit 2
        raise type(e)(f"kareus calibrate --run needs an NVIDIA GPU with NVML and clock-lock permission: {e}") from e
    console = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    task = bar.add_task("energy counter", total=None)
    try:
        with stops_cleanly(), bar:  # SIGTERM/SIGHUP: the finally resets the clocks
            cal, _ = calibrate_run(
                dev,
                dry_run=args.dry_run,
                sim=simulation_of(dev),
                seconds=args.seconds,
                progress=lambda desc: bar.update(task, advance=1, description=desc),
                on_plan=lambda n: bar.update(task, total=n, description="warm-up"),
            )
    finally:
        dev.close()
    return cal


# ---- --from-log: a training run's own measurements (the fit is cost.calibrate_log.fit_from_logs) -----------

NO_MEASUREMENTS = (
    "has no per-instruction measurements; run with a current kareus runtime (KAREUS_LOG_INSTRUCTIONS not 0)"
)


def _read_log(path: str) -> Any:
    """The run log at `path`: a --kareus-log directory, a run directory holding one, or a merged file."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--from-log {path}: no such run log; give the --kareus-log directory of a run.")
    if p.is_dir() and (p / MEASUREMENT_FILE).is_dir():
        p = p / MEASUREMENT_FILE
    return read_run_log(p)


def _check_plan(path: str, log: Any, plan: Any, plan_path: str, force: bool) -> None:
    """PlanMismatchError when `plan` is not the plan the run log `log` executed (sha256, stages, instructions)."""
    from kareus_megatron.plan.io import plan_sha256

    logged = log.header.get("plan_sha256")
    if logged and logged != plan_sha256(plan) and not force:
        raise PlanMismatchError(
            f"--plan {plan_path} is not the plan run {path} executed (the log records plan "
            f"sha256 {str(logged)[:12]}, this plan's is {plan_sha256(plan)[:12]}); give that "
            "plan, or --force."
        )
    pp = log.header.get("pp")
    if isinstance(pp, int) and pp != plan.parallel.pp:
        raise PlanMismatchError(
            f"run {path} has {pp} pipeline stages but --plan {plan_path} has "
            f"{plan.parallel.pp}; give the plan the run executed."
        )


def _check_samples(path: str, samples: Any, plan: Any, plan_path: str) -> None:
    """PlanMismatchError when a sample's stage or instruction index lies outside the plan, or its kind differs."""
    for s in samples:
        if s.pp_rank is None:
            continue  # left out of the fit
        if not 0 <= s.pp_rank < len(plan.stages) or not 0 <= s.index < len(plan.stages[s.pp_rank].instructions):
            raise PlanMismatchError(
                f"run {path}: instruction {s.index} of stage {s.pp_rank} is outside --plan "
                f"{plan_path}; give the plan the run executed."
            )
        ins = plan.stages[s.pp_rank].instructions[s.index]
        if (ins.kind, ins.chunk, ins.microbatch) != (s.kind, s.chunk, s.microbatch):
            raise PlanMismatchError(
                f"run {path}: stage {s.pp_rank} instruction {s.index} is a {s.kind} of "
                f"microbatch {s.microbatch}, --plan {plan_path} has a {ins.kind} of microbatch "
                f"{ins.microbatch} there; give the plan the run executed."
            )


def _iteration_range(text: str | None) -> tuple[float, float]:
    """--iterations A:B as (A, B) (inclusive); everything when None."""
    if text is None:
        return -math.inf, math.inf
    a, sep, b = str(text).partition(":")
    try:
        lo, hi = int(a), int(b)
    except ValueError:
        lo, hi = -1, -2
    if not sep or lo < 0 or hi < lo:
        raise ConfigError(f"--iterations {text!r}: give A:B, two iteration numbers with 0 <= A <= B (e.g. 2:16)")
    return lo, hi


def _from_logs(args: argparse.Namespace) -> Any:
    """Read every run log and plan, check that they match, and fit (cost/calibrate_log.py)."""
    from kareus_megatron.cost.calibrate_log import LogRun, fit_from_logs
    from kareus_megatron.cost.calibration import load_calibration
    from kareus_megatron.plan.io import load_plan
    from kareus_megatron.plan.workload import plan_workload
    from kareus_megatron.report import measurements as meas

    plans = args.plan if len(args.plan) == len(args.from_log) else args.plan * len(args.from_log)
    runs, gpus = [], set()
    for path, plan_path in zip(args.from_log, plans):
        log = _read_log(path)
        plan = load_plan(plan_path)
        _check_plan(path, log, plan, plan_path, args.force)
        gpu, model, par = plan_workload(plan)
        gpus.add(gpu.name)
        lo, hi = _iteration_range(args.iterations)
        samples = [x for x in meas.instruction_samples(log) if lo <= x.iteration <= hi]
        windows = [
            w
            for w in meas.energy_windows(log, min_window_s=args.seconds)
            if lo <= min(w.iterations) and max(w.iterations) <= hi
        ]
        if not samples:
            raise ConfigError(f"run log {path} {NO_MEASUREMENTS}")
        if not windows:
            raise ConfigError(
                f"run log {path} has no energy window of >= {args.seconds} s after the warm-up "
                "iterations; run longer or give a smaller --seconds"
            )
        _check_samples(path, samples, plan, plan_path)
        runs.append(LogRun(label=str(path), model=model, par=par, samples=samples, windows=windows))
    if len(gpus) > 1:
        raise ConfigError(f"the plans name different GPUs ({', '.join(sorted(gpus))}); a calibration is for one GPU.")
    prior = load_calibration(args.calibration) if args.calibration else None
    with _fitting("fitting the time/energy model to the run log"):
        return fit_from_logs(runs, gpu, prior=prior)
