"""`kareus calibrate`: fit the kernel time/energy model to a measured profile, or to microbenchmarks.

``--profile FILE.csv``: a Perseus-format stage profile (stage,instruction,frequency,time,energy) of the
workload given by the usual flags. ``--run``: on a GPU machine, a bf16 GEMM and a memory-bound copy
are timed at a sweep of locked SM clocks (MHz) with energy (J) from the NVML counter, plus idle power;
the same least-squares fit then runs on those series. torch is imported only for --run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError, DeviceUnavailableError
from kareus_megatron.files import check_writable_location

MAX_SECONDS = 600.0  # longest --seconds per measurement (s)
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
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per measurement for --run (default 1.5)")
    parser.add_argument("--ratios-only", action="store_true",
                        help="fit time ratios and power only, not absolute times (profiles in scaled units)")
    parser.add_argument("-o", "--out", "--output", dest="output", default=None, metavar="FILE",
                        help="write the calibration JSON to FILE and the fit table to stdout (default, or '-': "
                        "the JSON to stdout and the fit table to stderr)")


def run(args: argparse.Namespace) -> int:
    """Fit and write the calibration; return the exit status."""
    from kareus_megatron.cost.calibration import save_calibration

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


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise DeviceUnavailableError(
            "--run needs torch with CUDA; install the [megatron] extra on the GPU machine."
        ) from e
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            "--run needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)."
        )
    return torch


def _measure(torch: Any, dev: Any, fn: Any, seconds: float) -> tuple[float, float]:
    """(time per call (s), energy per call (J)) of fn() run back to back for about `seconds`."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(3, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    e0 = dev.energy_j()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return dt / n, (dev.energy_j() - e0) / n


def _from_run(args: argparse.Namespace):
    from rich.progress import Progress

    from kareus_megatron.cost import calibrate as cb
    from kareus_megatron.hardware.device import open_gpu
    from kareus_megatron.hardware.gpus import clock_grid_mhz

    try:
        dev = open_gpu(args.device, backend="nvml")
    except DeviceUnavailableError as e:  # also ClockControlError: one line, exit 2
        raise type(e)(f"kareus calibrate --run needs an NVIDIA GPU with NVML and clock-lock permission: {e}") from e
    torch = _torch()
    gpu = dev.spec
    supported = dev.supported_sm_clocks_mhz() or gpu.sm_clocks_mhz  # the driver's list, highest first
    clocks = list(clock_grid_mhz(supported, cb.MICROBENCH_CLOCK_STEP_MHZ, cb.MICROBENCH_LOWEST_FRACTION))
    m, n, k = cb.MICROBENCH_GEMM_MNK
    a = torch.randn(m, k, device=f"cuda:{args.device}", dtype=torch.bfloat16)
    b = torch.randn(k, n, device=a.device, dtype=torch.bfloat16)
    src = torch.empty(cb.MICROBENCH_COPY_BYTES // 2, device=a.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    meas: dict[str, list[tuple[float, float]]] = {"gemm": [], "copy": [], "idle": []}
    try:
        with Progress() as bar:
            task = bar.add_task("microbenchmarks at locked clocks", total=len(clocks))
            for f in clocks:
                dev.set_sm_clock_mhz(f)  # ClockControlError (no permission): one line, exit 2
                meas["gemm"].append(_measure(torch, dev, lambda: torch.matmul(a, b), args.seconds))
                meas["copy"].append(_measure(torch, dev, lambda: dst.copy_(src), args.seconds))
                e0, t0 = dev.energy_j(), time.perf_counter()
                time.sleep(args.seconds)
                meas["idle"].append((time.perf_counter() - t0, dev.energy_j() - e0))
                bar.advance(task)
    finally:
        dev.reset_clocks()
    source = (f"kareus calibrate --run on GPU {args.device} ({gpu.name}): bf16 GEMM {m}x{n}x{k}, "
              f"{cb.MICROBENCH_COPY_BYTES >> 20} MiB copy, idle; clocks {clocks[0]}..{clocks[-1]} MHz")
    with _fitting("fitting the time/energy model"):
        return cb.fit_microbenchmarks(gpu, clocks, meas, source, verbose=False)
