"""The read-only GPU check: everything kareus can learn on a GPU without changing any of its settings.

    python benchmarks/gpu_check.py --out DIR            # one GPU (CUDA device 0), at most 8 minutes
    python benchmarks/gpu_check.py --dry-run --out DIR  # CPU, the simulated GPU (KAREUS_GPU_BACKEND=nvml: NVML)

For the first GPU a session is lent, which is shared: clocks, power limits and every other setting must stay as
they are. The script sets KAREUS_GPU_READ_ONLY=1 for itself and every process it starts before anything is
imported (so every kareus device is read-only and the pynvml module kareus hands out refuses every changing
call, hardware/device/nvml_access.py), and runs, in this order, each step in its own time box:

1. ``nvidia_smi_before``: the GPU's settings as ``nvidia-smi --query-gpu`` reports them (persistence, compute
   mode, power limits, application clocks, MIG, ECC, clock event reasons).
2. ``env``: ``kareus env --check-permission`` (read, never tried).
3. ``energy_counter``: a bf16 GEMM loop while a thread samples NVML's energy counter (mJ) and power readings
   (``nvmlDeviceGetPowerUsage`` and the instantaneous and averaged power fields where the GPU has them, mW):
   each reading's update period (s), and the counter's energy against the integrated power samples (J).
4. ``selfcheck``: the runtime self-check (``python -m kareus_megatron.runtime.selfcheck``: the megatron-core
   patch, the CUDA-event path to a controller thread, the partitioned layer against megatron's).
5. ``host_syncs``: the partitioned layer (every mask shape, 1 and 2 nanobatches, recompute) and the CP indices
   under CUDA's sync debug mode (runtime/selfcheck/syncs.py).
6. ``nccl_comms``: the SM-limited NCCL communicators the overlap engine builds, on one rank: init time,
   memory, NCCL version (runtime/overlap/comm.py).
7. ``controller``: the clock controller in its side process on the read-only device: marked CUDA events
   through the client's forwarder, event-to-controller latency, decided/recorded/stale counts, a clean exit.
8. ``kernels``: the model's kernels (GEMM, flash attention, copy, idle) at the clock the GPU runs at against
   the preset (``kareus validate --no-clock-control``'s sweep, shortened).
9. ``nvidia_smi_after``: the same settings again; they must equal the first snapshot.

Writes ``DIR/gpu_check.json`` (``kareus-gpu-check/1``: every step's figures, status ok / failed /
not_applicable, wall time) and ``DIR/gpu_check.txt`` (one page). Exit status 0 when no step failed and the
settings did not change, 1 otherwise, 2 on bad flags.
"""

from __future__ import annotations

import os

os.environ["KAREUS_GPU_READ_ONLY"] = "1"  # before any kareus import: every device and process is read-only

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check_steps beside this file

import gpu_check_steps as steps  # noqa: E402

FORMAT = "kareus-gpu-check/1"
BUDGET_S = 480.0  # the whole check: 8 minutes
STEP_BUDGET_S = {  # each step's time box (s); the last snapshot always runs
    "nvidia_smi_before": 15,
    "env": 20,
    "energy_counter": 15,
    "selfcheck": 120,
    "host_syncs": 60,
    "nccl_comms": 45,
    "controller": 40,
    "kernels": 75,
    "nvidia_smi_after": 15,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (gpu_check.json, gpu_check.txt)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU and the simulated GPU (KAREUS_GPU_BACKEND=nvml: this machine's NVML), tiny sizes, seconds",
    )
    ap.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    ap.add_argument("--skip", default="", help="steps to skip, comma-separated (they report not_applicable)")
    ns = ap.parse_args(argv)
    unknown = {s for s in ns.skip.split(",") if s} - set(STEP_BUDGET_S)
    if unknown:
        ap.error(f"--skip {','.join(sorted(unknown))}: not a step; steps: {', '.join(STEP_BUDGET_S)}")
    if ns.device < 0:
        ap.error(f"--device {ns.device} must be a CUDA device index (0 or more)")
    return ns


def _run_step(name: str, fn: Callable[[float], dict[str, Any]], deadline: float, skip: set[str]) -> dict[str, Any]:
    t0 = time.monotonic()
    box = min(float(STEP_BUDGET_S[name]), max(5.0, deadline - t0))
    if name in skip:
        res: dict[str, Any] = {"status": "not_applicable", "message": "skipped (--skip)"}
    else:
        try:
            res = fn(box)
        except Exception as e:  # a failed step is a report line; the next steps still run
            res = {
                "status": "failed",
                "message": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=8),
            }
    res["wall_s"] = round(time.monotonic() - t0, 3)
    print(f"gpu_check {name}: {res['status']} ({res['wall_s']:.1f} s)", file=sys.stderr, flush=True)
    return res


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """Every step in order; the report dict."""
    t_start = time.monotonic()
    deadline = t_start + BUDGET_S - STEP_BUDGET_S["nvidia_smi_after"]
    ctx = steps.Context(dry_run=ns.dry_run, device=ns.device, work=Path(ns.out))
    skip = {s for s in ns.skip.split(",") if s}
    report: dict[str, Any] = {
        "format": FORMAT,
        "dry_run": ns.dry_run,
        "device": ns.device,
        "budget_s": BUDGET_S,
        "read_only": os.environ.get("KAREUS_GPU_READ_ONLY"),
        "steps": {},
    }
    order: list[tuple[str, Callable[[float], dict[str, Any]]]] = [
        ("nvidia_smi_before", lambda box: steps.nvidia_smi(ctx, box)),
        ("env", lambda box: steps.env(ctx, box)),
        ("energy_counter", lambda box: steps.energy_counter(ctx, box)),
        ("selfcheck", lambda box: steps.selfcheck(ctx, box)),
        ("host_syncs", lambda box: steps.host_syncs(ctx, box)),
        ("nccl_comms", lambda box: steps.nccl_comms(ctx, box)),
        ("controller", lambda box: steps.controller(ctx, box)),
        ("kernels", lambda box: steps.kernels(ctx, box)),
    ]
    for name, fn in order:
        report["steps"][name] = _run_step(name, fn, deadline, skip)
    report["steps"]["nvidia_smi_after"] = _run_step(
        "nvidia_smi_after", lambda box: steps.nvidia_smi(ctx, box), t_start + BUDGET_S, skip
    )
    report["settings_unchanged"] = steps.same_settings(
        report["steps"]["nvidia_smi_before"], report["steps"]["nvidia_smi_after"]
    )
    report["nvml_changes_refused"] = steps.refused_nvml_calls()
    report["elapsed_s"] = round(time.monotonic() - t_start, 3)
    report["ok"] = (
        report["settings_unchanged"] is not False
        and not report["nvml_changes_refused"]
        and all(s["status"] != "failed" for s in report["steps"].values())
    )
    return report


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    out = Path(ns.out)
    if out.exists() and not out.is_dir():
        print(f"gpu_check.py: error: --out {out} is a file; give a directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    report = run(ns)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    text = steps.summary(report)
    (out / "gpu_check.txt").write_text(text)
    print(text, end="")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
