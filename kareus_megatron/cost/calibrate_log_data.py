"""The run-log fit's data, indexed once, and the model's prediction of it (cost/calibrate_log.py's module doc).

A *LogRun* is one run's instruction samples and energy windows with the workload its plan was made for;
``prepare`` groups them (median time per (workload, stage, chunk, kind, clock), clock-ratio pairs, a busy-time
matrix per window) and ``residuals`` / ``column_errors`` compare a KernelModel with them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.errors import CalibrationError
from kareus_megatron.hardware.gpus import GPUSpec
from kareus_megatron.workload.models import ModelSpec
from kareus_megatron.workload.parallel import ParallelConfig

NOISE = {"time": 0.01, "ratio": 0.01, "energy": 0.01}  # nominal measurement error of each column (fraction)
KINDS = ("forward", "backward")


@dataclass(frozen=True)
class LogRun:
    """One run's measurements (report/measurements.py samples and windows) and the workload of its plan."""

    label: str
    model: ModelSpec
    par: ParallelConfig
    samples: Sequence[Any]  # .pp_rank .chunk .kind .sm_clock_mhz (MHz) .time_s (s)
    windows: Sequence[Any]  # .pp_rank .time_s (s) .energy_j (J) .busy_s {(chunk, kind, MHz): s}


@dataclass
class _Batch:
    """Every instruction of one workload as one op_profile call: the union of their ops at the union of clocks.

    Equal to KernelModel.instruction_cost per instruction (op_profile treats every element on its own), in one
    vectorised call: weights (n_instructions, n_ops) are the layer counts of layer ops and 1 for stage ops.
    """

    ops: tuple[Any, ...]
    precision: str
    clocks_mhz: np.ndarray
    weights: np.ndarray
    rows: np.ndarray  # instruction of each flat point of this batch
    cols: np.ndarray  # clock index of each flat point


def _batch(
    km: KernelModel, model: ModelSpec, par: ParallelConfig, instrs: list[tuple[int, str, int, list[int]]]
) -> _Batch:
    """The batch of instructions (stage, kind, chunk, clocks MHz) of one workload."""
    index: dict[Any, int] = {}
    ops: list[Any] = []
    rows_w: list[dict[int, float]] = []
    for stage, kind, chunk, _ in instrs:
        layer, extra, n_layers = km.instruction_ops(model, par, stage, kind, chunk)
        w: dict[int, float] = {}
        for op, weight in [(op, float(n_layers)) for op in layer] + [(op, 1.0) for op in extra]:
            j = index.setdefault(op, len(ops))
            if j == len(ops):
                ops.append(op)
            w[j] = w.get(j, 0.0) + weight
        rows_w.append(w)
    weights = np.zeros((len(instrs), len(ops)))
    for i, w in enumerate(rows_w):
        for j, v in w.items():
            weights[i, j] = v
    clocks = sorted({f for *_, fs in instrs for f in fs})
    col = {f: j for j, f in enumerate(clocks)}
    rows = np.array([i for i, (*_, fs) in enumerate(instrs) for _ in fs])
    cols = np.array([col[f] for *_, fs in instrs for f in fs])
    return _Batch(tuple(ops), par.precision, np.array(clocks, dtype=float), weights, rows, cols)


@dataclass
class FitData:
    """Everything the residuals need, as arrays over the flattened (compute key, clock) points."""

    batches: list[_Batch]  # one per workload; their points, in order, are the flat (instruction, clock) points
    time_point: np.ndarray  # flat point of each time group
    time_meas: np.ndarray  # median measured time (s) of each group
    time_label: list[str]
    ratio_pair: np.ndarray  # (n, 2) time-group indices (f, f_ref)
    busy: np.ndarray  # (n_windows, n_points) busy time (s)
    idle_s: np.ndarray
    energy_meas: np.ndarray
    energy_weight: np.ndarray


def _clock_key(mhz: Any) -> int:
    return int(round(float(mhz)))


def _usable(windows: Sequence[Any]) -> list[Any]:
    """The windows whose stage and every clock are known."""
    return [w for w in windows if w.pp_rank is not None and all(k[2] is not None for k in w.busy_s)]


