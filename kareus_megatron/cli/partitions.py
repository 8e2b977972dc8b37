"""`kareus partitions`: each nanobatch partition's time–energy frontier and chosen knobs at one SM clock.

Per layer and one GPU, for every partition (``fwd_attn``, ``bwd_mlp``, ...; see kareus_megatron/vocab.py)
the Pareto set over its knobs (comm SMs × launch slot) at ``--freq`` MHz; the fastest knob is the one
the joint search uses when that instruction is on the critical path. Then, per instruction, the cost
with 1 nanobatch, with 2 nanobatches on NCCL's defaults, the joint fastest, and optionally the
configuration given with ``--overlap NAME=SMS@SLOT,...`` (e.g. ``fwd_attn=12@qkv,fwd_mlp=21@fc1``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kareus_megatron.cli.workload_args import add_workload_arguments, workload_from_args
from kareus_megatron.errors import ConfigError

# lazy (`kareus --help` imports every command module): the cost model and the search modules (50–80 ms each) and
# rich (~18 ms).

HELP = "show each nanobatch partition's time-energy frontier and chosen overlap knobs at one SM clock"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the workload flags plus --freq, --nanobatches, --overlap and --format."""
    add_workload_arguments(parser)
    parser.add_argument("--freq", type=int, default=None, help="SM clock (MHz); default: the GPU's max clock")
    parser.add_argument("--nanobatches", type=int, default=2, help="nanobatches per microbatch (1 or 2; default 2)")
    parser.add_argument(
        "--overlap",
        default=None,
        help="overlap configuration to evaluate: NAME=SMS@SLOT,... e.g. fwd_attn=12@qkv,fwd_mlp=21@fc1",
    )
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format")


def run(args: argparse.Namespace) -> int:
    """Print the partition frontiers and instruction summary at one clock; return the exit status."""
    from kareus_megatron.cost.calibration import load_calibration
    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.search import options as opt

    gpu, model, par = workload_from_args(args)
    freq = gpu.check_clocks([args.freq])[0] if args.freq is not None else gpu.max_sm_clock_mhz
    nb = opt.check_nanobatches(par, args.nanobatches)
    config = None
    if args.overlap is not None:
        config = check_overlap(parse_overlap(args.overlap), gpu, model, par, nb)
    cal = load_calibration(args.calibration) if args.calibration else None
    tables = opt.LayerTables(gpu, model, par, KernelModel(gpu, cal), (freq,))
    if nb == 2 and tables.overlap_error is not None:
        raise tables.overlap_error
    frontiers = opt.partition_frontiers(tables, freq) if nb == 2 else []
    rows = []
    for stage in range(par.pp):
        for chunk in range(par.vp):
            for kind in ("forward", "backward"):
                rows.append(_instruction_row(tables, stage, chunk, kind, freq, nb, config))
    doc = {
        "gpu": gpu.name,
        "model": model.name,
        "clock_mhz": int(freq),
        "nanobatches": nb,
        "parallel": {
            "tp": par.tp,
            "cp": par.cp,
            "pp": par.pp,
            "vp": par.vp,
            "dp": par.dp,
            "micro_batch_size": par.micro_batch_size,
            "seq_length": par.seq_length,
            "recompute": par.recompute,
        },
        "default_comm_sms": tables.adapter.default_sms,
        "partitions": [_frontier_dict(f) for f in frontiers],
        "instructions": rows,
    }
    if args.format == "json":
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_tables(doc)
    return 0


def parse_overlap(text: str) -> dict[str, tuple[int, str]]:
    """Parse an overlap configuration ``NAME=SMS@SLOT[,NAME=SMS@SLOT...]`` into name → (comm SMs, slot).

    Example: ``fwd_attn=12@qkv,fwd_mlp=21@fc1``. Only the syntax is checked here; check_overlap checks
    names, slots and SM counts against a layout.
    """
    out: dict[str, tuple[int, str]] = {}
    items = [s.strip() for s in str(text).split(",")]
    if not any(items):
        raise ConfigError("--overlap is empty; give NAME=SMS@SLOT items separated by commas, e.g. fwd_attn=12@qkv.")
    for item in items:
        name, eq, rest = item.partition("=")
        sms, at, slot = rest.partition("@")
        name, sms, slot = name.strip(), sms.strip(), slot.strip()
        if not eq or not at or not name or not slot:
            raise ConfigError(f"--overlap item {item!r} is malformed; write NAME=SMS@SLOT, e.g. fwd_attn=12@qkv.")
        if not sms.isdecimal() or not sms.isascii():
            raise ConfigError(
                f"--overlap item {item!r}: comm SMs {sms!r} must be a positive integer, e.g. fwd_attn=12@qkv."
            )
        if name in out:
            raise ConfigError(f"--overlap names partition {name!r} twice; give each partition once.")
        out[name] = (int(sms), slot)
    return out


