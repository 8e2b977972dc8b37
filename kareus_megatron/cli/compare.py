"""`kareus compare LOG_DIR`: the reductions table and frontier plot of measured runs.

LOG_DIR holds one sub-directory per run, NAME-NN/ (as `kareus launch` writes them), each with ``measurement/`` (the
runtime's per-rank logs, merged: time s = max over ranks, energy J = all GPUs) and optionally ``run.json`` (method,
plan). A run's point is its median iteration time and mean energy (total over total) after ``--skip-iterations``
warm-up iterations (default 2), read by report/runlog.py and summarised by report/summary.py exactly as `kareus
report` does. The output, under ``--out`` (default LOG_DIR/compare), is ``frontier.json`` in kareus plan's layout
(kareus-frontier/1, reductions by the same formulas, plan/frontier.py) and ``frontier.png``. Each run and each
reduction carries its measured band (report/measured_bands.py), printed as kareus plan prints its bands, with
"n.d." where a reduction's band holds 0 (cli/band_cells.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kareus_megatron.report.summary import DEFAULT_SKIP_ITERATIONS, STATISTICS_TEXT, log_notes

# lazy (`kareus --help` imports every command module): report.measured and plan.io (~50 ms each), rich (~18 ms) and
# plotting (matplotlib).

HELP = (
    "reductions table with measured bands (n.d. where within the noise) and frontier plot from measured logs "
    "(same formulas, bands and frontier.json layout as kareus plan)"
)


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


def _no_band_notes(runs: list[Any]) -> list[str]:
    """One line naming the runs too short for a band (and so for the bands of the reductions that read them)."""
    from kareus_megatron.report.measured_bands import MIN_BAND_ITERATIONS

    short = [f"{r.name} ({r.iterations})" for r in runs if r.iterations < MIN_BAND_ITERATIONS]
    if not short:
        return []
    return [
        f"note: no band for {', '.join(short)}: fewer than {MIN_BAND_ITERATIONS} iterations after warm-up, too few "
        "to say how they spread; the reductions that read them have no band either (run longer for one)"
    ]


def print_tables(doc: dict[str, Any], runs: list[Any]) -> None:
    """Per-run measured (and predicted) figures with their bands, then the reductions of every method."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from kareus_megatron.cli.band_cells import band_cell, not_distinguishable_notes, reduction_cell
    from kareus_megatron.plan.frontier import REDUCTION_KEYS

    console = Console(width=max(Console().width, 140))  # keep run names and bands whole in logs and pipes
    sim = "simulated GPU: " if doc["config"].get("simulated") else ""
    skip = doc["config"]["skip_iterations"]
    lo, hi = doc["bands"]["percentiles"]
    t = Table(
        title=f"{sim}measured runs ({STATISTICS_TEXT} after {skip} warm-up iterations; "
        f"energy = all GPUs per iteration; band = {lo:g}th-{hi:g}th percentile of the iterations)",
        box=box.SIMPLE,
    )
    for col, right in (
        ("run", False),
        ("iters", True),
        ("time (s)", True),
        ("band (s)", True),
        ("energy (J)", True),
        ("band (J)", True),
        ("predicted (s)", True),
        ("predicted (J)", True),
    ):
        t.add_column(col, justify="right" if right else "left", no_wrap=True)
    points = {p["run"]: p for entry in doc["methods"].values() for p in entry["points"]}
    for r in runs:
        p = r.predicted or {}
        t.add_row(
            r.name,
            str(r.iterations),
            f"{r.time_s:.4g}",
            band_cell(points[r.name], "time_s", digits=4),
            f"{r.energy_j:.4g}",
            band_cell(points[r.name], "energy_j", digits=4),
            f"{p['iteration_time_s']:.4g}" if "iteration_time_s" in p else "-",
            f"{p['iteration_energy_j']:.4g}" if "iteration_energy_j" in p else "-",
        )
    red = Table(
        title="reductions (measured; Perseus = reference; + is better) "
        f"\\[band: {lo:g}th-{hi:g}th percentile over {doc['bands']['draws']} bootstrap resamples of the iterations]",
        box=box.SIMPLE,
    )
    red.add_column("method", no_wrap=True)
    for col in ("iso-time E", "iso-energy T", "T vs Megatron", "E vs Megatron"):
        red.add_column(col, justify="right", no_wrap=True)
    for name, r in doc["reductions"].items():
        red.add_row(name, *(reduction_cell(r, key) for key in REDUCTION_KEYS))
    console.print(t)
    console.print(red)
    notes = not_distinguishable_notes(doc, "over bootstrap resamples of the iterations, holds 0 -- within their noise")
    for line in notes + _no_band_notes(runs):
        console.print(line, highlight=False, soft_wrap=True)

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
                bands=True,
            )
    print_tables(doc, runs)
    print(f"wrote {out / 'frontier.json'}" + ("" if args.no_plot else f" and {out / 'frontier.png'}"))
    return 0
