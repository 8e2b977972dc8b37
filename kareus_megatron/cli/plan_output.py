"""`kareus plan`'s outputs: which plan timeline.png draws, and frontier.json, the plan files and the plots, written
into a temporary directory next to --out and swapped into place (cli/plan.py plans, cli/plan_summary.py prints).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kareus_megatron.errors import PlanError
from kareus_megatron.plotting.units import energy_unit, time_unit
from kareus_megatron.vocab import KAREUS, MEGATRON


def timeline_choice(args: argparse.Namespace, result: Any, doc: dict[str, Any], built: list[Any]) -> Any:
    """The plan timeline.png draws: --timeline's, else the kareus plan --objective (default iso-time) picks, as
    --kareus-point's default would."""
    by_name = {b.name: b for b in built}
    if args.timeline is not None:
        if args.timeline not in by_name:
            have = ", ".join(b.name for b in built if b.method == args.timeline.split("-")[0])
            raise PlanError(f"--timeline {args.timeline}: that method has fewer plans; written: {have}.")
        return by_name[args.timeline]
    from kareus_megatron.plan.objective import ISO_TIME, frontier_choice, parse_objective
    from kareus_megatron.plan.points import frontier_point, reference_points

    method = KAREUS if KAREUS in result.methods else list(result.methods)[-1]
    pts = doc["methods"][method]["points"]  # the iso-time point by default, as --kareus-point's default picks it
    points = [frontier_point(method, i, args.out, p) for i, p in enumerate(pts)]
    chosen = frontier_choice(
        points,
        parse_objective(args.objective or ISO_TIME, flag="--objective"),
        reference=reference_points(doc, args.out),  # robust: its band, Megatron's plan moves with the parameters
        robust=args.robust,
        fastest_if_none=args.objective is None,  # none as fast as Megatron: the fastest, as --kareus-point
    )
    return by_name[f"{method}-{chosen.index:02d}"]


def write_outputs(
    out: Path, doc: dict[str, Any], built: list[Any], result: Any, chosen: Any, figures: bool = True
) -> None:
    """Write every output into a temporary directory next to `out`, then swap it into place (figures: the PNGs)."""
    from kareus_megatron.cli.plan_summary import quantity
    from kareus_megatron.plan.io import replace_directory, save_plan, write_json_atomic
    from kareus_megatron.plotting.frontier import method_label, save_frontier_png
    from kareus_megatron.plotting.timeline import Bar, save_timeline_png, trace_events

    with replace_directory(out) as tmp:
        write_json_atomic(tmp / "frontier.json", doc)
        for b in built:
            save_plan(b.plan, tmp / b.relpath)
        cfg = doc["config"]
        title = (
            f"{cfg['model']} on {cfg['nodes']}×{cfg['gpus_per_node']} {cfg['gpu']}, TP={cfg['tp']} "
            f"CP={cfg['cp']} PP={cfg['pp']}, MBS={cfg['micro_batch_size']}, seq {cfg['seq_length']},\n"
            f"{cfg['num_microbatches']} microbatches (model predictions)"
        )
        opts = result.methods[chosen.method].options
        bars = []
        for ti in chosen.timeline:
            kind, mb, chunk = ti.key
            o = opts[(ti.rank, chunk, kind)]
            bars.append(
                Bar(
                    rank=ti.rank,
                    start_s=ti.start_s,
                    end_s=ti.end_s,
                    clock_mhz=int(o.clock_mhz[ti.option]),
                    kind=kind,
                    microbatch=mb,
                    chunk=chunk,
                    nanobatches=int(o.nanobatches[ti.option]),
                )
            )
        write_json_atomic(tmp / "timeline.trace.json", trace_events(bars, name=chosen.name))
        if not figures:
            return
        curves = {m: (mf.time_s.tolist(), mf.energy_j.tolist()) for m, mf in result.methods.items()}
        save_frontier_png(tmp / "frontier.png", doc, curves=curves, title=title)
        from kareus_megatron.plotting.power import save_power_png

        save_power_png(tmp / "power.png", power_curves(result, built, chosen), title=title)
        p = chosen.plan.predicted
        save_timeline_png(
            tmp / "timeline.png",
            bars,
            title=f"{chosen.name} ({method_label(chosen.method)}): {quantity(p.iteration_time_s, time_unit)}, "
            f"{quantity(p.iteration_energy_j, energy_unit)} per iteration; hatched = 2 nanobatches",
        )


def power_curves(result: Any, built: list[Any], chosen: Any) -> dict[str, tuple[Any, Any]]:
    """Two iterations of the job's predicted power (t s, W) of Megatron's fastest plan and the chosen plan."""
    import numpy as np

    from kareus_megatron.search.plan_power import timeline_parts, waveform_w

    picks = [b for b in built if b.method == MEGATRON and b.frontier_index == 0][:1]
    picks += [b for b in built if b is chosen and b.method != MEGATRON]
    out = {}
    for b in picks:
        t_s = b.plan.predicted.iteration_time_s
        a, blocked, step = timeline_parts(b.timeline, result.par.pp, t_s, result.gpus_per_stage)
        p = np.tile(waveform_w(a, blocked, result.p_blocked_w, b.plan.power_floor_w), 2)
        out[b.name] = ((np.arange(p.size) + 0.5) * step, p)
    return out


def previous_output(out: Path) -> str | None:
    """What an existing kareus output in `out` planned (check_output_dir refused any other content); else None."""
    frontier = out / "frontier.json"
    if not frontier.is_file():
        return None
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(frontier.stat().st_mtime))
    try:
        cfg = json.loads(frontier.read_text())["config"]
        return f"{cfg['model']} on {cfg['nodes']} × {cfg['gpus_per_node']} {cfg['gpu']}, written {when}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"written {when}"
