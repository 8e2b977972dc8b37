"""`kareus calibrate`: fit the kernel time/energy model to a measured profile, or to microbenchmarks.

``--profile FILE.csv``: a Perseus-format stage profile (stage,instruction,frequency,time,energy) of the
workload given by the usual flags. ``--run``: on a GPU machine, a bf16 GEMM, a memory-bound copy and
idle are measured at a sweep of locked SM clocks (MHz) with energy (J) from the NVML counter, after a
warm-up to a steady temperature, in windows of >= --seconds and >= 10 counter updates, clocks in random
order with interleaved repeats and cooldowns, temperature recorded per window (hardware/measure.py), in
at most 5 minutes; the same least-squares fit then runs on those series (cost/microbench.py).
``--run --dry-run`` does the same on the simulated GPU with tiny CPU kernels. torch is imported only for --run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError, DeviceUnavailableError
from kareus_megatron.files import check_writable_location

MAX_SECONDS = 10.0  # longest --seconds per window (s): the sweep must fit in 5 minutes
HELP = "fit the time/energy model to a Perseus-format profile (--profile) or to microbenchmarks on this GPU (--run)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the workload flags plus --profile/--run and -o."""
    from kareus_megatron.cli.workload_args import add_workload_arguments

    add_workload_arguments(parser)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--profile", default=None, help="measured profile CSV: stage,instruction,frequency,time,energy")
    src.add_argument("--run", action="store_true", help="run microbenchmarks on this machine's GPU (needs NVML and "
                     "permission to lock clocks)")
    parser.add_argument("--device", "--gpu-index", dest="device", type=int, default=0,
                        help="GPU index for --run (default 0)")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="shortest measurement window for --run (s; default 1; windows also span >= 10 energy "
                        "counter updates)")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --run: the simulated GPU and tiny CPU kernels (seconds; no GPU needed)")
    parser.add_argument("--ratios-only", action="store_true",
                        help="fit time ratios and power only, not absolute times (profiles in scaled units)")
    parser.add_argument("-o", "--out", "--output", dest="output", default=None, metavar="FILE",
                        help="write the calibration JSON to FILE and the fit table to stdout (default, or '-': "
                        "the JSON to stdout and the fit table to stderr)")


def run(args: argparse.Namespace) -> int:
    """Fit and write the calibration; return the exit status."""
    from kareus_megatron.cost.calibration import save_calibration

    if args.dry_run and not args.run:
        raise ConfigError("--dry-run goes with --run (it simulates the GPU measurements).")
    if not args.profile and not args.run:
        raise ConfigError("give --profile FILE.csv (a measured Perseus profile) or --run (microbenchmarks on a GPU).")
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

    print_fit_report(fit["uncalibrated"], fit["calibrated"])


def _fitting(what: str) -> Any:
    """A transient progress bar on stderr (a pulsing one: the fit reports no fraction) while `what` runs."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(TextColumn(what), BarColumn(), TimeElapsedColumn(), console=console, transient=True,
                        disable=not console.is_terminal)
    progress.add_task(what, total=None)
    return progress


def _from_profile(args: argparse.Namespace):
    from kareus_megatron.cli.workload_args import workload_from_args
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
    from kareus_megatron.hardware.device import open_cuda_gpu, simulation_of

    try:  # --device is the CUDA index the kernels run on; NVML finds that GPU by its UUID (cuda_map.py)
        dev = open_cuda_gpu(args.device, backend="simulated" if args.dry_run else "nvml")
    except DeviceUnavailableError as e:  # also ClockControlError: one line, exit 2
        raise type(e)(f"kareus calibrate --run needs an NVIDIA GPU with NVML and clock-lock permission: {e}") from e
    console = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
                   disable=not console.is_terminal)
    task = bar.add_task("energy counter", total=None)
    try:
        with bar:
            cal, _ = calibrate_run(dev, dry_run=args.dry_run, sim=simulation_of(dev), seconds=args.seconds,
                                   progress=lambda desc: bar.update(task, advance=1, description=desc),
                                   on_plan=lambda n: bar.update(task, total=n, description="warm-up"))
    finally:
        dev.close()
    return cal
