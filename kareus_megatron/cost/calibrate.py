"""Fit the kernel time/energy model to measurements with scipy.optimize.least_squares.

A *series* is one measured curve: time (s) and energy (J) of the same work at several locked SM clocks
(MHz), e.g. one stage's forward instruction in a Perseus profile, or one microbenchmark. The fit
matches, per series, the time ratio t(f)/t(f_max), the average power E/t and (weakly) the absolute time,
with weak priors that keep every parameter near its first-principles default when the data cannot
tell it apart. Parameters: efficiencies, power coefficients, the voltage curve and a time scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from kareus_megatron.cost.calibration import FORMAT, Calibration
from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.params import GPU_PARAM_NAMES, KernelParams, with_gpu_params
from kareus_megatron.cost.profile import StageProfile
from kareus_megatron.errors import CalibrationError
from kareus_megatron.hardware.gpus import GPUSpec
from kareus_megatron.workload.models import ModelSpec
from kareus_megatron.workload.opgraph import Op
from kareus_megatron.workload.parallel import ParallelConfig

Predictor = Callable[[KernelModel], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Series:
    """Measured time (s) and energy (J) of one piece of work at clocks (MHz), and how to predict it."""

    label: str
    clocks_mhz: np.ndarray
    time_s: np.ndarray
    energy_j: np.ndarray
    predict: Predictor
    key: Any = None  # series with equal keys predict the same work at the same clocks (computed once)


def _predict_all(km: KernelModel, series: Sequence[Series]) -> list[tuple[np.ndarray, np.ndarray]]:
    cache: dict[Any, tuple[np.ndarray, np.ndarray]] = {}
    out = []
    for s in series:
        if s.key is None:
            out.append(s.predict(km))
            continue
        if s.key not in cache:
            cache[s.key] = s.predict(km)
        out.append(cache[s.key])
    return out


@dataclass(frozen=True)
class FreeParam:
    """A fitted parameter: bounds and a weak Gaussian prior (mean = the default, width sigma)."""

    name: str
    lo: float
    hi: float
    sigma: float


def default_free_params(gpu: GPUSpec) -> tuple[FreeParam, ...]:
    """Parameters a stage-profile fit frees, with bounds and prior widths."""
    fmax, fmin = gpu.max_sm_clock_mhz, gpu.min_sm_clock_mhz
    return (
        FreeParam("gemm_efficiency", 0.30, 1.0, 0.15),
        FreeParam("attention_efficiency", 0.3, 1.0, 0.1),
        FreeParam("attention_bwd_efficiency", 0.10, 1.0, 0.1),
        FreeParam("memory_efficiency", 0.30, 1.0, 0.15),
        FreeParam("nvlink_efficiency", 0.15, 1.0, 0.2),
        FreeParam("comm_sm_bytes_per_cycle", 1.0, 64.0, 8.0),
        FreeParam("sm_load_bytes_per_cycle", 4.0, 128.0, 8.0),
        FreeParam("launch_overhead_s", 0.0, 50e-6, 4e-6),
        FreeParam("memory_op_compute_activity", 0.0, 1.0, 0.2),
        FreeParam("comm_compute_activity", 0.0, 6.0, 0.5),
        FreeParam("time_scale", 0.02, 50.0, 1e3),
        FreeParam("static_power_w", 0.05 * gpu.power_limit_w, 0.4 * gpu.power_limit_w, 0.5 * gpu.static_power_w),
        FreeParam("idle_dynamic_w", 0.0, 0.5 * gpu.power_limit_w, 0.5 * max(gpu.idle_dynamic_w, 10.0)),
        FreeParam("compute_dynamic_w", 0.2 * gpu.power_limit_w, 2.0 * gpu.power_limit_w, gpu.compute_dynamic_w),
        FreeParam("memory_dynamic_w", 0.0, 0.25 * gpu.power_limit_w, max(gpu.memory_dynamic_w, 10.0)),
        FreeParam("voltage_floor", 0.5, 1.0, 0.15),
        FreeParam("voltage_knee_mhz", fmin, fmax - 30, 0.3 * (fmax - fmin)),
        FreeParam("power_limit_w", 0.8 * gpu.power_limit_w, 1.2 * gpu.power_limit_w, 0.05 * gpu.power_limit_w),
    )


def apply_params(gpu: GPUSpec, base: KernelParams, names: Sequence[str], values: np.ndarray) -> KernelModel:
    """A KernelModel with parameters `names` set to `values` (GPU power fields or kernel params)."""
    gpu_kw = {n: float(v) for n, v in zip(names, values) if n in GPU_PARAM_NAMES}
    k_kw = {n: float(v) for n, v in zip(names, values) if n not in GPU_PARAM_NAMES}
    return KernelModel.from_params(with_gpu_params(gpu, gpu_kw), dataclasses.replace(base, **k_kw))


def param_value(gpu: GPUSpec, base: KernelParams, name: str) -> float:
    """The current value of parameter `name` in `gpu` (power fields) or `base` (kernel params)."""
    return float(getattr(gpu, name) if name in GPU_PARAM_NAMES else getattr(base, name))


# Residual scales: 1 unit of residual = 1% time-ratio error, 2% power error, 10% absolute-time error.
_W_RATIO, _W_POWER, _W_ABS = 0.01, 0.02, 0.10


def _residuals(km: KernelModel, series: Sequence[Series], fit_abs: bool) -> np.ndarray:
    out = []
    for s, (t, e) in zip(series, _predict_all(km, series)):
        ratio_pred = t / t[0]
        ratio_meas = s.time_s / s.time_s[0]
        out.append((ratio_pred / ratio_meas - 1.0) / _W_RATIO)
        out.append(((e / t) / (s.energy_j / s.time_s) - 1.0) / _W_POWER)
        if fit_abs:
            out.append(np.atleast_1d(np.log(t[0] / s.time_s[0]) / _W_ABS))
    return np.concatenate(out)


def series_metrics(km: KernelModel, series: Sequence[Series]) -> dict[str, Any]:
    """Per-column errors: time-ratio, power, energy-ratio and absolute-time MAPE (%), argmin-clock error (MHz)."""
    tr, pw, er, ab, arg = [], [], [], [], []
    for s, (t, e) in zip(series, _predict_all(km, series)):
        tr.append(np.abs((t / t[0]) / (s.time_s / s.time_s[0]) - 1))
        pw.append(np.abs((e / t) / (s.energy_j / s.time_s) - 1))
        er.append(np.abs((e / e[0]) / (s.energy_j / s.energy_j[0]) - 1))
        ab.append(np.abs(t / s.time_s - 1))
        arg.append(abs(float(s.clocks_mhz[np.argmin(e)]) - float(s.clocks_mhz[np.argmin(s.energy_j)])))
    cat = np.concatenate
    return {
        "series": len(series),
        "points": int(sum(len(s.clocks_mhz) for s in series)),
        "time_ratio_mape_pct": float(100 * cat(tr).mean()),
        "power_mape_pct": float(100 * cat(pw).mean()),
        "energy_ratio_mape_pct": float(100 * cat(er).mean()),
        "time_abs_mape_pct": float(100 * cat(ab).mean()),
        "argmin_clock_err_max_mhz": float(max(arg)),
        "argmin_clock_err_mean_mhz": float(np.mean(arg)),
    }


def fit_series(
    series: Sequence[Series],
    gpu: GPUSpec,
    free: Sequence[FreeParam] | None = None,
    *,
    base: KernelParams | None = None,
    fit_abs_time: bool = True,
    prior_weight: float = 1.0,
    max_nfev: int = 400,
) -> tuple[GPUSpec, KernelParams, dict[str, float]]:
    """Least-squares fit of the free parameters; returns (fitted GPU, fitted kernel params, values).

    max_nfev bounds the model evaluations (each one predicts every series once).
    """
    if not series:
        raise CalibrationError("nothing to fit: the measurements hold no series.")
    for s in series:
        for what, v in (("time", s.time_s), ("energy", s.energy_j)):
            v = np.asarray(v, dtype=float)
            if not np.all(np.isfinite(v) & (v > 0)):
                raise CalibrationError(
                    f"series {s.label!r} has a non-positive or non-finite {what}; measurements must be > 0 (s, J)."
                )
    base = base or KernelParams()
    free = tuple(free or default_free_params(gpu))
    names = [p.name for p in free]
    lo = np.array([p.lo for p in free])
    hi = np.array([p.hi for p in free])
    x0 = np.clip([param_value(gpu, base, n) for n in names], lo, hi)
    prior = x0.copy()
    sig = np.array([p.sigma for p in free])
    span = hi - lo

    def fun(u: np.ndarray) -> np.ndarray:
        x = lo + u * span
        km = apply_params(gpu, base, names, x)
        r = _residuals(km, series, fit_abs_time)
        return np.concatenate([r, prior_weight * (x - prior) / sig])

    u0 = (x0 - lo) / span
    res = least_squares(fun, u0, bounds=(0.0, 1.0), method="trf", x_scale=1.0, diff_step=1e-4, max_nfev=max_nfev)
    if not np.all(np.isfinite(res.x)):
        raise CalibrationError("the fit diverged (non-finite parameters); check the profile's units (s, J, MHz).")
    x = lo + res.x * span
    km = apply_params(gpu, base, names, x)
    return km.gpu, km.params, {n: float(v) for n, v in zip(names, x)}


def blocked_power_series(gpu: GPUSpec) -> Series:
    """Anchor: a GPU with no kernel running at the max clock draws the preset's p_blocked_w (W)."""
    f = np.array([float(gpu.max_sm_clock_mhz)])
    one = np.ones(1)
    return Series("blocked", f, one, one * gpu.p_blocked_w, lambda km: (one, km.power_w(f, 0.0, 0.0) * one))


