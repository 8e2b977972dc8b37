"""`kareus compare LOG_DIR`: the reductions table and frontier plot of measured runs.

LOG_DIR holds one sub-directory per run, NAME-NN/ (as `kareus launch` writes them), each with ``measurement/`` (the
runtime's per-rank logs, merged: time s = max over ranks, energy J = all GPUs) and optionally ``run.json`` (method,
plan). A run's point is its median iteration time and mean energy (total over total) after ``--skip-iterations``
warm-up iterations (default 2), read by report/runlog.py and summarised by report/summary.py exactly as `kareus
report` does. The output, under ``--out`` (default LOG_DIR/compare), is ``frontier.json`` in kareus plan's layout
(kareus-frontier/1, reductions by the same formulas, plan/frontier.py) and ``frontier.png``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kareus_megatron.report.summary import DEFAULT_SKIP_ITERATIONS, STATISTICS_TEXT, log_notes

# lazy (`kareus --help` imports every command module): report.measured and plan.io (~50 ms each), rich (~18 ms) and
# plotting (matplotlib).

HELP = "reductions table and frontier plot from measured logs (same formulas and frontier.json layout as kareus plan)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus compare` flags."""
    parser.add_argument("log_dir", help="directory of measured runs, one NAME-NN/ sub-directory each")
    parser.add_argument(
        "--skip-iterations",
        "--skip",
        type=int,
        default=DEFAULT_SKIP_ITERATIONS,
        metavar="N",
        help=f"warm-up iterations left out of each run's figures ({STATISTICS_TEXT}) "
        f"(default {DEFAULT_SKIP_ITERATIONS})",
    )
    parser.add_argument("--out", default=None, help="output directory (default LOG_DIR/compare)")
    parser.add_argument("--no-plot", action="store_true", help="write frontier.json only")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def print_tables(doc: dict[str, Any], runs: list[Any]) -> None:
    """Per-run measured (and predicted) figures, then the reductions of every method."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))  # keep run names whole in logs and pipes
    sim = "simulated GPU: " if doc["config"].get("simulated") else ""
    skip = doc["config"]["skip_iterations"]
    t = Table(
        title=f"{sim}measured runs ({STATISTICS_TEXT} after {skip} warm-up iterations; "
        "energy = all GPUs per iteration)",
        box=box.SIMPLE,
    )
    for col, right in (
        ("run", False),
        ("iters", True),
        ("time (s)", True),
        ("energy (J)", True),
        ("predicted (s)", True),
        ("predicted (J)", True),
    ):
        t.add_column(col, justify="right" if right else "left", no_wrap=True)
    for r in runs:
        p = r.predicted or {}
        t.add_row(
            r.name,
            str(r.iterations),
            f"{r.time_s:.4g}",
            f"{r.energy_j:.4g}",
            f"{p['iteration_time_s']:.4g}" if "iteration_time_s" in p else "-",
            f"{p['iteration_energy_j']:.4g}" if "iteration_energy_j" in p else "-",
        )
    red = Table(title="reductions (measured; Perseus = reference; + is better)", box=box.SIMPLE)
    red.add_column("method", no_wrap=True)
    for col in ("iso-time E", "iso-energy T", "T vs Megatron", "E vs Megatron"):
        red.add_column(col, justify="right")
    for name, r in doc["reductions"].items():
        red.add_row(
            name,
            _pct(r["iso_time_energy"]),
            _pct(r["iso_energy_time"]),
            _pct(r["max_throughput_time_vs_megatron"]),
            _pct(r["max_throughput_energy_vs_megatron"]),
        )
    console.print(t)
    console.print(red)

    for r in runs:
        for note in log_notes(r.summary.log):
            print(f"note: {note}")


def run(args: argparse.Namespace) -> int:
    """Read the logs, write frontier.json (+ plot), print the tables; 0 on success."""
    from kareus_megatron.plan.io import check_output_dir, replace_directory, write_json_atomic
    from kareus_megatron.report.measured import measured_frontier

    out = Path(args.out) if args.out else Path(args.log_dir) / "compare"
    check_output_dir(out)
    doc, runs = measured_frontier(args.log_dir, args.skip_iterations)
    with replace_directory(out) as tmp:
        write_json_atomic(tmp / "frontier.json", doc)
        if not args.no_plot:
            from kareus_megatron.plotting.frontier import save_frontier_png

            gpu = doc["config"]["gpu"]
            save_frontier_png(
                tmp / "frontier.png",
                doc,
                title=("simulated, " if doc["config"].get("simulated") else "")
                + f"measured: {len(runs)} runs in {args.log_dir}"
                + (f" on {gpu}" if gpu else ""),
            )
    print_tables(doc, runs)
    print(f"wrote {out / 'frontier.json'}" + ("" if args.no_plot else f" and {out / 'frontier.png'}"))
    return 0
