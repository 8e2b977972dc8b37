"""`kareus solve`: the iteration time–energy frontier of a measured Perseus-format profile.

For users of the Perseus workflow: the profile (``stage,instruction,frequency,time,energy``; time s and
energy J of one GPU running one forward or backward of one microbatch at a locked SM clock, MHz) gives
every instruction its clock options; the pipeline solver (search/solver.py) finds the frontier. Writes,
under ``--out DIR``:

- ``frontier.json``: kareus-frontier/1 layout with one method, ``solve``, fastest point first;
- ``plans/solve-NN.json``: one kareus-plan/1 clock plan per point (NN = 00 is the fastest), built by
  plan/build.py like kareus plan's and recording ``--gpu`` and ``--p-blocked`` (so `kareus report` can use it);
  latency-aware as kareus plan's (``--clock-latency-ms``, default the GPU preset's: search/segments.py);
- with ``--zeus-format``, ``zeus/freqs_pipeline_NN.py``: the same plans as Python literals, one list of
  ``(instruction, frequency)`` per pipeline rank in execution order, the solution file that Zeus's
  pipeline frequency optimizer server replays (its ``PointSolution`` scheduler).

Everything is written to a temporary directory next to DIR and renamed into place.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kareus_megatron.cli.parsing import add_clock_latency_flag, clock_latency_s
from kareus_megatron.errors import ConfigError, ProfileError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search.schedules import instruction_order
from kareus_megatron.vocab import FLAT_SCHEDULES as SCHEDULES
from kareus_megatron.vocab import SCHEDULE_1F1B, SCHEDULE_DEEPSPEED, SOLVE

# lazy (`kareus --help` imports every command module): numpy (~60 ms), the solver (~350 ms), the plan and search
# modules (50–120 ms each) and rich (~18 ms).

# Upper bounds of the sizes (far above any real run; beyond them the DAG or the numbers blow up).
SOLVE_MAX = {
    "--pp": 2**12,
    "--microbatches": 2**14,
    "--points": 2**12,
    "--tp": 2**12,
    "--cp": 2**12,
    "--dp": 2**20,
    "--mbs": 2**14,
    "--seq": 2**20,
    "--nodes": 2**16,
    "--gpus-per-node": 2**10,
}
GPUS_PER_NODE = 8  # the default node, as kareus plan's (and kareus launch's reading of the plan)
HELP = "solve the pipeline time-energy frontier of a measured Perseus-format profile (CSV)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus solve` flags."""
    parser.add_argument(
        "--profile",
        required=True,
        metavar="FILE.csv",
        help="Perseus-format CSV: stage,instruction,frequency,time,energy (s, J of one GPU)",
    )
    parser.add_argument("--pp", type=int, required=True, metavar="S", help="pipeline stages (profile stages 0..S-1)")
    parser.add_argument("--microbatches", type=int, required=True, metavar="M", help="microbatches per iteration")
    parser.add_argument(
        "--p-blocked",
        type=float,
        default=83.64,
        metavar="W",
        help="power (W) of a GPU blocked on pipeline communication (default 83.64, A100)",
    )
    parser.add_argument("--points", type=int, default=10, metavar="N", help="frontier points to write (default 10)")
    add_clock_latency_flag(parser)
    parser.add_argument(
        "--out", default="kareus-solve", metavar="DIR", help="output directory (default ./kareus-solve)"
    )
    parser.add_argument(
        "--zeus-format",
        action="store_true",
        help="also write zeus/freqs_pipeline_NN.py for Zeus's pipeline frequency optimizer",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=SCHEDULE_1F1B,
        help=f"pipeline schedule the job runs (default {SCHEDULE_1F1B}; {SCHEDULE_DEEPSPEED} for DeepSpeed)",
    )
    parser.add_argument(
        "--p2p-time",
        type=float,
        default=0.0,
        metavar="S",
        help="P2P send/recv time (s) between stages (default 0, as in Perseus)",
    )
    parser.add_argument(
        "--max-time", type=float, default=None, metavar="S", help="drop plans slower than this iteration time (s)"
    )
    g = parser.add_argument_group("the job the plans run (required: the runtime checks each against the live job)")
    g.add_argument(
        "--gpu",
        required=True,
        metavar="PRESET",
        help="GPU the profile was measured on, a preset name (kareus env lists them; e.g. a100-sxm4-40gb); "
        "its lockable clocks must include every profiled frequency",
    )
    g.add_argument(
        "--mbs",
        "--micro-batch-size",
        dest="micro_batch_size",
        type=int,
        required=True,
        help="micro-batch size of the profiled job",
    )
    g.add_argument(
        "--seq", "--seq-length", dest="seq_length", type=int, required=True, help="sequence length of the profiled job"
    )
    g.add_argument(
        "--layers-per-stage",
        required=True,
        metavar="L0,L1,...",
        help="transformer layers of each pipeline stage (one integer per stage)",
    )
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    g.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes of the job (default: as many as TP×CP×PP×DP needs, --gpus-per-node each)",
    )
    g.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help=f"GPUs per node (default {GPUS_PER_NODE}; with --nodes alone: the GPUs split evenly)",
    )


