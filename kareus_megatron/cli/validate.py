"""`kareus validate`: the GPU validation kit on one GPU (<= 8 minutes), full or read-only, or a CPU dry run.

Full mode locks clocks (needs root or CAP_SYS_ADMIN); ``--no-clock-control`` changes nothing on the GPU;
``--dry-run`` runs on the simulated backend and the CPU with tiny kernels, in seconds. Writes, under
``--out DIR`` (default ./kareus-validate): ``validate.json`` (kareus-validate/1), ``validate.png`` and,
from a full run, ``validate.calib.json`` (the fitted calibration, for ``--calibration``). The work is in
cost/gpu_validate.py; torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError, DeviceUnavailableError
from kareus_megatron.files import check_writable_location

# lazy (`kareus --help` imports every command module): cost.gpu_validate (~380 ms), the device layer (hardware.device
# and NVML, ~7 ms), rich (~18 ms) and plotting (matplotlib).

HELP = "check NVML, clocks, the energy counter and the model's kernels on this GPU (full, read-only or --dry-run)"
MAX_WINDOW_S = 10.0  # longest --seconds: the kit must fit in 8 minutes
RUNTIME_CHECKS = ("megatron_patch", "event_alignment", "partitioned_layer")  # runtime/selfcheck/checks.py's CHECKS
SELFCHECK_TIMEOUT_S = {True: 120.0, False: 300.0}  # runtime checks, by --dry-run (they take <= 30 s / 2 min)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register --device, --gpu, --no-clock-control, --dry-run, --seconds and --out."""
    parser.add_argument(
        "--device", "--gpu-index", dest="device", type=int, default=0, help="GPU index (CUDA's numbering; default 0)"
    )
    parser.add_argument("--gpu", default=None, help="preset to compare with (default: found by the device name)")
    parser.add_argument(
        "--no-clock-control",
        dest="read_only",
        action="store_true",
        help="read-only: change nothing on the GPU (no clock lock or reset); measure as it runs "
        "(also when KAREUS_GPU_READ_ONLY is set)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="simulated GPU (KAREUS_GPU_BACKEND=nvml: this machine's NVML), kernels on the CPU, "
        "tiny sizes (seconds; no GPU needed)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="shortest measurement window (s; default 1; windows also span >= 10 counter updates)",
    )
    parser.add_argument("--out", default="kareus-validate", help="output directory (default ./kareus-validate)")


def run(args: argparse.Namespace) -> int:
    """Check the flags, run the kit, write the report files; 0 on success."""
    from kareus_megatron.cost.gpu_validate import validate_gpu
    from kareus_megatron.hardware.device import dry_run_backend, simulation_of
    from kareus_megatron.hardware.device.stop_signals import stops_cleanly
    from kareus_megatron.hardware.validate import close_after_validation, open_for_validation

    if not 0 <= args.device < 1024:
        raise ConfigError(f"--device {args.device} must be a GPU index from 0 to 1023.")
    if not 0 < args.seconds <= MAX_WINDOW_S:
        raise ConfigError(f"--seconds {args.seconds} must be above 0 and at most {MAX_WINDOW_S} s per window.")
    out = Path(args.out)
    check_writable_location(out, "--out", directory=True)
    backend = dry_run_backend() if args.dry_run else "nvml"
    try:
        dev = open_for_validation(args.device, backend, args.gpu, args.read_only)
    except DeviceUnavailableError as e:
        raise type(e)(f"kareus validate needs an NVIDIA GPU with NVML (or --dry-run): {e}") from e
    read_only = dev.read_only  # --no-clock-control, or KAREUS_GPU_READ_ONLY (which always wins)
    try:
        with stops_cleanly(), _progress() as (advance, plan):  # SIGTERM/SIGHUP: the finally resets the clocks
            report = validate_gpu(
                dev,
                read_only=read_only,
                dry_run=args.dry_run,
                sim=simulation_of(dev),
                min_window_s=args.seconds,
                progress=advance,
                on_plan=plan,
            )
    finally:
        close_after_validation(dev, read_only)
    out.mkdir(parents=True, exist_ok=True)
    report["runtime"] = _runtime_checks(args.device, args.dry_run, out / "selfcheck.json")
    report["elapsed_s"] += report["runtime"]["wall_s"]
    _write(out, report)
    _summary(out, report)
    return 0


def _runtime_checks(device: int, dry_run: bool, path: Path) -> dict[str, Any]:
    """Run runtime/selfcheck/checks.py in a subprocess; its report, or a failed entry with the reason."""
    cmd = [sys.executable, "-m", "kareus_megatron.runtime.selfcheck", "--out", str(path), "--device", str(device)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd + (["--dry-run"] if dry_run else []),
            capture_output=True,
            text=True,
            timeout=SELFCHECK_TIMEOUT_S[dry_run],
        )
        err = proc.stderr
    except subprocess.TimeoutExpired as e:
        err = f"timed out after {e.timeout:.0f} s"
    wall = time.monotonic() - t0
    try:
        report: dict[str, Any] = json.loads(path.read_text())
        path.unlink()
    except (OSError, ValueError):
        tail = (err if isinstance(err, str) else "").strip().splitlines()[-5:]
        return {
            "status": "failed",
            "wall_s": wall,
            "message": "the runtime checks did not write a report: " + " | ".join(tail),
        }
    report["status"] = "ok" if all(report[c]["status"] != "failed" for c in RUNTIME_CHECKS) else "failed"
    report["wall_s"] = wall
    return report


class _progress:
    """A rich progress bar on stderr over the sweep's windows: yields (advance(desc), plan(total))."""

    def __enter__(self) -> tuple[Any, Any]:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self._bar.__enter__()
        self._task = self._bar.add_task("identity, clocks, energy counter", total=None)
        return self._advance, self._plan

    def _plan(self, total: int) -> None:
        self._bar.update(self._task, total=total, description="warm-up")

    def _advance(self, desc: str) -> None:
        self._bar.update(self._task, advance=1, description=desc)

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(*exc)  # type: ignore[arg-type]


def _write(out: Path, report: dict[str, Any]) -> None:
    from kareus_megatron.plotting.validate import plot_validation

    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    if "calibration" in report:
        (out / "validate.calib.json").write_text(json.dumps(report["calibration"], indent=2, sort_keys=True) + "\n")
    plot_validation(report).savefig(out / "validate.png", dpi=110)


def _summary(out: Path, report: dict[str, Any]) -> None:
    ident, acc = report["identity"], report["accuracy"]
    simulated = "simulated " if report.get("backend") == "simulated" else ""
    print(
        f"kareus validate ({report['mode']}{', dry run' if report['dry_run'] else ''}) on {simulated}GPU "
        f"{ident['index']} {ident['name']} (preset {report['gpu']}), {report['elapsed_s']:.1f} s"
    )
    match = {True: "yes", False: "NO"}.get(ident["uuid_match"], "n/a (CUDA not initialised)")
    period_s = report["energy_counter"]["update_period_s"]
    period = f"{period_s * 1e3:.1f} ms" if period_s >= 1e-3 else f"{period_s * 1e6:.0f} µs"
    print(
        f"  UUID matches CUDA: {match}; clocks {report['clocks']['min_mhz']}.."
        f"{report['clocks']['max_mhz']} MHz ({report['clocks']['count']}); energy counter updates every {period}"
    )
    if "lock_reset" in report:
        lr = report["lock_reset"]
        applied = lr["applied_s_median"]
        worst = lr.get("applied_s_max")
        print(
            f"  locked {lr['locked_ok']}/{lr['tried']} clocks; clock change applied in "
            f"{'n/a' if applied is None else f'{applied * 1e3:.1f} ms'} (median; max "
            f"{'n/a' if worst is None else f'{worst * 1e3:.1f} ms'}); plans assume "
            f"{lr.get('preset_clock_latency_s', 0.0) * 1e3:g} ms (kareus plan --clock-latency-ms)"
        )
    for label, m in acc.items():
        parts = [f"{k.removesuffix('_pct').replace('_', ' ')} {v:.1f}%" for k, v in m.items() if k.endswith("_pct")]
        print(f"  {label}: " + ", ".join(parts))
    print(f"  clock calls: {report['clock_calls']['set']} set, {report['clock_calls']['reset']} reset")
    rt = report["runtime"]
    checks = ", ".join(f"{c} {rt[c]['status']}" for c in RUNTIME_CHECKS if c in rt) or rt.get("message", "")
    print(f"  runtime checks ({rt['wall_s']:.1f} s): {checks}")
    files = "validate.json, validate.png" + (", validate.calib.json" if "calibration" in report else "")
    print(f"wrote {out}/: {files}")
