"""`kareus report LOG --plan PLAN`: measured against predicted iteration time and energy, and a plot.

LOG is the JSONL written with --kareus-log (runtime/measurement.py); PLAN is the plan file the run used.
Prints medians after the warm-up iterations, per stage and in total, and writes a PNG (default: LOG
with the suffix .png).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kareus_megatron.errors import ConfigError

HELP = "compare a run's measured iteration time and energy (--kareus-log) with its plan's prediction"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus report` flags."""
    parser.add_argument("log", help="run log written with --kareus-log (JSONL)")
    parser.add_argument("--plan", required=True, help="the plan file the run used")
    parser.add_argument("--skip", type=int, default=1, help="warm-up iterations left out (default 1)")
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
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.plan.io import load_plan
    from kareus_megatron.runtime.run_report import compare, load_run_log

    if args.skip < 0:
        raise ConfigError(f"--skip {args.skip}: must be 0 or more iterations")
    plan = load_plan(args.plan)
    log = load_run_log(args.log)
    cmp = compare(log, plan, gpu_spec(plan.gpu).p_blocked_w, skip=args.skip)
    print(f"run log {args.log}: {len(log.iterations)} iterations ({cmp.skipped} warm-up left out); "
          f"plan {args.plan} ({plan.method}, {plan.gpu}, backend {log.header.get('backend', '?')})")
    print(f"{'':20s} {'measured':>12s} {'predicted':>12s} {'error':>8s}")
    for row in cmp.rows:
        err = f"{row.error * 100:+.1f}%" if row.error is not None else "n/a"
        print(f"{row.name:20s} {_fmt(row.measured, row.unit):>12s} {_fmt(row.predicted, row.unit):>12s} {err:>8s}")
    for note in cmp.notes:
        print(f"note: {note}")
    if not args.no_plot:
        from kareus_megatron.plotting.report import plot_run_report

        out = Path(args.plot) if args.plot else Path(args.log).with_suffix(".png")
        fig = plot_run_report(cmp, plan.predicted.iteration_time_s, title=f"{Path(args.log).name} vs {Path(args.plan).name}")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        print(f"wrote {out}")
    return 0
