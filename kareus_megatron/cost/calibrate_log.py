"""Fit the kernel model's time and power parameters to a training run's own measurements (``--from-log``).

Data (report/measurements.py reads them from a run log): *instruction samples*, the measured time (s) of one
forward/backward instruction of one rank at the SM clock (MHz) it ran at, and *energy windows*, one rank's
GPU energy (J) over consecutive iterations lasting about a second or more (NVML's counter updates about every
100 ms; it is never read per instruction), with the busy time (s) of each (chunk, kind, clock) inside.

Model of the data, for candidate parameters θ, through KernelModel.instruction_cost of the plan's workload:

- *time*: per (workload, pp_rank, chunk, kind, clock) the median measured time t̂(f) against the modelled
  t_θ(f) (time_scale included): residual log(t̂/t_θ), the absolute level.
- *ratio*: per instruction, t̂(f)/t̂(f_ref) against t_θ(f)/t_θ(f_ref), f_ref the highest clock it ran at:
  residual the log of their quotient, the clock sensitivity, free of the absolute level.
- *energy*: per window, Ê against E_θ = Σ busy_s(c, k, f) · P_θ(c, k, f) + p_blocked_w · (time_s − Σ busy_s),
  where P_θ = E_θ(f)/t_θ(f) is the instruction's modelled average power (W): measured busy time times
  modelled power, so the power parameters are not confounded with time errors. Residual log(Ê/E_θ),
  weighted by sqrt(time_s / median window time) so that long windows count more.

Residuals are divided by their column's nominal measurement error (NOISE, dimensionless); every free parameter
adds a prior row (x − prior)/sigma: cost/calibrate.py's FreeParam, a weak Gaussian prior at the preset or
default value (or at a given calibration's). Fitted with scipy's least_squares inside the bounds. The board limit
(power_limit_w) is free too: where it binds at the top profile clocks (power flat, times that stop shrinking) the
data pin it; where it never binds it stays at the preset's value.

Identifiability: at the solution, the Gauss–Newton posterior covariance (JᵀJ)⁻¹ (J includes the prior rows),
scaled by the data's reduced χ² where that exceeds 1. A parameter is *identified* when its posterior sd is
below IDENTIFIED_SD_FRACTION (1/3) of its prior sd and at most IDENTIFIED_REL_SD (5%) of its value. The others
go back to their prior and are marked not identified ("prior"), then the rest is fitted again, except that a
reset the data rejects (the refit's Σ residual² rises by more than its 95% χ² quantile: the data sees the
parameter, jointly with others, and the prior value is wrong) is undone for the best-informed parameter first,
until the rise is within the quantile: those stay fitted and are marked "constrained" (identified: partly).
Without that, resetting a parameter the data half-sees (e.g. static power, correlated with the voltage curve)
would make a correlated identified one compensate and the predictions drift. The marginal sd is honest about
degeneracies: time_scale and the efficiencies scale times together, so time_scale is pinned only as well as the
efficiencies' priors are; a run with instructions of several shapes (compute- and memory-bound) separates them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from kareus_megatron.cost.calibrate import FreeParam, apply_params, default_free_params, param_value
from kareus_megatron.cost.calibrate_log_data import FitData, LogRun, column_errors, log_errors, prepare, residuals
from kareus_megatron.cost.calibration import FORMAT, Calibration
from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.params import KernelParams
from kareus_megatron.errors import CalibrationError
from kareus_megatron.hardware.gpus import GPUSpec

__all__ = ["LogRun", "fit_from_logs", "log_free_params", "print_log_fit_report"]

IDENTIFIED_SD_FRACTION = 1.0 / 3.0  # posterior sd / prior sd below which a parameter counts as identified
IDENTIFIED_REL_SD = 0.05  # ... and posterior sd / value at most this: identified means pinned within 5%
TIME_PARAMS = (
    "gemm_efficiency",
    "memory_efficiency",
    "attention_efficiency",
    "attention_bwd_efficiency",
    "launch_overhead_s",
    "sm_load_bytes_per_cycle",
    "nvlink_efficiency",
    "time_scale",
)
POWER_PARAMS = (
    "static_power_w",
    "idle_dynamic_w",
    "compute_dynamic_w",
    "memory_dynamic_w",
    "voltage_floor",
    "voltage_knee_mhz",
    "comm_compute_activity",
    "p_blocked_w",
    "power_limit_w",
)


def log_free_params(gpu: GPUSpec) -> tuple[FreeParam, ...]:
    """The parameters a run-log fit frees (time, then power), with bounds and weak priors.

    time_scale gets a flat prior and wide bounds: a CPU run's wall times are not a GPU's (the simulated GPU
    only stretches them by the truth's clock ratio). p_blocked_w: the preset's blocked power ± 50%.
    """
    known = {p.name: p for p in default_free_params(gpu)}
    known["time_scale"] = FreeParam("time_scale", 1e-3, 1e4, 1e3)
    known["p_blocked_w"] = FreeParam(
        "p_blocked_w", 0.02 * gpu.power_limit_w, 0.6 * gpu.power_limit_w, 0.5 * gpu.p_blocked_w
    )
    return tuple(known[n] for n in (*TIME_PARAMS, *POWER_PARAMS))


def _central_jacobian(fun: Any, u: np.ndarray, lo: np.ndarray, hi: np.ndarray, h: float = 1e-3) -> np.ndarray:
    """Jacobian of fun at u by central differences (one-sided at a bound), for the posterior covariance."""
    cols = []
    for i in range(len(u)):
        a, b = u.copy(), u.copy()
        a[i] = max(u[i] - h, lo[i])
        b[i] = min(u[i] + h, hi[i])
        cols.append((fun(b) - fun(a)) / (b[i] - a[i]))
    return np.stack(cols, axis=1)


def _solve(
    d: FitData,
    gpu: GPUSpec,
    base: KernelParams,
    free: Sequence[FreeParam],
    prior: np.ndarray,
    x0: np.ndarray,
    jacobian: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """Least squares in scaled coordinates: (x, posterior sd of x, posterior covariance of x (unscaled), the
    reduced-χ² inflation of the covariance, Σ residual² at x); without `jacobian` only x and Σ residual²."""
    names = [p.name for p in free]
    lo = np.array([p.lo for p in free])
    hi = np.array([p.hi for p in free])
    sig = np.array([p.sigma for p in free])
    x0 = np.clip(x0, lo, hi)
    scale = np.minimum(sig, 0.25 * (hi - lo))
    scale = np.where(np.array(names) == "time_scale", 0.1 * x0, scale)

    def fun(u: np.ndarray) -> np.ndarray:
        x = x0 + u * scale
        r = residuals(apply_params(gpu, base, names, x), d)
        return np.concatenate([r, (x - prior) / sig])

    res = least_squares(
        fun,
        np.zeros(len(free)),
        bounds=((lo - x0) / scale, (hi - x0) / scale),
        method="trf",
        x_scale=1.0,
        diff_step=1e-4,
        max_nfev=200,
    )
    if not np.all(np.isfinite(res.x)):
        raise CalibrationError("the fit diverged (non-finite parameters); check the run log's units (s, J, MHz).")
    x = x0 + res.x * scale
    if not jacobian:
        return x, x * np.nan, np.empty((0, 0)), 1.0, 2.0 * float(res.cost)
    n_data = len(res.fun) - len(free)
    r_data = res.fun[:n_data]
    chi2 = float(r_data @ r_data) / max(n_data - len(free), 1)
    jac = _central_jacobian(fun, res.x, (lo - x0) / scale, (hi - x0) / scale)
    cov_x = np.linalg.pinv(jac.T @ jac) * np.outer(scale, scale)
    inflate = max(chi2, 1.0)
    return x, np.sqrt(np.clip(np.diag(cov_x), 0.0, None) * inflate), cov_x, inflate, 2.0 * float(res.cost)


def _correlation(cov: np.ndarray) -> np.ndarray:
    """Correlation matrix of a covariance (a parameter with zero variance: uncorrelated)."""
    sd = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    safe = np.where(sd > 0, sd, 1.0)
    corr = np.clip(cov / np.outer(safe, safe), -1.0, 1.0)
    np.fill_diagonal(corr, 1.0)
    return corr


def _chi2_95(k: int) -> float:
    """95% quantile of the chi-square distribution with k degrees of freedom (Wilson–Hilferty)."""
    a = 2.0 / (9.0 * k)
    return k * (1.0 - a + 1.645 * math.sqrt(a)) ** 3


def _resettable(
    x: np.ndarray, prior: np.ndarray, cov: np.ndarray, inflate: float, ratio: np.ndarray, candidates: np.ndarray
) -> np.ndarray:
    """Which unidentified parameters go back to their prior: the largest set, best-informed dropped first, whose
    reset the data accepts (the fit's χ² rise, from the posterior covariance, within its 95% quantile)."""
    keep = [int(i) for i in np.argsort(-ratio) if candidates[i]]  # least informed first
    while keep:
        idx = np.array(keep)
        d = (prior - x)[idx]
        if float(d @ np.linalg.pinv(cov[np.ix_(idx, idx)]) @ d) <= inflate * _chi2_95(len(keep)):
            break
        keep.pop()  # the data rejects this parameter's prior value: it stays fitted ("constrained")
    mask = np.zeros(len(x), dtype=bool)
    mask[keep] = True
    return mask


def fit_from_logs(
    runs: Sequence[LogRun],
    gpu: GPUSpec,
    *,
    prior: Calibration | None = None,
    free: Sequence[FreeParam] | None = None,
    source: str = "",
) -> Calibration:
    """Fit the free parameters to the runs' samples and windows (module doc); the calibration with its report.

    `gpu`: the preset every run's plan names; `prior`: a calibration whose values are the priors (default: the
    preset and cost/params.py's defaults).
    """
    t0 = time.perf_counter()
    if not runs:
        raise CalibrationError("nothing to fit: give at least one run log.")
    gpu_p = prior.apply_to(gpu) if prior else gpu
    base = KernelParams(**prior.kernel_params) if prior else KernelParams()
    free = tuple(free or log_free_params(gpu))
    d = prepare(runs, gpu)
    km0 = KernelModel.from_params(gpu_p, base)
    names = [p.name for p in free]
    prior_x = np.array([param_value(gpu_p, base, n) for n in names])
    x0 = prior_x.copy()
    if "time_scale" in names:  # start at the measured level: the flat prior leaves it to the data
        i = names.index("time_scale")
        level = float(np.exp(np.median(log_errors(km0, d)["time"])))
        x0[i] = float(np.clip(prior_x[i] * level, free[i].lo, free[i].hi))
    x, sd, cov, inflate, cost = _solve(d, gpu_p, base, free, prior_x, x0)
    sig = np.array([p.sigma for p in free])
    ratio = sd / sig
    ident = (ratio < IDENTIFIED_SD_FRACTION) & (sd <= IDENTIFIED_REL_SD * np.abs(x))
    reset = _resettable(x, prior_x, cov, inflate, ratio, ~ident)
    while True:  # the reset must leave the fit as good within the χ² quantile; else free the best-informed one
        values = prior_x.copy()
        fitted = ~reset
        rise = 0.0
        if fitted.any():
            keep = [p for p, ok in zip(free, fitted) if ok]
            xf, *_, cost_f = _solve(d, gpu_p, base, keep, prior_x[fitted], x[fitted], jacobian=False)
            values[fitted] = xf
            rise = cost_f - cost
        if not reset.any() or rise <= inflate * _chi2_95(int(reset.sum())):
            break
        reset[np.flatnonzero(reset)[np.argmin(ratio[reset])]] = False
    km = apply_params(gpu_p, base, names, values)
    before, after = column_errors(km0, d), column_errors(km, d)
    params = {**(prior.params if prior else {}), **{n: float(v) for n, v in zip(names, values)}}
    fit = {
        "method": "run log",
        "identified_sd_fraction": IDENTIFIED_SD_FRACTION,
        "parameters": {
            n: {
                "value": float(v),
                "prior": float(p),
                "prior_sd": float(s),
                "sd": float(e),
                "identified": bool(ok),
                "status": "identified" if ok else "prior" if r else "constrained",
            }
            for n, v, p, s, e, ok, r in zip(names, values, prior_x, sig, sd, ident, reset)
        },
        # the posterior's correlations (cost/uncertainty.py draws the prediction bands with them)
        "correlation": {"names": names, "matrix": _correlation(cov).tolist()},
        "columns": {col: {"before": before[col], "after": after[col]} for col in before},
        "runs": [r.label for r in runs],
        "samples": int(sum(len(r.samples) for r in runs)),
        "windows": int(d.busy.shape[0]),
        "fit_time_s": time.perf_counter() - t0,
    }
    first = runs[0]
    return Calibration(
        format=FORMAT,
        gpu=gpu.name,
        params=params,
        fit=fit,
        source=source or f"run log {', '.join(r.label for r in runs)}",
        workload={
            "model": first.model.name,
            "tp": first.par.tp,
            "cp": first.par.cp,
            "pp": first.par.pp,
            "mbs": first.par.micro_batch_size,
            "seq": first.par.seq_length,
            "layers_per_stage": list(first.par.layers_per_stage),
        },
    )


def print_log_fit_report(fit: dict[str, Any]) -> None:
    """Print the per-parameter table and the error per column before/after (rich tables)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    table = Table(
        title=f"parameters ({fit['samples']} instruction samples, {fit['windows']} energy windows; "
        f"identified: posterior sd < {fit['identified_sd_fraction']:.2f} × prior sd)"
    )
    for col in ("parameter", "value", "prior", "prior sd", "sd", "identified"):
        table.add_column(col, justify="left" if col == "parameter" else "right")
    for name, p in fit["parameters"].items():
        table.add_row(
            name,
            f"{p['value']:.5g}",
            f"{p['prior']:.5g}",
            f"{p['prior_sd']:.3g}",
            f"{p['sd']:.3g}",
            {"identified": "yes", "constrained": "partly"}.get(p["status"], "no"),
        )
    console.print(table)
    err = Table(title=f"fit error per column (fit took {fit['fit_time_s']:.1f} s)")
    for col in ("column", "points", "presets RMS", "presets max", "calibrated RMS", "calibrated max"):
        err.add_column(col, justify="left" if col == "column" else "right")
    labels = {"time": "instruction time", "ratio": "time ratio t(f)/t(f_ref)", "energy": "window energy"}
    for col, c in fit["columns"].items():
        b, a = c["before"], c["after"]
        err.add_row(
            labels.get(col, col),
            str(a["points"]),
            f"{b['rms_pct']:.2f}%",
            f"{b['max_pct']:.2f}%",
            f"{a['rms_pct']:.2f}%",
            f"{a['max_pct']:.2f}%",
        )
    console.print(err)
