"""The closed loop on truths built from measurements (issue 24, item 6): does `--kareus-plan auto` learn them?

Truths (CASES): the calibration `kareus calibrate --profile --ratios-only` fits to a measured Perseus SOSP '24 stage
profile (benchmarks/data/perseus_sosp24/, PROVENANCE.md; the TP=8, PP=8 layout of benchmarks/fidelity.py) on a GPU
preset: the A40's GPT-3 and BLOOM profiles on `a40` (presets only: power 18-23% low, the 300 W limit the profiles
sit at never reached, energy-minimising clocks 210-285 MHz off; docs/fidelity.md) and the A100's GPT-3 profile on
`a100-sxm4-40gb` (measured power × 0.73 from 1410 to 1200 MHz, where the preset, held at its 400 W limit, gives
× 0.88). Workload: closed_loop.py's llama3.2-3b, TP=1, PP=2, MBS 1, seq 2048, 4 microbatches, full recompute, on
that GPU; `kareus plan`'s memory check passes on the 40 GB A100 and so on the 48 GB A40. Per case, the closed
loop's default profile (closed_loop.fit_profile: 2 warm-up iterations + 5 clocks × 3, 1% noise, exact energy
windows >= 0.05 s) is written as synthetic run logs under the truth and fitted with fit_from_logs from the preset;
printed:

1. per parameter: preset, truth and fitted value and the fit's status (identified / constrained / prior; "not
   free": a truth parameter the log fit does not free);
2. the max-clock plan's instructions (each stage's forward and backward) at every supported clock: power (E/t, W)
   and time of the preset and of the fit against the truth, max and mean |error|; at some clocks the mean power
   and the share of busy time held at the board limit (ops at a sustained clock below the locked one), and the
   lowest clock at which the limit holds at least half the busy time;
3. the energy-minimising clock of each instruction over the supported clocks: max and mean error (MHz);
4. iso-time plans made with the truth, the fit (the auto plan) and the preset, as auto_worker.py plans them
   (closed_loop.plan_iso_time: bounded at the max-clock plan's time × (1 + ISO_REL_TOL)), each evaluated under the
   truth: energy and time against the max-clock plan, and the auto and preset plans against the truth's. At two
   clock latencies: 0 (changes at once) and the preset's (15 ms, what the loop plans with). Where a model has no
   plan within ISO_REL_TOL of its max-clock time the loop stays at the max-clock plan (`objective-unmet`), and that
   plan is what is evaluated.

The truths are stored in TRUTHS (`--write-truths` rewrites them); a full run fits every one afresh from its profile
and prints how far the stored file is. ``--quick``: the A40 GPT-3 case only, its stored truth, latency 0 only
(seconds; tests/cost/test_closed_loop_measured.py). ``--json FILE`` writes every figure.

Run: .venv/bin/python benchmarks/closed_loop_measured.py [--quick] [--json FILE] [--write-truths]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from closed_loop import ROOT, Job, _kareus, fit_profile, job_flags, make_job, plan_iso_time  # noqa: E402

from kareus_megatron.cost.calibrate import param_value  # noqa: E402
from kareus_megatron.cost.calibrate_log import POWER_PARAMS, TIME_PARAMS  # noqa: E402
from kareus_megatron.cost.calibration import Calibration, load_calibration, save_calibration  # noqa: E402
from kareus_megatron.cost.kernel import KernelModel  # noqa: E402
from kareus_megatron.cost.params import KernelParams  # noqa: E402
from kareus_megatron.hardware.gpus import gpu_spec  # noqa: E402
from kareus_megatron.plan.evaluate import evaluate_plan  # noqa: E402
from kareus_megatron.plan.objective import ObjectiveError  # noqa: E402
from kareus_megatron.plan.points import select_frontier_points  # noqa: E402
from kareus_megatron.plan.workload import plan_workload  # noqa: E402
from kareus_megatron.runtime.closed_loop.auto import (  # noqa: E402
    ITERATIONS_PER_CLOCK,
    PROFILE_CLOCKS,
    interleaved,
    profile_clocks_mhz,
)
from kareus_megatron.vocab import ISO_REL_TOL, KAREUS, MEGATRON  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "perseus_sosp24"
TRUTHS = ROOT / "benchmarks" / "data" / "closed_loop_measured"
PROFILE_LAYOUT = ("--tp", "8", "--pp", "8", "--mbs", "1", "--seq", "2048", "--recompute", "none")
BOUND_SHARE = 0.5  # share of busy time at the board limit from which the limit "holds" a clock
SHOWN_CLOCKS = 8  # clocks of the power table, evenly spread over the supported ones


@dataclass(frozen=True)
class Case:
    """One truth: the measured profile it is fitted to and the GPU preset it is fitted on."""

    key: str  # its stored truth: TRUTHS / f"{key}.json"
    label: str
    gpu: str
    profile: str  # file in DATA
    model: str
    split: tuple[str, ...] = ()  # the profile's layer split (Perseus: BLOOM 9 + 6 × 9 + 7)


CASES = (
    Case("a40-gpt3", "A40, GPT-3 175B profile", "a40", "gpt3-175b+a40_bf16.csv", "gpt3-175b"),
    Case(
        "a40-bloom",
        "A40, BLOOM 176B profile",
        "a40",
        "bloom+a40_bf16.csv",
        "bloom-176b",
        ("--first-stage-layers", "9", "--last-stage-layers", "7"),
    ),
    Case(
        "a100-40gb-gpt3",
        "A100-SXM4-40GB preset, GPT-3 175B profile (measured on A100-SXM4-80GB)",
        "a100-sxm4-40gb",
        "gpt3-175b+a100_sxm_bf16.csv",
        "gpt3-175b",
    ),
)
QUICK_CASE = "a40-gpt3"


def fit_truth(case: Case, out: Path) -> Calibration:
    """`kareus calibrate --profile` of the case's measured profile, its source named relative to the repository."""
    profile = DATA / case.profile
    _kareus(
        "calibrate",
        "--profile",
        str(profile),
        "--gpu",
        case.gpu,
        "--model",
        case.model,
        *PROFILE_LAYOUT,
        *case.split,
        "--ratios-only",
        "-o",
        str(out),
    )
    return load_calibration(out).model_copy(update={"source": f"stage profile {profile.relative_to(ROOT)}"})


