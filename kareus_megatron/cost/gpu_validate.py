"""`kareus validate`: one run that checks the GPU paths and the model on one GPU, and writes a report.

Two modes. *Full* (clock control permitted): identity, lock/reset of a grid of supported clocks with the
clock-change latency (s), the energy counter's update period, and the GEMM, attention and copy kernels
(plus idle) at >= 6 locked clocks, fitted into a calibration (cost/calibrate.py's fit) and compared with
the preset: time-ratio, absolute-time and power MAPE (%), before and after the fit. *Read-only*
(``read_only``): the same reads and kernels at whatever clock the GPU runs at, against the preset at that
clock; no clock or other setting is touched (every set/reset is refused by hardware/validate.py's guard).
The report is a JSON-ready dict (format ``kareus-validate/1``); plotting/validate.py draws it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kareus_megatron.cost.calibrate import fit_series, microbench_free_params, series_metrics
from kareus_megatron.cost.calibration import FORMAT as CALIBRATION_FORMAT
from kareus_megatron.cost.calibration import Calibration
from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.microbench import (
    DRY_RUN_SIZES,
    FULL_SIZES,
    attention_free_param,
    counter_period,
    kernel_ops,
    kernel_series,
    load_torch,
    model_activity,
    predicted,
    torch_kernels,
)
from kareus_megatron.hardware.device.base import GPUDevice, SimulationHooks
from kareus_megatron.hardware.gpus import clock_grid_mhz
from kareus_megatron.hardware.measure import WindowPolicy, sweep, sweep_seconds
from kareus_megatron.hardware.validate import ClockCallGuard, identity, lock_and_latency, lock_grid, supported_clocks

FORMAT = "kareus-validate/1"
BUDGET_S = 480.0  # the whole kit on one GPU: at most 8 minutes
KERNELS = ("gemm", "attention", "copy", "idle")
SWEEP_CLOCKS = 8  # clocks of the full mode's kernel sweep (>= 6)
LOCK_CLOCKS = 40  # clocks of the lock/reset check, spread over the supported list
RUNTIME_S = 120.0  # kept for the runtime checks (runtime/selfcheck/checks.py, run by cli/validate.py after the kit)
# Checks of issue 16's list this kit does not run, and why: none left. The megatron-core patch, the
# controller's CUDA-event alignment and the partitioned layer run in runtime/selfcheck/checks.py (report "runtime").
NOT_RUN: dict[str, str] = {}


def _cuda_identity(torch: Any, index: int, dry_run: bool) -> dict[str, Any] | None:
    if dry_run:
        return None
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return {
        "index": index,
        "name": str(props.name),
        "uuid": str(uuid) if uuid is not None else None,
        "memory_bytes": int(props.total_memory),
        "sm_count": int(props.multi_processor_count),
    }


def _mape(measured: list[float], model: list[float]) -> float:
    m, p = np.asarray(measured, dtype=float), np.asarray(model, dtype=float)
    return float(100 * np.mean(np.abs(p / m - 1))) if len(m) else float("nan")


def validate_gpu(
    device: GPUDevice,
    *,
    read_only: bool,
    dry_run: bool,
    sim: SimulationHooks | None,
    min_window_s: float = 1.0,
    progress: Callable[[str], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    budget_s: float | None = None,
) -> dict[str, Any]:
    """Run the kit on `device` (full, or read-only with `read_only`); return the report dict. `budget_s`: the
    time (s) the kit alone may take (default: BUDGET_S less what the runtime checks keep)."""
    t_start = time.monotonic()
    guard = ClockCallGuard(device, read_only=read_only)
    torch = load_torch(cuda=not dry_run)
    sizes = DRY_RUN_SIZES if dry_run else FULL_SIZES
    gpu = device.spec
    kernels, sync = torch_kernels(torch, "cpu" if dry_run else f"cuda:{device.index}", sizes, KERNELS)
    ops = kernel_ops(sizes)
    preset = KernelModel(gpu)
    report: dict[str, Any] = {
        "format": FORMAT,
        "mode": "read_only" if read_only else "full",
        "dry_run": dry_run,
        "backend": "simulated" if sim is not None else "nvml",
        "gpu": gpu.name,
        "sizes": dataclasses.asdict(sizes),
    }
    report["identity"] = identity(guard, _cuda_identity(torch, device.index, dry_run))
    report["clocks"] = supported_clocks(guard)
    report["energy_counter"] = counter_period(guard, kernels["gemm"], sync, 0.1 if dry_run else 3.0)
    period = 0.0 if dry_run else report["energy_counter"]["update_period_s"]

    def busy() -> None:
        for _ in range(2 if dry_run else 20):
            kernels["gemm"]()

    supported = list(device.supported_sm_clocks_mhz()) or list(gpu.sm_clocks_mhz)
    clocks: list[int] | None = None
    if not read_only:
        report["lock_reset"] = lock_and_latency(guard, lock_grid(supported, 8 if dry_run else LOCK_CLOCKS), busy, sync)
        report["lock_reset"]["preset_clock_latency_s"] = gpu.clock_latency_s  # what plans assume (gpus.toml [LAT])
        clocks = lock_grid(clock_grid_mhz(supported, 15, 0.5), SWEEP_CLOCKS)
    if dry_run:
        policy = WindowPolicy(
            min_window_s=min(min_window_s, 0.02), cooldown_s=0.0, repeats=2, warmup_max_s=0.05, warmup_stable_s=0.02
        )
    else:
        warmup_s = 45.0 if budget_s is None else min(45.0, budget_s / 4)
        policy = WindowPolicy(min_window_s=min_window_s, repeats=2 if clocks else 3, warmup_max_s=warmup_s)
    if budget_s is None:
        left = BUDGET_S - RUNTIME_S - (time.monotonic() - t_start) - 30.0  # 30 s: the fit and the files
    else:
        left = budget_s - (time.monotonic() - t_start) - 10.0
    n_clk = len(clocks) if clocks else 1
    while policy.repeats > 1 and sweep_seconds(policy, period, n_clk, len(KERNELS)) > left:
        policy = dataclasses.replace(policy, repeats=policy.repeats - 1)
    report["planned_sweep_s"] = sweep_seconds(policy, period, n_clk, len(KERNELS))
    if on_plan is not None:
        on_plan(n_clk * len(KERNELS) * policy.repeats)
    activity = model_activity(preset, ops) if sim is not None else None
    try:
        measured = sweep(
            guard,
            kernels,
            sync,
            clocks,
            policy,
            period,
            warmup_kernel="gemm",
            sim=sim,
            activity=activity,
            progress=progress,
        )
    finally:
        if not read_only:
            guard.reset_clocks()
    report["sweep"] = {**measured.to_dict(), "repeats": policy.repeats, "cooldown_s": policy.cooldown_s}
    report["kernels"] = {}
    for name in KERNELS:
        cl, t, e = measured.per_clock(name)
        p_meas = [ee / tt for ee, tt in zip(e, t)]
        t_pre, p_pre = predicted(preset, ops.get(name), cl)
        row = {
            "clocks_mhz": cl,
            "time_s": t,
            "energy_j": e,
            "power_w": p_meas,
            "preset_time_s": t_pre,
            "preset_power_w": p_pre,
            "power_mape_pct": _mape(p_meas, p_pre),
        }
        if name != "idle":
            row["time_mape_pct"] = _mape(t, t_pre)
        report["kernels"][name] = row
    if read_only:  # one clock: absolute time and power against the preset at the clock the GPU ran at
        rows = report["kernels"]
        report["accuracy"] = {
            "preset": {
                "time_abs_mape_pct": _mape(
                    [v for k in KERNELS[:3] for v in rows[k]["time_s"]],
                    [v for k in KERNELS[:3] for v in rows[k]["preset_time_s"]],
                ),
                "power_mape_pct": _mape(
                    [v for k in KERNELS for v in rows[k]["power_w"]],
                    [v for k in KERNELS for v in rows[k]["preset_power_w"]],
                ),
            }
        }
    else:
        report.update(_fit(gpu, ops, measured, report["kernels"]))
    report["clock_calls"] = dict(guard.calls)
    report["device_recorded"] = [list(c) for c in device.recorded]  # read-only device: the calls not applied
    report["not_run"] = dict(NOT_RUN)
    report["elapsed_s"] = time.monotonic() - t_start
    report["budget_s"] = BUDGET_S
    return report


def _fit(gpu: Any, ops: dict[str, Any], measured: Any, rows: dict[str, Any]) -> dict[str, Any]:
    """Fit the calibration to the full mode's sweep; preset and calibrated errors and curves."""
    series = kernel_series(ops, measured, KERNELS)
    before = series_metrics(KernelModel(gpu), series)
    free = (*microbench_free_params(gpu), attention_free_param())
    fitted_gpu, params, values = fit_series(series, gpu, free, prior_weight=0.3)
    fitted = KernelModel.from_params(fitted_gpu, params)
    after = series_metrics(fitted, series)
    idle = series[-1]
    values["p_blocked_w"] = float(np.median(idle.energy_j / idle.time_s))
    for name, row in rows.items():
        row["calibrated_time_s"], row["calibrated_power_w"] = predicted(fitted, ops.get(name), row["clocks_mhz"])
    cal = Calibration(
        format=CALIBRATION_FORMAT,
        gpu=gpu.name,
        params=values,
        source=f"kareus validate on {gpu.name}: gemm, attention, copy, idle at {len(series[0].clocks_mhz)} clocks",
        fit={"uncalibrated": before, "calibrated": after},
    )
    return {"accuracy": {"preset": before, "calibrated": after}, "calibration": cal.model_dump(mode="json")}
