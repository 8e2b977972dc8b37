"""`kareus report LOG [--plan PLAN]`: measured against predicted iteration time and energy, and a plot.

For a ``--kareus-plan auto`` run, also (or, without --plan, only) its phases, the model error before and after
calibration and the saving against its max-clock iterations (report/auto.py).

LOG is the run log written with --kareus-log (read by report/runlog.py, as `kareus compare` reads it); PLAN is the
plan the run executed, found from the log's header when not given, and refused when it is another job's
(report/run_plan.py). Prints, over the iterations after ``--skip-iterations`` warm-up iterations (default 2), the
median time and the mean energy (total over total), per stage and in total, and writes a PNG (default: LOG with the
suffix .png); the job's power waveform measured against predicted (report/power.py; JSON "power") and its plot
beside the PNG (NAME.power.png).
The predicted stage energy uses the blocked power recorded in the plan (older plans: the GPU preset's).
Per GPU (report/per_gpu.py): every rank's mean energy per iteration, its share of the job's and its
predicted energy, listed when the job has at most PER_GPU_ROWS GPUs or with --per-gpu (otherwise one line names the
GPUs that drew least and most); ``--format json`` always lists them under "gpus". Clock changes
(report/clock_changes.py): how many the controller made late or skipped, one line, flagged above 5%; JSON
"clock_changes" (null: none counted)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kareus_megatron.errors import ConfigError
from kareus_megatron.files import check_writable_location
from kareus_megatron.report.clock_changes import clock_changes
from kareus_megatron.report.runlog import RunLog, read_run_log
from kareus_megatron.report.summary import DEFAULT_SKIP_ITERATIONS, ENERGY_STATISTIC, STATISTICS_TEXT, summarize

# lazy (`kareus --help` imports every command module): report.against_plan (~146 ms), report.run_plan and report.power
# (~54 ms each), report.auto (~2 ms) and plotting (matplotlib).

HELP = "compare a run's measured iteration time and energy (--kareus-log) with its plan's prediction"
ROBUST_TEXT = "chosen across the prediction bands (--kareus-robust), "  # a run log header's "robust": true
PER_GPU_ROWS = 16  # jobs with at most this many GPUs get the per-GPU table without --per-gpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus report` flags."""
    parser.add_argument("log", help="run log directory written with --kareus-log (rank-NNNNN.jsonl files)")
    parser.add_argument(
        "--plan",
        default=None,
        help="the plan the run executed: a plan file, or a kareus plan "
        "directory (the log's point is picked); default: the plan the log header records (path and "
        "sha256; a moved plan is found beside the log); a --kareus-plan auto run without --plan "
        "reports its phases, model error and saving",
    )
    parser.add_argument(
        "--skip-iterations",
        "--skip",
        type=int,
        default=DEFAULT_SKIP_ITERATIONS,
        metavar="N",
        help=f"warm-up iterations left out of the figures ({STATISTICS_TEXT}; default {DEFAULT_SKIP_ITERATIONS})",
    )
    parser.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text table (default) or one JSON object on stdout (no plot unless --plot)",
    )
    parser.add_argument("--plot", default=None, help="PNG file to write (default: LOG.png beside LOG)")
    parser.add_argument("--no-plot", action="store_true", help="do not write a plot")
    parser.add_argument(
        "--per-gpu",
        action="store_true",
        help=f"list every GPU's energy (default: only for jobs of at most {PER_GPU_ROWS} GPUs)",
    )


def _fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "n/a"
    if unit == "s":
        return f"{x * 1e3:.2f} ms"
    return f"{x:.1f} J"


def _plot_path(args: argparse.Namespace) -> Path | None:
    """Where the plot goes (None: no plot); ConfigError for a directory or a name without .png."""
    if args.no_plot or (args.format == "json" and not args.plot):
        return None
    if not args.plot:
        log = Path(args.log)
        out = log.with_name(log.name + ".png") if log.is_dir() else log.with_suffix(".png")
        if log.exists():  # a missing LOG is named when it is read; checked before the table is printed
            check_writable_location(out, "--plot (default: beside LOG; or --no-plot)", directory=False)
        return out
    out = Path(args.plot)
    if out.is_dir():
        raise ConfigError(f"--plot {out} is a directory; give a file name ending in .png")
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--plot {out} does not end in .png; give a PNG file name")
    check_writable_location(out, "--plot", directory=False)
    return out