def stored_difference(fresh: Calibration, stored: Calibration) -> float:
    """Largest relative difference of a parameter between two calibrations (inf: different parameter sets)."""
    if set(fresh.params) != set(stored.params):
        return float("inf")
    return max(abs(fresh.params[n] / stored.params[n] - 1) if stored.params[n] else 0.0 for n in fresh.params)


# ---- 1. parameters --------------------------------------------------------------------------------------------


def parameter_rows(job: Job, cal: Calibration) -> list[dict[str, Any]]:
    """Figure 1: per log-fit parameter and per other truth parameter, preset / truth / fitted value and status."""
    gpu = plan_workload(job.base)[0]
    base = KernelParams()
    statuses = cal.fit["parameters"]
    names = [*TIME_PARAMS, *POWER_PARAMS, *sorted(set(job.truth_cal.params) - {*TIME_PARAMS, *POWER_PARAMS})]
    rows = []
    for n in names:
        preset = param_value(gpu, base, n)
        rows.append(
            {
                "name": n,
                "preset": preset,
                "truth": job.truth_cal.params.get(n, preset),
                "fitted": cal.params.get(n, preset),
                "status": statuses[n]["status"] if n in statuses else "not free",
            }
        )
    return rows


def print_parameters(rows: list[dict[str, Any]]) -> None:
    """Print figure 1."""
    print("\n  [1] parameters: preset, truth, fitted (status); error = value / truth - 1")
    print(
        f"      {'parameter':<28} {'preset':>10} {'truth':>10} {'fitted':>10} {'status':<12} {'preset err':>10} "
        f"{'fit err':>8}"
    )
    for r in rows:
        pe, fe = (_rel(r[k], r["truth"]) for k in ("preset", "fitted"))
        print(
            f"      {r['name']:<28} {r['preset']:>10.4g} {r['truth']:>10.4g} {r['fitted']:>10.4g} {r['status']:<12} "
            f"{pe:>+10.1%} {fe:>+8.1%}"
        )


def _rel(value: float, truth: float) -> float:
    return value / truth - 1 if truth else 0.0


# ---- 2. and 3. the max-clock plan's instructions at every supported clock ---------------------------------------