def node_shape(world: int, nodes: int | None, gpus_per_node: int | None) -> tuple[int, int]:
    """(nodes, GPUs per node) of a job of `world` GPUs: as given, else nodes of GPUS_PER_NODE (one node of
    `world` when it is smaller); ConfigError when they do not multiply to `world`."""
    if nodes is None:
        per = gpus_per_node or GPUS_PER_NODE
        if world <= per:
            return 1, world
        if world % per:
            raise ConfigError(
                f"the job's {world} GPUs (tp x cp x dp x pp) do not fill whole nodes of {per} GPUs; "
                "set --nodes and --gpus-per-node to match"
            )
        return world // per, per
    if gpus_per_node is None:
        if world % nodes:
            raise ConfigError(f"--nodes {nodes} does not divide the job's {world} GPUs (tp x cp x dp x pp)")
        return nodes, world // nodes
    if nodes * gpus_per_node != world:
        raise ConfigError(
            f"--nodes {nodes} x --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} GPUs, but "
            f"the job has {world} (tp x cp x dp x pp)"
        )
    return nodes, gpus_per_node


def _check_args(args: argparse.Namespace) -> list[int]:
    for flag, v in (
        ("--pp", args.pp),
        ("--microbatches", args.microbatches),
        ("--points", args.points),
        ("--tp", args.tp),
        ("--cp", args.cp),
        ("--dp", args.dp),
        ("--mbs", args.micro_batch_size),
        ("--seq", args.seq_length),
        ("--nodes", args.nodes or 1),
        ("--gpus-per-node", args.gpus_per_node or 1),
    ):
        if v < 1:
            raise ConfigError(f"{flag} {v} must be a positive integer")
        if v > SOLVE_MAX[flag]:
            raise ConfigError(f"{flag} {v} is too large; at most {SOLVE_MAX[flag]}")
    if not (args.p_blocked >= 0 and args.p_blocked < float("inf")):
        raise ConfigError(f"--p-blocked {args.p_blocked} must be a finite power >= 0 W (A100: 83.64)")
    if args.max_time is not None and not (0 < args.max_time < float("inf")):
        raise ConfigError(f"--max-time {args.max_time} must be a finite time > 0 s")
    if not (args.p2p_time >= 0 and args.p2p_time < float("inf")):
        raise ConfigError(f"--p2p-time {args.p2p_time} must be a finite time >= 0 s")
    args.nodes, args.gpus_per_node = node_shape(args.tp * args.cp * args.dp * args.pp, args.nodes, args.gpus_per_node)

    args.clock_latency_s = clock_latency_s(args, gpu_spec(args.gpu).clock_latency_s)  # unknown preset: one line
    try:
        layers = [int(x) for x in args.layers_per_stage.split(",")]
    except ValueError:
        raise ConfigError(f"--layers-per-stage {args.layers_per_stage!r} must be comma-separated integers") from None
    if len(layers) != args.pp or min(layers) < 1:
        raise ConfigError(
            f"--layers-per-stage needs {args.pp} positive integers (one per stage), got {args.layers_per_stage!r}"
        )
    return layers