def prepare(runs: Sequence[LogRun], gpu: GPUSpec) -> FitData:
    workloads: dict[tuple[ModelSpec, ParallelConfig], int] = {}
    compute: dict[tuple, set[int]] = {}  # compute key -> clocks (MHz)
    instr_key: dict[tuple, tuple] = {}  # (workload, stage, chunk, kind) -> compute key
    times: dict[tuple, list[float]] = {}  # (instr, clock) -> measured times (s)
    lo, hi = gpu.min_sm_clock_mhz, gpu.max_sm_clock_mhz

    def key_of(w: int, run: LogRun, stage: Any, chunk: Any, kind: Any, mhz: Any, what: str) -> tuple[tuple, int]:
        par = run.par
        if not (isinstance(stage, int) and 0 <= stage < par.pp):
            raise CalibrationError(
                f"{run.label}: {what} has pp_rank {stage!r} outside the plan's {par.pp} stages; "
                "give the --plan the run executed."
            )
        if not (isinstance(chunk, int) and 0 <= chunk < par.vp) or kind not in KINDS:
            raise CalibrationError(
                f"{run.label}: {what} has chunk {chunk!r} / kind {kind!r}; the plan has chunks "
                f"0..{par.vp - 1} of kinds {', '.join(KINDS)}. Give the --plan the run executed."
            )
        f = _clock_key(mhz)
        if not lo <= f <= hi:
            raise CalibrationError(
                f"{run.label}: {what} ran at {f} MHz, outside {gpu.name}'s {lo}..{hi} MHz; "
                "give the --plan (and GPU) the run used."
            )
        ik = (w, stage, chunk, kind)
        if ik not in instr_key:
            instr_key[ik] = (
                w,
                kind,
                par.chunk_layers(stage, chunk),
                par.is_first_chunk(stage, chunk),
                par.is_last_chunk(stage, chunk),
                stage,
                chunk,
            )
            compute.setdefault(instr_key[ik][:5], set())
        compute[instr_key[ik][:5]].add(f)
        return ik, f

    for run in runs:
        w = workloads.setdefault((run.model, run.par), len(workloads))
        for s in run.samples:
            if s.pp_rank is None or s.sm_clock_mhz is None:
                continue  # a rank that never said its stage, a clock the log does not know: nothing to model
            t = float(s.time_s)
            if not (math.isfinite(t) and t > 0):
                raise CalibrationError(
                    f"{run.label}: an instruction sample has time {s.time_s!r}; times must be > 0 s."
                )
            ik, f = key_of(w, run, s.pp_rank, s.chunk, s.kind, s.sm_clock_mhz, "an instruction sample")
            times.setdefault((ik, f), []).append(t)
        for win in _usable(run.windows):  # register the windows' clocks too (a clock only the windows saw)
            for chunk, kind, mhz in win.busy_s:
                key_of(w, run, win.pp_rank, chunk, kind, mhz, "an energy window")
    if not times:
        raise CalibrationError(
            "the run log(s) hold no instruction samples; run with a current kareus runtime "
            "(KAREUS_LOG_INSTRUCTIONS not 0)."
        )
    # compute calls: one per compute key (stages with the same layers and ends share one), over its clocks
    ckeys = sorted(compute)
    models = {w: mp for mp, w in workloads.items()}
    first_instr: dict[tuple, tuple] = {}
    for ck in instr_key.values():
        first_instr.setdefault(ck[:5], ck)
    point: dict[tuple, int] = {}
    per_workload: dict[int, list[tuple[int, str, int, list[int]]]] = {}
    n = 0
    for ck in ckeys:  # sorted by workload first: each batch's points are contiguous
        clocks = sorted(compute[ck])
        w, kind, *_rest, stage, chunk = first_instr[ck]
        per_workload.setdefault(w, []).append((stage, kind, chunk, clocks))
        for j, f in enumerate(clocks):
            point[(ck, f)] = n + j
        n += len(clocks)
    km0 = KernelModel(gpu)
    batches = [_batch(km0, *models[w], instrs) for w, instrs in sorted(per_workload.items())]
    groups = sorted(times)
    gindex = {g: i for i, g in enumerate(groups)}
    time_point = np.array([point[(instr_key[ik][:5], f)] for ik, f in groups])
    time_meas = np.array([statistics.median(times[g]) for g in groups])
    labels = [f"stage {ik[1]} chunk {ik[2]} {ik[3]} @ {f} MHz" for ik, f in groups]
    pairs = []
    by_instr: dict[tuple, list[int]] = {}
    for ik, f in groups:
        by_instr.setdefault(ik, []).append(f)
    for ik, fs in by_instr.items():
        ref = max(fs)
        pairs += [(gindex[(ik, f)], gindex[(ik, ref)]) for f in fs if f != ref]
    if not pairs:
        seen = sorted({f for fs in by_instr.values() for f in fs})
        raise CalibrationError(
            f"too few SM clocks to fit time ratios: every instruction ran at one clock "
            f"({', '.join(map(str, seen))} MHz); the fit needs each instruction at 2 or more "
            "clocks (profile at several clocks, or add a run at other clocks)."
        )
    rows, idle, emeas, wtime = [], [], [], []
    for run in runs:
        wl = workloads[(run.model, run.par)]
        for win in _usable(run.windows):
            e, t = float(win.energy_j), float(win.time_s)
            if not (math.isfinite(e) and e > 0 and math.isfinite(t) and t > 0):
                raise CalibrationError(
                    f"{run.label}: an energy window has time {win.time_s!r} s, energy "
                    f"{win.energy_j!r} J; both must be > 0."
                )
            row: dict[int, float] = {}
            for (chunk, kind, mhz), b in win.busy_s.items():
                ik, f = key_of(wl, run, win.pp_rank, chunk, kind, mhz, "an energy window")
                j = point[(instr_key[ik][:5], f)]
                row[j] = row.get(j, 0.0) + float(b)
            rows.append(row)
            busy = sum(row.values())
            idle.append(max(t - busy, 0.0))
            emeas.append(e)
            wtime.append(t)
    if not rows:
        raise CalibrationError(
            "the run log(s) hold no energy windows; run longer (each window spans >= the "
            "shortest window, after the warm-up iterations)."
        )
    busy_m = np.zeros((len(rows), n))
    for i, row in enumerate(rows):
        for j, b in row.items():
            busy_m[i, j] = b
    wt = np.array(wtime)
    return FitData(
        batches,
        time_point,
        time_meas,
        labels,
        np.array(pairs),
        busy_m,
        np.array(idle),
        np.array(emeas),
        np.sqrt(wt / np.median(wt)),
    )