def profile_series(profile: StageProfile, model: ModelSpec, par: ParallelConfig) -> list[Series]:
    """One Series per (stage, instruction) of a Perseus profile, predicted with instruction_cost."""
    out = []
    for stage, instr in profile.series():
        if stage >= par.pp:
            raise CalibrationError(
                f"profile has stage {stage} but the parallel layout has --pp {par.pp}; give the profiled --pp."
            )
        f, t, e = profile.select(stage, instr)

        def predict(km: KernelModel, stage: int = stage, instr: str = instr, f: np.ndarray = f):
            return km.instruction_cost(model, par, stage, instr, f)

        key = (instr, par.chunk_layers(stage), par.is_first_chunk(stage), par.is_last_chunk(stage), tuple(f))
        out.append(Series(f"stage {stage} {instr}", f.astype(float), t, e, predict, key))
    return out


def fit_calibration(
    profile: StageProfile,
    gpu: GPUSpec,
    model: ModelSpec,
    par: ParallelConfig,
    *,
    free: Sequence[FreeParam] | None = None,
    fit_abs_time: bool = True,
    prior_weight: float = 8.0,
    verbose: bool = True,
) -> Calibration:
    """Fit every free parameter to a Perseus-format profile; print the fit error per column.

    fit_abs_time=False fits only time ratios and power and keeps time_scale at 1: use it for profiles
    whose absolute times are scaled (the Perseus artifact's are, see its PROVENANCE.md).
    """
    series = profile_series(profile, model, par)
    clocks = set(int(c) for c in profile.frequency_mhz)
    bad = sorted(clocks - set(gpu.sm_clocks_mhz))
    if bad:
        raise CalibrationError(
            f"profile clock {bad[0]} MHz is not lockable on {gpu.name}; give the --gpu the profile was measured on."
        )
    before = series_metrics(KernelModel(gpu), series)
    free = tuple(free or default_free_params(gpu))
    if not fit_abs_time:
        free = tuple(p for p in free if p.name != "time_scale")
    fitted_gpu, params, values = fit_series(
        [*series, blocked_power_series(gpu)], gpu, free, fit_abs_time=fit_abs_time, prior_weight=prior_weight
    )
    km = KernelModel.from_params(fitted_gpu, params)
    after = series_metrics(km, series)
    if verbose:
        print_fit_report(before, after)
    return Calibration(
        format=FORMAT,
        gpu=gpu.name,
        params=values,
        fit={"uncalibrated": before, "calibrated": after, "absolute_time_fitted": fit_abs_time},
        source=f"stage profile {profile.source}",
        workload={
            "model": model.name,
            "tp": par.tp,
            "cp": par.cp,
            "pp": par.pp,
            "mbs": par.micro_batch_size,
            "seq": par.seq_length,
            "recompute": par.recompute,
            "layers_per_stage": list(par.layers_per_stage),
        },
    )