def instruction_curves(km: KernelModel, job: Job, fs: np.ndarray) -> dict[str, np.ndarray]:
    """Per instruction (rows: each stage's forward, backward) at clocks `fs` (MHz): time (s), power (W), energy (J),
    and the share of its busy time held at the board limit (ops at a sustained clock below the locked one)."""
    _, model, par = plan_workload(job.base)
    t, p, capped = [], [], []
    for stage in range(par.pp):
        for kind in ("forward", "backward"):
            layer, extra, n_layers = km.instruction_ops(model, par, stage, kind)
            prof = km.op_profile(layer + extra, fs, precision=par.precision)
            weight = np.r_[np.full(len(layer), float(n_layers)), np.ones(len(extra))][:, None]
            busy = (weight * prof.time_s).sum(axis=0)
            t.append(busy)
            p.append((weight * prof.energy_j).sum(axis=0) / busy)
            capped.append((weight * prof.time_s * (prof.sm_clock_mhz < fs - 0.5)).sum(axis=0) / busy)
    time_s, power_w = np.array(t), np.array(p)
    return {"time_s": time_s, "power_w": power_w, "energy_j": time_s * power_w, "capped": np.array(capped)}


def clock_figures(job: Job, cal: Calibration, profiled_from_mhz: int) -> dict[str, Any]:
    """Figures 2 and 3: preset and fit against the truth over every supported clock of the GPU (errors also over
    the profiled range, clocks >= `profiled_from_mhz` MHz)."""
    gpu = plan_workload(job.base)[0]
    fs = np.array(sorted(gpu.sm_clocks_mhz), dtype=float)
    profiled = fs >= profiled_from_mhz
    models = {"truth": job.truth, "preset": KernelModel(gpu), "fit": KernelModel(gpu, cal)}
    curves = {name: instruction_curves(km, job, fs) for name, km in models.items()}
    truth = curves["truth"]
    best = {name: fs[np.argmin(c["energy_j"], axis=1)] for name, c in curves.items()}
    out: dict[str, Any] = {"clocks_mhz": [int(fs[0]), int(fs[-1]), len(fs)], "profiled_from_mhz": profiled_from_mhz}
    out["models"] = {}
    show = np.unique(np.round(np.linspace(0, len(fs) - 1, SHOWN_CLOCKS)).astype(int))[::-1]
    for name, c in curves.items():
        p_err, t_err = np.abs(c["power_w"] / truth["power_w"] - 1), np.abs(c["time_s"] / truth["time_s"] - 1)
        share = (c["capped"] * c["time_s"]).sum(axis=0) / c["time_s"].sum(axis=0)
        held = fs[share >= BOUND_SHARE]
        clock_err = np.abs(best[name] - best["truth"])
        out["models"][name] = {
            "power_limit_w": float(models[name].gpu.power_limit_w),
            "power_err_max": float(p_err.max()),
            "power_err_mean": float(p_err.mean()),
            "time_err_max": float(t_err.max()),
            "time_err_mean": float(t_err.mean()),
            "profiled_power_err_max": float(p_err[:, profiled].max()),
            "profiled_power_err_mean": float(p_err[:, profiled].mean()),
            "profiled_time_err_max": float(t_err[:, profiled].max()),
            "limit_share_at_max_clock": float(share[-1]),
            "limit_holds_from_mhz": int(held.min()) if held.size else None,
            "min_energy_clock_mhz": [int(f) for f in best[name]],
            "min_energy_clock_err_max_mhz": float(clock_err.max()),
            "min_energy_clock_err_mean_mhz": float(clock_err.mean()),
            "at": {
                int(fs[i]): {"power_w": float(c["power_w"][:, i].mean()), "limit_share": float(share[i])} for i in show
            },
        }
    return out