def stage_options(profile: Any, pp: int) -> dict[tuple[int, str], Any]:
    """(stage, instruction) -> options (frequency MHz, time s, energy J; fastest first); ProfileError if incomplete."""
    import numpy as np

    have = set(profile.series())
    extra = sorted({s for s, _ in have if s >= pp})
    if extra:
        raise ProfileError(
            f"{profile.source} has stage(s) {extra} but --pp is {pp}; pass --pp {max(extra) + 1} "
            "or a profile of stages 0..pp-1."
        )
    out = {}
    for s in range(pp):
        for kind in ("forward", "backward"):
            if (s, kind) not in have:
                raise ProfileError(
                    f"{profile.source} has no {kind} rows for stage {s}; profile every stage "
                    f"0..{pp - 1} for both forward and backward."
                )
            f, t, e = profile.select(s, kind)
            order = np.lexsort((e, t))
            out[(s, kind)] = SimpleNamespace(clock_mhz=f[order], time_s=t[order], energy_j=e[order])
    return out


def zeus_solution_text(plan: Any) -> str:
    """A Zeus PointSolution file: per rank, [(instruction, frequency MHz), ...] in execution order."""
    lines = [
        f"# kareus solve: predicted iteration time {plan.predicted.iteration_time_s:.6f} s, "
        f"energy {plan.predicted.iteration_energy_j:.3f} J (all GPUs)",
        "[",
    ]
    for st in plan.stages:
        lines.append("[" + ", ".join(f"({i.kind!r}, {i.sm_clock_mhz})" for i in st.instructions) + "],")
    lines.append("]")
    return "\n".join(lines) + "\n"


def solve_profile(
    args: argparse.Namespace, layers: list[int], progress: Any = None
) -> tuple[dict[str, Any], list[Any]]:
    """Solve the frontier; return the frontier document and the plans, fastest first."""
    import numpy as np

    from kareus_megatron.cost.profile import read_perseus_profile
    from kareus_megatron.plan.build import solved_plan
    from kareus_megatron.plan.points import plan_relpath
    from kareus_megatron.plan.schema import FRONTIER_FORMAT, ParallelLayout
    from kareus_megatron.search.frontier import pareto_indices
    from kareus_megatron.search.pipeline import build_dag
    from kareus_megatron.search.planner import select_points
    from kareus_megatron.search.segments import ClockLatency, latency_aware_plans
    from kareus_megatron.search.simulate import simulate_choice
    from kareus_megatron.search.solver import solve_frontier

    profile = read_perseus_profile(args.profile)
    opts = stage_options(profile, args.pp)
    spec = gpu_spec(args.gpu)
    bad = sorted({int(f) for o in opts.values() for f in o.clock_mhz} - set(spec.sm_clocks_mhz))
    if bad:
        raise ProfileError(
            f"{args.profile} has frequencies {', '.join(map(str, bad[:5]))}"
            f"{' ...' if len(bad) > 5 else ''} MHz that {spec.name} cannot lock "
            f"({spec.min_sm_clock_mhz}..{spec.max_sm_clock_mhz} MHz); was it measured on another GPU?"
        )
    dag = build_dag(instruction_order(args.schedule, args.pp, args.microbatches), args.p2p_time)
    node_opts = [opts[(s, kind)] for s, kind, _, _ in dag.keys]
    gpus = args.tp * args.cp * args.dp
    plans = solve_frontier(
        dag,
        node_opts,
        args.p_blocked,
        gpus_per_stage=gpus,
        points=args.points,
        max_time_s=args.max_time,
        progress=progress,
    )
    latency = ClockLatency(args.clock_latency_s) if args.clock_latency_s else None
    if latency is not None:  # segments the controller can apply, raises ahead, the lag in time and energy
        aware = latency_aware_plans(dag, node_opts, plans, args.p_blocked, gpus, latency)
        keep = pareto_indices(np.array([p.time_s for p in aware]), np.array([p.energy_j for p in aware]))
        if args.max_time is not None:  # the lag can make a plan within --max-time slower than it
            keep = keep[np.array([aware[i].time_s <= args.max_time * (1 + 1e-12) for i in keep], dtype=bool)]
            if not keep.size:
                raise ConfigError(
                    f"--max-time {args.max_time:g} s: with the lag of a {latency.latency_s * 1e3:g} ms clock change "
                    "no plan is that fast; raise --max-time or plan with --clock-latency-ms 0"
                )
        spread = select_points(np.array([aware[i].time_s for i in keep]), args.points)  # both forms: up to 2x
        plans = [aware[keep[j]] for j in spread]
    layout = ParallelLayout(
        tp=args.tp,
        cp=args.cp,
        pp=args.pp,
        vp=1,
        dp=args.dp,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        num_microbatches=args.microbatches,
        layers_per_stage=tuple(layers),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        schedule=args.schedule,
    )
    out_plans = [
        solved_plan(
            dag,
            node_opts,
            sp,
            method=SOLVE,
            gpu=args.gpu,
            parallel=layout,
            p_blocked_w=args.p_blocked,
            clock_latency=latency,
        )
        for sp in plans
    ]
    points = [
        {"time_s": sp.time_s, "energy_j": sp.energy_j, "plan": plan_relpath(SOLVE, nn)} for nn, sp in enumerate(plans)
    ]
    top = simulate_choice(dag, node_opts, np.zeros(dag.n, dtype=int), args.p_blocked, gpus)
    doc = {
        "format": FRONTIER_FORMAT,
        "config": {
            "profile": str(args.profile),
            "pp": args.pp,
            "num_microbatches": args.microbatches,
            "schedule": args.schedule,
            "p_blocked_w": args.p_blocked,
            "p2p_time_s": args.p2p_time,
            "tp": args.tp,
            "cp": args.cp,
            "dp": args.dp,
            "gpu": args.gpu,
            "clock_latency_s": args.clock_latency_s,
            "max_clock": {"time_s": top.time_s, "energy_j": top.energy_j},
        },
        "methods": {SOLVE: {"points": points}},
        "reductions": {},
    }
    return doc, out_plans


