"""`kareus report LOG --plan PLAN`: measured against predicted iteration time and energy, and a plot.

LOG is the run log written with --kareus-log (read by report/runlog.py, as `kareus compare` reads it);
PLAN is the plan file the run used. Prints the median of the iterations after ``--skip-iterations``
warm-up iterations (default 2), per stage and in total, and writes a PNG (default: LOG with the suffix
.png). The predicted stage energy uses the blocked power recorded in the plan (older plans: the GPU
preset's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kareus_megatron.report.runlog import DEFAULT_SKIP_ITERATIONS, STATISTIC

HELP = "compare a run's measured iteration time and energy (--kareus-log) with its plan's prediction"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus report` flags."""
    parser.add_argument("log", help="run log written with --kareus-log (JSONL)")
    parser.add_argument("--plan", required=True, help="the plan file the run used")
    parser.add_argument("--skip-iterations", type=int, default=DEFAULT_SKIP_ITERATIONS, metavar="N",
                        help=f"warm-up iterations left out of the {STATISTIC}s (default {DEFAULT_SKIP_ITERATIONS})")
    parser.add_argument("--plot", default=None, help="PNG to write (default: LOG with suffix .png)")
    parser.add_argument("--no-plot", action="store_true", help="do not write a plot")


def _fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "n/a"
    if unit == "s":
        return f"{x * 1e3:.2f} ms"
    return f"{x:.1f} J"


def run(args: argparse.Namespace) -> int:
    """Print the comparison table and write the plot; exit 0."""
    from kareus_megatron.plan.io import load_plan
    from kareus_megatron.report.against_plan import blocked_power_w, compare
    from kareus_megatron.report.runlog import read_run_log, summarize

    plan = load_plan(args.plan)
    p_blocked_w = blocked_power_w(plan, source=f"plan {args.plan}")
    log = read_run_log(args.log)
    cmp = compare(summarize(log, args.skip_iterations), plan, p_blocked_w)
    print(f"run log {args.log}: {len(log.iterations)} iterations ({cmp.skipped} warm-up left out; {STATISTIC} of "
          f"{cmp.used}); plan {args.plan} ({plan.method}, {plan.gpu}, blocked power {p_blocked_w:g} W, "
          f"backend {log.header.get('backend', '?')})")
    print(f"{'':20s} {'measured':>12s} {'predicted':>12s} {'error':>8s}")
    for row in cmp.rows:
        err = f"{row.error * 100:+.1f}%" if row.error is not None else "n/a"
        print(f"{row.name:20s} {_fmt(row.measured, row.unit):>12s} {_fmt(row.predicted, row.unit):>12s} {err:>8s}")
    for note in cmp.notes:
        print(f"note: {note}")
    if not args.no_plot:
        from kareus_megatron.plotting.report import plot_run_report

        out = Path(args.plot) if args.plot else Path(args.log).with_suffix(".png")
        fig = plot_run_report(cmp, plan.predicted.iteration_time_s,
                              title=f"{Path(args.log).name} vs {Path(args.plan).name}")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        print(f"wrote {out}")
    return 0