def print_clocks(fig: dict[str, Any]) -> None:
    """Print figures 2 and 3."""
    lo, hi, n = fig["clocks_mhz"]
    m = fig["models"]
    print(
        f"\n  [2] the max-clock plan's instructions at the {n} supported clocks ({lo}-{hi} MHz), against the truth: "
        "|error| max / mean"
    )
    for name in ("preset", "fit"):
        f = m[name]
        print(
            f"      {name:<6} power {f['power_err_max']:>6.1%} / {f['power_err_mean']:>5.1%}   time "
            f"{f['time_err_max']:>6.1%} / {f['time_err_mean']:>5.1%}   profiled clocks (>= {fig['profiled_from_mhz']} "
            f"MHz): power {f['profiled_power_err_max']:>5.1%} / {f['profiled_power_err_mean']:>4.1%}, time max "
            f"{f['profiled_time_err_max']:>5.1%}"
        )
    print("      mean instruction power (W) and share of busy time at the board limit:")
    print(f"      {'clock MHz':>9} " + " ".join(f"{name:>16}" for name in ("truth", "preset", "fit")))
    for f in m["truth"]["at"]:
        cells = (f"{m[k]['at'][f]['power_w']:>7.1f} W ({m[k]['at'][f]['limit_share']:>4.0%})" for k in m)
        print(f"      {f:>9} " + " ".join(f"{c:>16}" for c in cells))
    for name in ("truth", "preset", "fit"):
        f = m[name]
        where = (
            "nowhere"
            if f["limit_holds_from_mhz"] is None
            else f"from {f['limit_holds_from_mhz']} MHz up (at the max clock {f['limit_share_at_max_clock']:.0%})"
        )
        print(
            f"      {name:<6} board limit {f['power_limit_w']:>6.1f} W holds >= {BOUND_SHARE:.0%} of busy time {where}"
        )
    print(
        "\n  [3] energy-minimising clock per instruction (truth: "
        + ", ".join(str(c) for c in m["truth"]["min_energy_clock_mhz"])
        + " MHz): error max (mean)"
    )
    for name in ("preset", "fit"):
        f = m[name]
        print(
            f"      {name:<6} {f['min_energy_clock_err_max_mhz']:>5.0f} MHz ({f['min_energy_clock_err_mean_mhz']:.0f})"
            f"   clocks {', '.join(str(c) for c in f['min_energy_clock_mhz'])}"
        )


# ---- 4. iso-time plans under the truth -------------------------------------------------------------------------


def plans_under_truth(job: Job, files: dict[str, Path | None], latency_ms: float, work: Path) -> dict[str, Any]:
    """Figure 4 at one clock latency (ms): each model's iso-time plan (the max-clock plan where it has none),
    evaluated under the truth against the max-clock plan and against the truth's own plan."""
    flags = [*job.flags[: job.flags.index("--clock-latency-ms")], "--clock-latency-ms", f"{latency_ms:g}"]
    ref = evaluate_plan(job.max_plan, job.truth)
    rows: dict[str, Any] = {}
    for name, cal_file in files.items():
        out = work / f"{name}-{latency_ms:g}ms"
        if name == "truth" and latency_ms == 0:
            plan, met, out = job.truth_plan, True, job.work / "truth-plan"  # make_job planned it at latency 0
        else:
            try:
                plan, met = plan_iso_time(flags, cal_file, out, ISO_REL_TOL)[0], True
            except ObjectiveError:
                plan, met = job.max_plan, False
        ev = evaluate_plan(plan, job.truth)
        rows[name] = {
            "met": met,
            "fastest_vs_max_own": fastest_over_max_clock(out),
            "energy_vs_max": ev.energy_j / ref.energy_j,
            "time_vs_max": ev.time_s / ref.time_s,
        }
    for name in ("fit", "preset"):
        rows[name]["energy_vs_truth_plan"] = rows[name]["energy_vs_max"] / rows["truth"]["energy_vs_max"]
        rows[name]["time_vs_truth_plan"] = rows[name]["time_vs_max"] / rows["truth"]["time_vs_max"]
    return {"latency_ms": latency_ms, "plans": rows}


def fastest_over_max_clock(out: Path) -> float:
    """The fastest kareus plan's time over the max-clock plan's, both as planned in plan_iso_time's `out` (its own
    model), minus 1."""
    mega = select_frontier_points(out, "all", method=MEGATRON, allow_all=True)[0]
    bounded = out.with_name(out.name + "-bounded")
    return (
        min(p.time_s for p in select_frontier_points(bounded, "all", method=KAREUS, allow_all=True)) / mega.time_s - 1
    )


def print_plans(figs: list[dict[str, Any]]) -> None:
    """Print figure 4, one block of rows per clock latency."""
    print(
        "\n  [4] iso-time plans under the truth (no plan within "
        f"{ISO_REL_TOL:.1%} of the max-clock time: the loop keeps the max-clock plan)"
    )
    print(
        f"      {'latency':>7} {'plan of':<7} {'iso-time (fastest)':<19} {'energy vs max':>13} {'time vs max':>11} "
        f"{'energy vs truth plan':>20} {'time vs truth plan':>18}"
    )
    for fig in figs:
        for name in ("truth", "fit", "preset"):
            r = fig["plans"][name]
            rel = f"{r['energy_vs_truth_plan']:>20.4f} {r['time_vs_truth_plan']:>18.4f}" if name != "truth" else ""
            met = f"{'met' if r['met'] else 'unmet'} ({r['fastest_vs_max_own']:+.2%})"
            print(
                f"      {fig['latency_ms']:>5g}ms {name:<7} {met:<19} {r['energy_vs_max']:>13.4f} "
                f"{r['time_vs_max']:>11.4f} {rel}"
            )