def _predict(km: KernelModel, d: FitData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time per group s, ratio per pair, energy per window J) of the model `km`."""
    ts, ps = [], []
    for b in d.batches:
        prof = km.op_profile(b.ops, b.clocks_mhz, precision=b.precision)
        t = (b.weights @ prof.time_s)[b.rows, b.cols]
        ts.append(t)
        ps.append((b.weights @ prof.energy_j)[b.rows, b.cols] / t)
    t_flat, p_flat = np.concatenate(ts), np.concatenate(ps)
    t_g = t_flat[d.time_point]
    ratio = t_g[d.ratio_pair[:, 0]] / t_g[d.ratio_pair[:, 1]]
    energy = d.busy @ p_flat + km.p_blocked_w * d.idle_s
    return t_g, ratio, energy


def log_errors(km: KernelModel, d: FitData) -> dict[str, np.ndarray]:
    """log(measured / predicted) per column."""
    t, ratio, energy = _predict(km, d)
    meas_ratio = d.time_meas[d.ratio_pair[:, 0]] / d.time_meas[d.ratio_pair[:, 1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        return {
            "time": np.log(d.time_meas / t),
            "ratio": np.log(meas_ratio / ratio),
            "energy": np.log(d.energy_meas / energy),
        }


def residuals(km: KernelModel, d: FitData) -> np.ndarray:
    err = log_errors(km, d)
    r = np.concatenate(
        [err["time"] / NOISE["time"], err["ratio"] / NOISE["ratio"], err["energy"] * d.energy_weight / NOISE["energy"]]
    )
    return np.where(np.isfinite(r), r, 1e6)


def column_errors(km: KernelModel, d: FitData) -> dict[str, dict[str, float]]:
    """RMS and max error (%) of the time, ratio and energy columns, and their point counts."""
    out = {}
    for col, e in log_errors(km, d).items():
        pct = 100.0 * np.abs(np.expm1(e))
        out[col] = {
            "rms_pct": float(np.sqrt(np.mean(pct**2))),
            "max_pct": float(pct.max()) if pct.size else 0.0,
            "points": int(pct.size),
        }
    return out