def _json(cmp: object, log: object, n_complete: int) -> dict[str, object]:
    from kareus_megatron.report.against_plan import Comparison

    assert isinstance(cmp, Comparison) and isinstance(log, RunLog)
    rows = {r.name: r for r in cmp.rows}
    stages = []
    for stage, _ in sorted(cmp.stage_energy_j.items()):
        t, e = rows[f"stage {stage} time"], rows[f"stage {stage} energy"]
        stages.append(
            {
                "stage": stage,
                "iterations": cmp.stage_iterations.get(stage, 0),
                "measured_time_s": t.measured,
                "measured_energy_j": e.measured,
                "predicted_time_s": t.predicted,
                "predicted_energy_j": e.predicted,
            }
        )
    it, en = rows["iteration time"], rows["iteration energy"]
    return {
        "simulated": log.simulated,
        "backend": log.header.get("backend"),
        "robust": bool(log.header.get("robust", False)),
        "time_scale": cmp.time_scale,
        "iterations": n_complete,
        "used": cmp.used,
        "skipped": cmp.skipped,
        "partial": len(log.partial),
        "measured_time_s": it.measured,
        "measured_energy_j": en.measured,
        "predicted_time_s": it.predicted,
        "predicted_energy_j": en.predicted,
        "stages": stages,
        "gpus": [g.as_json() for g in cmp.gpus],
        "notes": cmp.notes,
    }


def _print_gpus(cmp: object, every: bool) -> None:
    """The per-GPU section of the text report: a table, or one line for a large job without --per-gpu."""
    from kareus_megatron.report.against_plan import Comparison

    assert isinstance(cmp, Comparison)
    gpus = cmp.gpus
    if not gpus:
        return
    if not every and len(gpus) > PER_GPU_ROWS:
        lo = min(gpus, key=lambda g: g.energy_j or 0.0)
        hi = max(gpus, key=lambda g: g.energy_j or 0.0)
        print(
            f"per GPU energy ({ENERGY_STATISTIC} per iteration): least {_fmt(lo.energy_j, 'J')} (rank {lo.rank}, GPU "
            f"{lo.label}), most {_fmt(hi.energy_j, 'J')} (rank {hi.rank}, GPU {hi.label}) of {len(gpus)} GPUs; "
            "--per-gpu lists them all"
        )
        return
    print(f"per GPU ({ENERGY_STATISTIC} energy, median time per iteration; share of the job's energy):")
    print(
        f"{'rank':>5s} {'stage':>5s} {'GPU':16s} {'energy':>10s} {'predicted':>10s} {'error':>8s} "
        f"{'time':>10s} {'share':>7s}"
    )
    for g in gpus:
        err = f"{g.error * 100:+.1f}%" if g.error is not None else "n/a"
        share = f"{g.share * 100:.1f}%" if g.share is not None else "n/a"
        stage = str(g.pp_rank) if g.pp_rank is not None else "?"
        print(
            f"{g.rank:>5d} {stage:>5s} {g.label:16.16s} {_fmt(g.energy_j, 'J'):>10s} "
            f"{_fmt(g.predicted_energy_j, 'J'):>10s} {err:>8s} {_fmt(g.time_s, 's'):>10s} {share:>7s}"
        )