# ---- the run -------------------------------------------------------------------------------------------------


def run_case(case: Case, truth: Calibration, work: Path, latencies_ms: tuple[float, ...]) -> dict[str, Any]:
    """Every figure of one case (module doc)."""
    flags = [*job_flags(2, case.gpu), "--band-samples", "0", "--clock-latency-ms", "0"]
    job = make_job(2, flags, work, truth=truth, max_time_slack=ISO_REL_TOL)
    gpu = plan_workload(job.base)[0]
    t0 = time.perf_counter()
    cal, _ = fit_profile(job, PROFILE_CLOCKS, ITERATIONS_PER_CLOCK, seed=0)
    fit_s = time.perf_counter() - t0
    if cal is None:
        raise RuntimeError(f"{case.label}: the fit refused the default profile")
    save_calibration(cal, work / "fit.json")
    files: dict[str, Path | None] = {"truth": work / "truth.json", "fit": work / "fit.json", "preset": None}
    profile = interleaved(profile_clocks_mhz(gpu.sm_clocks_mhz, PROFILE_CLOCKS))
    own = truth.fit["calibrated"]
    print(f"\n== {case.label}: truth `kareus calibrate --profile {case.profile} --gpu {case.gpu}`; llama3.2-3b PP=2")
    print(
        f"   the truth against its profile: power MAPE {own['power_mape_pct']:.1f}%, time-ratio MAPE "
        f"{own['time_ratio_mape_pct']:.1f}%, energy-minimising clock within {own['argmin_clock_err_max_mhz']:.0f} MHz"
    )
    print(
        f"   profile clocks {', '.join(map(str, profile))} MHz × {ITERATIONS_PER_CLOCK} (+ warm-up); "
        f"{cal.fit['samples']} instruction samples, {cal.fit['windows']} energy windows, fit {fit_s:.1f} s"
    )
    params = parameter_rows(job, cal)
    print_parameters(params)
    clocks = clock_figures(job, cal, min(profile))
    print_clocks(clocks)
    plans = [plans_under_truth(job, files, lat, work / "plans") for lat in latencies_ms]
    print_plans(plans)
    return {
        "case": case.key,
        "label": case.label,
        "gpu": case.gpu,
        "profile": case.profile,
        "profile_clocks_mhz": profile,
        "truth_against_profile": own,
        "fit_s": fit_s,
        "parameters": params,
        "clocks": clocks,
        "plans": plans,
    }


def load_truth(case: Case, work: Path, refit: bool, write: bool) -> tuple[Calibration, float | None]:
    """(the case's truth, its largest relative difference from the stored one when refitted)."""
    stored_file = TRUTHS / f"{case.key}.json"
    if not refit:
        return load_calibration(stored_file), None
    work.mkdir(parents=True, exist_ok=True)
    fresh = fit_truth(case, work / "truth-fit.json")
    diff = stored_difference(fresh, load_calibration(stored_file)) if stored_file.exists() else None
    if write:
        stored_file.parent.mkdir(parents=True, exist_ok=True)
        save_calibration(fresh, stored_file)
    return fresh, diff


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the A40 GPT-3 case, its stored truth, latency 0 (seconds)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures to FILE")
    p.add_argument("--write-truths", action="store_true", help=f"store the fitted truths in {TRUTHS.relative_to(ROOT)}")
    p.add_argument("--work", default=None, metavar="DIR", help="keep plans and logs in DIR (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    cases = [c for c in CASES if c.key == QUICK_CASE] if args.quick else list(CASES)
    out: dict[str, Any] = {"quick": args.quick, "cases": []}
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for case in cases:
            truth, diff = load_truth(case, work / case.key, refit=not args.quick, write=args.write_truths)
            latencies = (0.0,) if args.quick else (0.0, gpu_spec(case.gpu).clock_latency_s * 1000.0)
            fig = run_case(case, truth, work / case.key, latencies)
            fig["stored_truth_difference"] = diff
            if diff is not None:
                print(f"\n  stored truth {TRUTHS.name}/{case.key}.json against this fit: largest difference {diff:.2%}")
            out["cases"].append(fig)
    out["wall_s"] = time.perf_counter() - t0
    print(f"\n(benchmark wall time {out['wall_s']:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