def check_overlap(
    config: dict[str, tuple[int, str]], gpu: Any, model: Any, par: Any, nanobatches: int = 2
) -> dict[str, tuple[int, str]]:
    """The config unchanged if every partition, slot and SM count fits the layout; ConfigError otherwise."""
    if nanobatches < 2:
        raise ConfigError("--overlap needs --nanobatches 2: with 1 nanobatch nothing overlaps; drop --overlap.")
    from kareus_megatron.search.partition import layout_slots

    slots = layout_slots(model, par, nanobatches)
    for name, (sms, slot) in config.items():
        if name not in slots:
            raise ConfigError(
                f"--overlap names partition {name!r}, which this layout does not have; partitions: {', '.join(slots)}."
            )
        if slot not in slots[name]:
            raise ConfigError(
                f"--overlap {name}: launch slot {slot!r} is not an op of that partition; "
                f"slots: {', '.join(slots[name])}."
            )
        if not 1 <= sms < gpu.sm_count:
            raise ConfigError(
                f"--overlap {name}: {sms} comm SMs; {gpu.name} has {gpu.sm_count} SMs, so use 1..{gpu.sm_count - 1}."
            )
    return config


def _point(t: float, e: float, **extra) -> dict:
    return {"time_s": float(t), "energy_j": float(e), **extra}


def _frontier_dict(f) -> dict:
    pts = [_point(t, e, comm_sms=int(s), slot=sl) for t, e, s, sl in zip(f.time_s, f.energy_j, f.comm_sms, f.slot)]
    default = _point(f.default_time_s, f.default_energy_j, comm_sms=f.default_knob[0], slot=f.default_knob[1])
    return {
        "phase": f.phase,
        "partition": f.name,
        "instances_per_layer": f.instances,
        "slots": list(f.slots),
        "comm_sms_range": list(f.comm_sms_range),
        "frontier": pts,
        "fastest": pts[0],
        "least_energy": pts[-1],
        "nccl_default": default,
    }


def _instruction_row(tables, stage: int, chunk: int, kind: str, freq: int, nb: int, config) -> dict:
    from kareus_megatron.search import options as opt

    ci = int((tables.clocks_mhz == freq).nonzero()[0][0])
    t1, e1 = tables.sequential(stage, chunk, kind)
    row = {"stage": stage, "chunk": chunk, "kind": kind, "sequential": _point(t1[ci], e1[ci])}
    if nb == 2:
        td, ed, dd = tables.overlapped(stage, chunk, kind, ci, default_only=True)
        tj, ej, dj = tables.overlapped(stage, chunk, kind, ci)
        row["nanobatch_default"] = _point(td[0], ed[0], partitions=_knobs(dd[0]))
        row["joint_fastest"] = _point(tj[0], ej[0], partitions=_knobs(dj[0]))
        row["joint_least_energy"] = _point(tj[-1], ej[-1], partitions=_knobs(dj[-1]))
        if config is not None:
            tg, eg = opt.evaluate_overlap(tables, stage, chunk, kind, freq, config)
            row["given"] = _point(tg, eg)
    return row


def _knobs(d: dict) -> dict:
    return {k: {"comm_sms": int(v[0]), "slot": v[1]} for k, v in d.items()}


def _print_tables(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    p = doc["parallel"]
    head = (
        f"{doc['model']} on {doc['gpu']} at {doc['clock_mhz']} MHz: TP={p['tp']} CP={p['cp']} PP={p['pp']} "
        f"MBS={p['micro_batch_size']} seq={p['seq_length']} recompute={p['recompute']}, "
        f"{doc['nanobatches']} nanobatch(es); NCCL default {doc['default_comm_sms']} comm SMs"
    )
    console = Console(width=130)
    if doc["partitions"]:
        table = Table(title=f"{head}\npartition knob frontiers, one layer, one GPU (fastest first)")
        for col in ("phase", "partition", "inst./layer", "comm SMs", "slot", "time (ms)", "energy (J)", ""):
            table.add_column(col, justify="right")
        for f in doc["partitions"]:
            for i, pt in enumerate(f["frontier"]):
                mark = "fastest" if i == 0 else ("least energy" if i == len(f["frontier"]) - 1 else "")
                if i == 0 and len(f["frontier"]) == 1:
                    mark = "fastest, least energy"
                table.add_row(
                    f["phase"] if i == 0 else "",
                    f["partition"] if i == 0 else "",
                    str(f["instances_per_layer"]) if i == 0 else "",
                    str(pt["comm_sms"]),
                    pt["slot"],
                    f"{pt['time_s'] * 1e3:.3f}",
                    f"{pt['energy_j']:.4f}",
                    mark,
                )
            d = f["nccl_default"]
            table.add_row(
                "",
                "",
                "",
                str(d["comm_sms"]),
                d["slot"],
                f"{d['time_s'] * 1e3:.3f}",
                f"{d['energy_j']:.4f}",
                "[dim]NCCL default (nanobatching baseline)[/dim]",
            )
        console.print(table)
    else:
        console.print(head + "\nwith 1 nanobatch the layer has no partitions (every collective is exposed).")
    table = Table(title="instructions (one GPU): time (s) / energy (J)")
    cols = ["stage", "chunk", "kind", "1 nanobatch"]
    if doc["nanobatches"] == 2:
        cols += ["2 nb, NCCL defaults", "joint fastest", "joint least energy"]
        if any("given" in r for r in doc["instructions"]):
            cols.append("--overlap")
    for col in cols:
        table.add_column(col, justify="right")
    keys = ["sequential", "nanobatch_default", "joint_fastest", "joint_least_energy", "given"][: len(cols) - 3]
    for r in doc["instructions"]:
        cells = [f"{r[k]['time_s']:.5f} / {r[k]['energy_j']:.3f}" for k in keys]
        table.add_row(str(r["stage"]), str(r["chunk"]), r["kind"], *cells)
    console.print(table)
