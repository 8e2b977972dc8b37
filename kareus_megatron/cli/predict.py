"""`kareus predict`: per-stage forward/backward time (s), energy (J) and power (W) at each SM clock (MHz)."""

from __future__ import annotations

import argparse
import json
import sys

from kareus_megatron.cli.workload_args import add_workload_arguments, workload_from_args
from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.gpus import CLOCK_GRID_LOWEST_FRACTION, CLOCK_GRID_STEP_MHZ

# lazy (`kareus --help` imports every command module): the cost model (cost.kernel ~77 ms, cost.predict ~41 ms) and
# rich (~18 ms).

HELP = "predict each stage's forward/backward time (s), energy (J) and power (W) at each SM clock"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the workload flags plus --freqs and --format."""
    add_workload_arguments(parser)
    parser.add_argument(
        "--freqs",
        default=None,
        help=f"comma-separated SM clocks (MHz); default: the planning grid, every "
        f"{CLOCK_GRID_STEP_MHZ} MHz from the max clock down to "
        f"{100 * CLOCK_GRID_LOWEST_FRACTION:.0f}%% of it",
    )
    parser.add_argument(
        "--format",
        choices=("table", "json", "csv"),
        default="table",
        help="output format (with --vp > 1 a row sums the stage's chunks)",
    )
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="the memory estimate shards the "
        "optimizer state over DP×CP (Megatron's --use-distributed-optimizer; default off)",
    )


def parse_freqs(text: str) -> list[int]:
    """Parse "1410,1200" into clocks (MHz); ConfigError names the bad item."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit():
            raise ConfigError(f"--freqs item {item!r} is not a whole number of MHz; write e.g. --freqs 1410,1200,900.")
        if int(item) in out:
            raise ConfigError(f"--freqs lists {item} MHz twice; give each clock once.")
        out.append(int(item))
    return out


def run(args: argparse.Namespace) -> int:
    """Print the prediction; return the exit status."""
    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.cost.predict import predict_rows
    from kareus_megatron.cost.profile import format_perseus_csv

    gpu, model, par = workload_from_args(args)
    from kareus_megatron.cost.memory import check_fits, memory_line, memory_summary

    stages = check_fits(gpu, model, par, distributed_optimizer=args.distributed_optimizer)  # refuses if too big
    clocks = gpu.check_clocks(parse_freqs(args.freqs)) if args.freqs else gpu.clock_grid_mhz()
    cal = None
    if args.calibration:
        from kareus_megatron.cost.calibration import load_calibration

        cal = load_calibration(args.calibration)
    rows = predict_rows(KernelModel(gpu, cal), model, par, clocks)
    if args.format == "json":
        json.dump(
            {"rows": [r.as_dict() for r in rows], "memory": memory_summary(gpu, stages, args.distributed_optimizer)},
            sys.stdout,
            indent=1,
        )
        sys.stdout.write("\n")
    elif args.format == "csv":
        sys.stdout.write(
            format_perseus_csv([(r.stage, r.instruction, r.frequency_mhz, r.time_s, r.energy_j) for r in rows])
        )
    else:
        _print_table(rows, gpu.name, model.name, par, cal is not None)
        print(memory_line(gpu, stages))
    return 0


def _print_table(rows, gpu: str, model: str, par, calibrated: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"{model} on {gpu}: TP={par.tp} CP={par.cp} PP={par.pp} VP={par.vp} DP={par.dp} "
        f"MBS={par.micro_batch_size} "
        f"seq={par.seq_length} recompute={par.recompute} ({'calibrated' if calibrated else 'presets'})"
    )
    table = Table(title=title)
    for col in ("stage", "instruction", "clock (MHz)", "time (s)", "energy (J)", "power (W)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.stage),
            r.instruction,
            str(r.frequency_mhz),
            f"{r.time_s:.5f}",
            f"{r.energy_j:.3f}",
            f"{r.avg_power_w:.1f}",
        )
    Console(width=120).print(table)