def _write(out: Path, doc: dict[str, Any], plans: list[Any], zeus: bool) -> None:
    from kareus_megatron.plan.io import replace_directory, save_plan, write_json_atomic
    from kareus_megatron.plan.points import plan_relpath

    with replace_directory(out) as tmp:
        write_json_atomic(tmp / "frontier.json", doc)
        for nn, plan in enumerate(plans):
            save_plan(plan, tmp / plan_relpath(SOLVE, nn))
            if zeus:
                (tmp / "zeus").mkdir(exist_ok=True)
                (tmp / "zeus" / f"freqs_pipeline_{nn:02d}.py").write_text(zeus_solution_text(plan))


def run(args: argparse.Namespace) -> int:
    """Solve the profile's frontier, write DIR and print a table; exit 0."""
    layers = _check_args(args)
    out = Path(args.out)
    from kareus_megatron.plan.io import check_output_dir

    check_output_dir(out)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("solving frontier"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task("solve", total=1.0)
        doc, plans = solve_profile(args, layers, lambda f: bar.update(task, completed=f))
    _write(out, doc, plans, args.zeus_format)
    ref = doc["config"]["max_clock"]
    print(f"kareus solve: {args.pp} stages x {args.microbatches} microbatches, {len(plans)} plans -> {out}/")
    print(f"{'plan':>10} {'time (s)':>10} {'energy (J)':>12} {'vs max clock':>13}")
    print(f"{'max clock':>10} {ref['time_s']:10.4f} {ref['energy_j']:12.1f} {'':>13}")
    for nn, p in enumerate(doc["methods"][SOLVE]["points"]):
        saving = (ref["energy_j"] - p["energy_j"]) / ref["energy_j"]
        print(f"{'solve-' + format(nn, '02d'):>10} {p['time_s']:10.4f} {p['energy_j']:12.1f} {-100 * saving:+12.1f}%")
    return 0