def print_fit_report(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Print the error per column before and after the fit (rich table)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fit error over {after['series']} series, {after['points']} points")
    table.add_column("column")
    table.add_column("presets", justify="right")
    table.add_column("calibrated", justify="right")
    rows = (
        ("time ratio t(f)/t(max) MAPE", "time_ratio_mape_pct", "%"),
        ("power E/t MAPE", "power_mape_pct", "%"),
        ("energy ratio MAPE", "energy_ratio_mape_pct", "%"),
        ("absolute time MAPE", "time_abs_mape_pct", "%"),
        ("energy-minimising clock error, max", "argmin_clock_err_max_mhz", " MHz"),
    )
    for label, key, unit in rows:
        table.add_row(label, f"{before[key]:.2f}{unit}", f"{after[key]:.2f}{unit}")
    Console(width=100).print(table)


# ---- microbenchmarks (`kareus calibrate --run`): the series and the fit; measuring lives in the CLI ----

MICROBENCH_GEMM_MNK = (8192, 8192, 8192)  # bf16 GEMM: compute-bound at every clock
MICROBENCH_COPY_BYTES = 1 << 30  # device-to-device copy of 1 GiB: memory-bound
# Clock sweep of the microbenchmarks (hardware/gpus.py clock_grid_mhz): every 60 MHz from the max clock down
# to half of it (A100: 1410 -> 750 MHz, 12 clocks). Wider than the planning grid so that the fit sees the
# voltage knee (A100 preset: 1126 MHz) with several clocks on each side; 60 MHz keeps the sweep at 12 clocks
# x 3 measurements x --seconds (about a minute at the default 1.5 s).
MICROBENCH_CLOCK_STEP_MHZ = 60
MICROBENCH_LOWEST_FRACTION = 0.5


def microbench_ops() -> dict[str, Op]:
    """The ops the microbenchmarks run: "gemm" (bf16) and "copy" (read + write of the buffer)."""
    m, n, k = MICROBENCH_GEMM_MNK
    return {
        "gemm": Op(
            name="gemm", kind="gemm", flops=2.0 * m * n * k, hbm_bytes=2.0 * (m * k + k * n + m * n), gemm_mnk=(m, n, k)
        ),
        "copy": Op(name="copy", kind="memory", hbm_bytes=2.0 * MICROBENCH_COPY_BYTES),
    }


def microbench_series(
    clocks_mhz: Sequence[float], meas: dict[str, Sequence[tuple[float, float]]], ops: dict[str, Op] | None = None
) -> list[Series]:
    """Series from measured (time s, energy J) per clock of "gemm", "copy" (per call) and "idle" (a sleep);
    `ops` the kernels that ran (default microbench_ops())."""
    fs = np.asarray(clocks_mhz, dtype=float)
    out = []
    for label, op in (ops or microbench_ops()).items():
        t, e = (np.asarray(x, dtype=float) for x in zip(*meas[label]))

        def predict(km: KernelModel, op: Op = op) -> tuple[np.ndarray, np.ndarray]:
            prof = km.op_profile([op], fs)
            return prof.time_s[0], prof.energy_j[0]

        out.append(Series(label, fs, t, e, predict))
    t_idle, e_idle = (np.asarray(x, dtype=float) for x in zip(*meas["idle"]))
    out.append(Series("idle", fs, t_idle, e_idle, lambda km: (t_idle, km.power_w(fs, 0.0, 0.0) * t_idle)))
    return out


def microbench_free_params(gpu: GPUSpec) -> tuple[FreeParam, ...]:
    """Parameters the microbenchmarks determine (wide priors: the measurements identify them)."""
    lim, fmax = gpu.power_limit_w, gpu.max_sm_clock_mhz
    return (
        FreeParam("gemm_efficiency", 0.2, 1.0, 0.3),
        FreeParam("memory_efficiency", 0.2, 1.0, 0.3),
        FreeParam("sm_load_bytes_per_cycle", 2.0, 256.0, 64.0),
        FreeParam("static_power_w", 0.02 * lim, 0.5 * lim, gpu.static_power_w),
        FreeParam("idle_dynamic_w", 0.0, 0.5 * lim, lim),
        FreeParam("compute_dynamic_w", 0.1 * lim, 2.0 * lim, lim),
        FreeParam("memory_dynamic_w", 0.0, 0.6 * lim, lim),
        FreeParam("memory_op_compute_activity", 0.0, 1.0, 0.5),
        FreeParam("voltage_floor", 0.4, 1.0, 0.3),
        FreeParam("voltage_knee_mhz", gpu.min_sm_clock_mhz, fmax - 30, fmax),
        FreeParam("power_limit_w", 0.7 * lim, 1.3 * lim, 0.1 * lim),
    )


def fit_microbenchmarks(
    gpu: GPUSpec,
    clocks_mhz: Sequence[float],
    meas: dict[str, Sequence[tuple[float, float]]],
    source: str,
    verbose: bool = True,
    ops: dict[str, Op] | None = None,
) -> Calibration:
    """Fit the microbenchmark series (absolute times too); p_blocked_w = the measured idle power (W)."""
    series = microbench_series(clocks_mhz, meas, ops)
    before = series_metrics(KernelModel(gpu), series)
    fitted_gpu, params, values = fit_series(series, gpu, microbench_free_params(gpu), prior_weight=0.3)
    after = series_metrics(KernelModel.from_params(fitted_gpu, params), series)
    if verbose:
        print_fit_report(before, after)
    idle = series[-1]
    values["p_blocked_w"] = float(np.median(idle.energy_j / idle.time_s))
    raw = {lab: [[float(f), float(t), float(e)] for f, (t, e) in zip(clocks_mhz, meas[lab])] for lab in meas}
    return Calibration(
        format=FORMAT,
        gpu=gpu.name,
        params=values,
        source=source,
        fit={"uncalibrated": before, "calibrated": after, "measurements": raw},
    )
