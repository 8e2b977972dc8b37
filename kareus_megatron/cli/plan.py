"""`kareus plan`: plan the iteration time–energy frontier of every method and write plan files.

Writes, under ``--out DIR`` (default ./kareus-out): ``frontier.json`` (kareus-frontier/1),
``plans/NAME-NN.json`` (kareus-plan/1; NN = 00 is the method's fastest plan), ``frontier.png`` (time s
vs energy J of every method), ``timeline.png`` (Gantt chart of one plan, coloured by SM clock MHz) and
``timeline.trace.json`` (the same plan as a Perfetto/Chrome trace) and ``power.png`` (two iterations of the
job's predicted power, W, of Megatron's fastest plan and that plan; docs/power.md).
Everything is written to a temporary directory next to DIR and renamed into place, so DIR is never
left half-written; bad input leaves DIR untouched.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kareus_megatron.cli.parsing import add_clock_latency_flag, clock_latency_s
from kareus_megatron.cli.workload_args import add_workload_arguments, workload_from_args
from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.gpus import CLOCK_GRID_LOWEST_FRACTION, CLOCK_GRID_STEP_MHZ
from kareus_megatron.search.schedules import overlap_blocker
from kareus_megatron.vocab import (
    BAND_DRAWS,
    FRAMEWORK_MEGATRON,
    FRAMEWORKS,
    KAREUS,
    METHODS,
    NANOBATCH_PERSEUS,
    schedule_for,
)

# lazy (`kareus --help` imports every command module): the planner (cost, search and plan modules, 50–120 ms each),
# numpy (~60 ms), rich (~18 ms) and plotting (matplotlib).

HELP = "plan the iteration time-energy frontier of every method and write plan files (default job: see --help)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the workload flags and `kareus plan`'s own."""
    add_workload_arguments(parser)
    g = parser.add_argument_group("planning")
    g.add_argument(
        "--points",
        type=int,
        default=10,
        help="plans written per method, spread along its frontier "
        "(always the fastest and the lowest-energy one; default 10)",
    )
    g.add_argument("--out", default="kareus-out", help="output directory (default ./kareus-out)")
    g.add_argument(
        "--max-time", type=float, default=None, metavar="S", help="write only plans with iteration time <= S seconds"
    )
    g.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated methods out of {', '.join(METHODS)} (default: all {len(METHODS)}; "
        "megatron and perseus are always planned: the reductions are measured against them)",
    )
    g.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default=FRAMEWORK_MEGATRON,
        help="pipeline schedule of the framework: megatron 1F1B (interleaved with --vp > 1) or "
        "DeepSpeed TrainSchedule (default megatron)",
    )
    g.add_argument(
        "--freqs",
        default=None,
        help="comma-separated SM clocks (MHz) to plan with (default: every "
        f"{CLOCK_GRID_STEP_MHZ} MHz from the max clock down to "
        f"{CLOCK_GRID_LOWEST_FRACTION * 100:.0f}%% of it)",
    )
    g.add_argument(
        "--timeline",
        default=None,
        metavar="NAME-NN",
        help="plan drawn in timeline.png (default: the suggested plan, iso-time: the kareus plan with the "
        "least energy no slower than Megatron's max-clock plan, as --kareus-point's default)",
    )
    g.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="the memory estimate shards the optimizer "
        "state over DP×CP (Megatron's --use-distributed-optimizer; default off)",
    )
    g.add_argument(
        "--cross-layer",
        action="store_true",
        help="model cross-layer overlap: each layer's last "
        "collective beside the other nanobatch's first segment of the next layer (the overlap engine "
        "runs it with and without --sp; with --cp such plans are refused at run time; default off)",
    )
    g.add_argument(
        "--max-swing",
        type=float,
        default=None,
        metavar="FRACTION",
        help="write only plans whose job power swings by at most FRACTION of its peak over an "
        "iteration (e.g. 0.3), holding blocked GPUs at a costed power floor where the clocks cannot "
        "(docs/power.md)",
    )
    g.add_argument(
        "--max-ramp",
        type=float,
        default=None,
        metavar="W_PER_S",
        help="write only plans whose job power rises or falls by at most W_PER_S watts per second "
        "over any 100 ms (docs/power.md)",
    )
    add_clock_latency_flag(g)
    g.add_argument(
        "--band-samples",
        type=int,
        default=BAND_DRAWS,
        metavar="N",
        help="draws of the cost model's parameters for the prediction bands (5th-95th percentile of every "
        f"point's time and energy and of every reduction; default {BAND_DRAWS}; 0: no bands)",
    )
    g.add_argument(
        "--objective",
        default=None,
        metavar="OBJ",
        help="what the suggested plan (drawn in timeline.png) meets: iso-time (default), min-energy, "
        "max-time=S or energy=J, as --kareus-objective",
    )
    g.add_argument(
        "--robust",
        action="store_true",
        help="the suggested plan meets --objective across the band (its 95th percentile), not at the point estimate",
    )
    g.add_argument(
        "--no-figures",
        action="store_true",
        help="write no PNG figures (frontier.png, power.png, timeline.png; about 1.4 s of a small plan): for "
        "scripts that read frontier.json and the plans, as the closed loop (--kareus-plan auto) does",
    )
    g.add_argument(
        "--no-memory-check",
        action="store_true",
        help="plan even if the memory estimate exceeds the "
        "GPU's (an emulated job, e.g. the published Llama 3.3 70B case)",
    )


