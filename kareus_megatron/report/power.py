"""Measured against predicted power waveform of a run: the metrics of cost/waveform.py, both ways.

*Measured*: every rank's iteration lines carry its GPU's power samples (``power``: {t0, dt_s, w, reading};
runtime/clock/power_samples.py). The samples of the iterations the summary uses are folded onto one
iteration of the run's median time (s), each rank relative to its own iteration start, on bins of the
sampling interval, and summed over the ranks: the job's waveform (W) as the GPUs drew it. *Predicted*: the
plan's own metrics (``predicted.power``), and for the plot its waveform rebuilt from the plan's instructions
(predicted time s and energy J of each, on the planner's pipeline DAG; blocked GPUs at the plan's blocked
power, or its power floor). A run whose logs hold no samples (older logs) has no ``measured`` part.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kareus_megatron.cost.waveform import power_metrics, resample_periodic
from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.power import predicted_waveform


def _samples(line: dict[str, Any], it: Any) -> tuple[np.ndarray, np.ndarray, float, str] | None:
    """(t s from the rank's iteration start, W, interval s, reading) of one rank line; ConfigError if malformed."""
    p = line.get("power")
    if p is None:
        return None

    def num(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not (
        isinstance(p, dict)
        and isinstance(p.get("w"), list)
        and all(num(x) and x >= 0 for x in p["w"])
        and num(p.get("t0"))
        and num(p.get("dt_s"))
        and p["dt_s"] > 0
    ):
        raise ConfigError(
            f"iteration {it}, rank {line.get('rank')}: 'power' must be {{t0, dt_s > 0, w: [W >= 0]}}; "
            "is this a kareus run log (--kareus-log)?"
        )
    w, t0, dt, t_start = p["w"], float(p["t0"]), float(p["dt_s"]), line.get("t_start", math.nan)
    if not w or not num(t_start):
        return None
    t = t0 + (np.arange(len(w)) + 0.5) * dt - float(t_start)
    return t, np.asarray(w, float), float(dt), str(p.get("reading", "?"))


def measured_power(records: Any, period_s: float) -> tuple[dict[str, Any], np.ndarray, float] | None:
    """(metrics and sampling facts, job waveform W per bin, bin s) over `records` (merged iterations with
    ``ranks``), folded on `period_s` (s); None when no rank logged samples."""
    per_rank: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    dts, readings, count = [], set(), 0
    for rec in records:
        for line in rec.get("ranks", []):
            got = _samples(line, rec.get("iteration"))
            if got is None:
                continue
            t, w, dt, reading = got
            per_rank.setdefault(int(line.get("rank", 0)), []).append((t, w))
            dts.append(dt)
            readings.add(reading)
            count += len(w)
    if not per_rank or not (period_s > 0):
        return None
    dt = float(np.median(dts))
    bins = max(2, int(period_s / dt))
    job = np.zeros(bins)
    for chunks in per_rank.values():
        job += resample_periodic(
            np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]), period_s, bins
        )
    m: dict[str, Any] = dict(power_metrics(job, period_s / bins).as_dict())
    m.update(sample_hz=1.0 / dt, samples=count, gpus=len(per_rank), reading=",".join(sorted(readings)))
    return m, job, period_s / bins


def power_section(
    summary: Any, plan: Any, time_scale: float = 1.0
) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The report's ``power`` object ({"measured": {...}, "predicted": {...}}, a part absent when unknown) and
    the curves to plot (label -> (t s, W)). `time_scale`: a simulated truth's (report/against_plan.py); the
    predicted waveform is stretched by it (same powers, its ramps and band taken on the stretched time)."""
    out: dict[str, Any] = {}
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    meas = measured_power(summary.records, float(summary.time_s)) if summary.used else None
    if meas is not None:
        out["measured"], job, step = meas
        curves["measured"] = ((np.arange(job.size) + 0.5) * step, job)
    wave = predicted_waveform(plan)
    if wave is not None and time_scale != 1.0:
        wave = (wave[0], wave[1] * time_scale)
        out["predicted"] = power_metrics(*wave).as_dict()
    elif plan.predicted.power is not None:
        out["predicted"] = plan.predicted.power.model_dump()
    elif wave is not None:
        out["predicted"] = power_metrics(*wave).as_dict()
    if wave is not None:
        curves[f"{plan.method} (predicted)"] = ((np.arange(wave[0].size) + 0.5) * wave[1], wave[0])
    return out, curves