def _print_power(power: dict[str, dict[str, object]]) -> None:
    """The power section of the text report: the waveform metrics, measured and predicted (report/power.py)."""
    if not power:
        return
    m, p = power.get("measured", {}), power.get("predicted", {})
    rate = f", {m['sample_hz']:.0f} Hz samples ({m['reading']})" if m else ", no power samples in the log"
    print(f"job power over one iteration{rate}:")
    for key, unit in (
        ("peak_power_w", "W"),
        ("min_power_w", "W"),
        ("mean_power_w", "W"),
        ("swing_w", "W"),
        ("ramp_w_per_s", "W/s"),
        ("band_fraction", ""),
    ):
        cells = [f"{float(d[key]):.4g} {unit}".strip() if key in d else "n/a" for d in (m, p)]  # type: ignore[arg-type]
        print(f"{key:20s} {cells[0]:>12s} {cells[1]:>12s}")


def run(args: argparse.Namespace) -> int:
    """Print the comparison table (or JSON) and write the plot; exit 0."""
    from kareus_megatron.report.against_plan import blocked_power_w, compare
    from kareus_megatron.report.auto import auto_lines, auto_summary
    from kareus_megatron.report.run_plan import plan_for_run

    log = read_run_log(args.log)
    auto = auto_summary(log) if args.plan is None else None
    if auto is not None:  # a --kareus-plan auto run without --plan: its phases, model error and saving
        if args.format == "json":
            print(json.dumps(asdict(auto), indent=2, default=str))
        else:
            print("\n".join(auto_lines(auto)))
        return 0
    out = _plot_path(args)
    plan, plan_path, found = plan_for_run(log, args.plan)  # refuses another job's plan in one line
    p_blocked_w = blocked_power_w(plan, source=f"plan {plan_path}")
    summary = summarize(log, args.skip_iterations)
    cmp = compare(summary, plan, p_blocked_w)
    from kareus_megatron.report.power import power_section

    power, curves = power_section(summary, plan, cmp.time_scale)

    changes = clock_changes(log, args.skip_iterations)  # None: no clock controller counts in the log
    sim = "simulated GPU: " if log.simulated else ""
    n_complete = sum(1 for r in log.iterations if r["iteration"] not in log.partial)
    if args.format == "json":
        print(
            json.dumps(
                {
                    **_json(cmp, log, n_complete),
                    "power": power,
                    "clock_changes": None if changes is None else changes.as_json(),
                },
                indent=2,
            )
        )
    else:
        print(
            f"{sim}run log {args.log}: {n_complete} complete iterations ({len(log.partial)} partial; "
            f"{cmp.skipped} warm-up left out; {STATISTICS_TEXT} of {cmp.used}); plan {plan_path} ({plan.method}, "
            f"{plan.gpu}, {ROBUST_TEXT if log.header.get('robust') else ''}blocked power {p_blocked_w:g} W, "
            f"backend {log.header.get('backend', '?')}; {found})"
        )
        print(f"{'':20s} {'measured':>12s} {'predicted':>12s} {'error':>8s}")
        for row in cmp.rows:
            err = f"{row.error * 100:+.1f}%" if row.error is not None else "n/a"
            print(f"{row.name:20s} {_fmt(row.measured, row.unit):>12s} {_fmt(row.predicted, row.unit):>12s} {err:>8s}")
        _print_gpus(cmp, args.per_gpu)
        _print_power(power)
        if changes is not None:
            print(changes.line())
        for note in cmp.notes:
            print(f"note: {note}")
        auto = auto_summary(log)
        if auto is not None:
            print("\n".join(auto_lines(auto)))
    if out is not None:
        from kareus_megatron.plotting.report import plot_run_report

        fig = plot_run_report(
            cmp,
            plan.predicted.iteration_time_s * cmp.time_scale,
            title=(
                "simulated" + (f" (time scale ×{cmp.time_scale:g})" if cmp.time_scale != 1 else "") + ": "
                if log.simulated
                else ""
            )
            + f"{Path(args.log).name} vs {plan_path.name}",
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        print(f"wrote {out}", file=sys.stderr if args.format == "json" else sys.stdout)
        if curves:
            from kareus_megatron.plotting.power import save_power_png

            wave = out.with_name(out.stem + ".power.png")
            save_power_png(wave, curves, title="job power over one iteration: measured (folded) vs predicted")
            print(f"wrote {wave}", file=sys.stderr if args.format == "json" else sys.stdout)
    return 0