def _parse_list(flag: str, text: str, cast: Any) -> list[Any]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{flag} {text!r} is empty; give a comma-separated list.")
    try:
        return [cast(x) for x in items]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: every item must be a {cast.__name__}.") from None


def _progress_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _plan(args: argparse.Namespace) -> tuple[Any, dict[str, Any], list[Any]]:
    """Validate the flags, plan every method (with a progress bar) and build the outputs."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kareus_megatron.cost import KernelModel, load_calibration
    from kareus_megatron.plan.build import build_outputs
    from kareus_megatron.search.planner import check_methods, plan_methods

    methods = check_methods(_parse_list("--methods", args.methods, str) if args.methods else METHODS)
    freqs = _parse_list("--freqs", args.freqs, int) if args.freqs else None
    if args.points < 2:
        raise ConfigError(f"--points {args.points}: need at least 2 (the fastest and the lowest-energy plan).")
    if args.max_time is not None and not args.max_time > 0:
        raise ConfigError(f"--max-time {args.max_time} must be a positive number of seconds.")
    given_latency_s = clock_latency_s(args)  # checked here, before any work
    if args.timeline is not None:
        method, _, nn = args.timeline.rpartition("-")
        if method not in methods or not (len(nn) == 2 and nn.isascii() and nn.isdigit()) or int(nn) >= args.points:
            raise ConfigError(
                f"--timeline {args.timeline!r} is not a plan this run writes; use METHOD-NN with METHOD one of "
                f"{', '.join(methods)} and NN below --points {args.points} (e.g. kareus-00)."
            )
    if args.band_samples < 0 or args.band_samples == 1:
        raise ConfigError(
            f"--band-samples {args.band_samples}: use 0 (no bands) or at least 2 draws (default {BAND_DRAWS})."
        )
    if args.robust and args.band_samples == 0:
        raise ConfigError("--robust picks by the bands, but --band-samples 0 turns them off; drop one of them.")
    if args.timeline is not None and (args.robust or args.objective is not None):
        flag = "--robust" if args.robust else "--objective"
        raise ConfigError(f"--timeline names the plan to draw, so {flag} has nothing to pick; drop one of them.")
    if args.objective is not None:
        from kareus_megatron.plan.objective import parse_objective

        parse_objective(args.objective, flag="--objective")
    from kareus_megatron.search.plan_power import PowerBound

    bound = PowerBound(max_swing=args.max_swing, max_ramp_w_per_s=args.max_ramp)
    from kareus_megatron.plan.io import check_output_dir

    check_output_dir(Path(args.out))
    gpu, model, par = workload_from_args(args)
    from kareus_megatron.cost.memory import check_fits, memory_summary

    stages = check_fits(
        gpu, model, par, distributed_optimizer=args.distributed_optimizer, refuse=not args.no_memory_check
    )  # refuses a job that does not fit the GPU
    memory = memory_summary(gpu, stages, args.distributed_optimizer)
    cal = load_calibration(args.calibration) if args.calibration else None
    kernel = KernelModel(gpu, cal)
    schedule = schedule_for(args.framework, par.vp)

    no_overlap = overlap_blocker(schedule)  # e.g. DeepSpeed: no nanobatch overlap engine (yet)
    notes = []  # printed once planning succeeded (bad input: one line only)
    if args.methods is None and (no_overlap or par.micro_batch_size % 2):
        methods.remove(NANOBATCH_PERSEUS)  # asked for by default only: skip it, say why
        why = no_overlap or f"2 nanobatches do not divide --mbs {par.micro_batch_size}"
        notes.append(f"note: {NANOBATCH_PERSEUS} skipped: {why}; kareus plans 1 nanobatch only.")
    if no_overlap and KAREUS in methods:
        notes.append(
            f"note: kareus plans SM clocks only (1 nanobatch) for {args.framework} until it has an overlap engine."
        )
    from kareus_megatron.search.segments import ClockLatency

    latency = None if given_latency_s is None else ClockLatency(given_latency_s)
    console = _progress_console()
    with Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task("planning", total=1.0)

        def report(msg: str, frac: float) -> None:
            bar.update(task, description=msg, completed=min(max(frac, 0.0), 1.0))

        result = plan_methods(
            gpu,
            model,
            par,
            kernel,
            methods=methods,
            points=args.points,
            schedule=schedule,
            max_time_s=args.max_time,
            clocks_mhz=freqs,
            calibration_sha256=cal.sha256 if cal else None,
            progress=report,
            cross_layer=args.cross_layer,
            bound=bound,
            clock_latency=latency,
        )
        draws = None
        if args.band_samples:
            bar.update(task, description="prediction bands")
            from kareus_megatron.cost.uncertainty import kernel_draws

            draws = kernel_draws(kernel, args.band_samples)
        bar.update(task, description="building plans")
        doc, built = build_outputs(result, memory=memory, draws=draws)
    if args.cross_layer and par.cp > 1:
        notes.append(
            "note: --cross-layer with --cp is a model only: the overlap engine runs cross-layer overlap "
            "without context parallelism and refuses these plans."
        )
    if args.cross_layer and par.recompute == "full":
        notes.append(
            "note: with --cross-layer and full recompute, run with --recompute-num-layers ≥ 2 (uniform): "
            "the overlap engine links layers only inside one recompute group."
        )
    for note in notes:
        console.print(note)
    return result, doc, built


def run(args: argparse.Namespace) -> int:
    """Plan, write the outputs atomically and print the summary table; 0 on success."""
    from kareus_megatron.cli.plan_output import previous_output, timeline_choice, write_outputs
    from kareus_megatron.cli.plan_summary import print_summary

    t0 = time.perf_counter()
    result, doc, built = _plan(args)
    chosen = timeline_choice(args, result, doc, built)
    out = Path(args.out).resolve()
    if args.max_time is not None:
        for name, mf in result.methods.items():
            if mf.time_s[0] > args.max_time:
                _progress_console().print(
                    f"note: {name} has no plan within --max-time {args.max_time:g} s; its fastest plan "
                    f"({mf.time_s[0]:.4g} s) is kept for reference."
                )
    previous = previous_output(out)
    write_outputs(out, doc, built, result, chosen, figures=not args.no_figures)
    print_summary(
        doc,
        out,
        built,
        chosen,
        time.perf_counter() - t0,
        suggested=args.timeline is None,
        objective=args.objective or "iso-time",
        robust=args.robust,
        figures=not args.no_figures,
    )
    sys.stdout.flush()
    if previous is not None:
        _progress_console().print(
            f"note: replaced the earlier output in {out} ({previous}); give --out another directory to keep both.",
            highlight=False,
            soft_wrap=True,
        )
    return 0
