"""Plan every method of one training configuration: options → pipeline DAG → frontier → chosen points.

Terms:

- *method*: ``megatron`` (max clock, no overlap), ``perseus`` (clock per instruction),
  ``nanobatch_perseus`` (2 nanobatches, default overlap, clock per instruction), ``kareus`` (joint),
  ``powercap`` (one power limit W for every GPU; search/powercap.py: one plan per cap, no solver).
- *options*: per (stage, chunk, kind) the Pareto set of one GPU's (time s, energy J) choices of an
  instruction (``search.options``); every microbatch of that instruction picks from the same set.
- *frontier*: the solver's discrete plans of the pipeline, sorted fastest first (time = iteration time s,
  energy = GPU energy of the whole job per iteration J: instructions + blocked power in every wait).
- *chosen points*: the plans written to files: always the fastest and the lowest-energy plan, the two
  plans that decide the reductions against Perseus (docs/sources.md#kareus-evaluation), and the rest
  spread evenly in time.

This module returns plain data; ``plan.build`` turns it into plan files (plan/ comes after search/).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kareus_megatron.errors import ConfigError, InfeasibleConfigError, PlanError
from kareus_megatron.search.schedules import InstrKey, instruction_order, overlap_blocker
from kareus_megatron.vocab import (
    ISO_REL_TOL,
    KAREUS,
    MEGATRON,
    METHODS,
    NANOBATCH_PERSEUS,
    PERSEUS,
    POWERCAP,
    REFERENCE_METHODS,
    SCHEDULE_1F1B,
    MethodName,
    ScheduleName,
)

OptionKey = tuple[int, int, str]  # (stage, chunk, kind)
Progress = Callable[[str, float], None]  # (message, fraction of the work done 0..1)


@dataclass(frozen=True, kw_only=True, slots=True)
class TimedInstruction:
    """One executed instruction of a plan: rank, key, chosen option, start/end (s), one GPU's energy (J)."""

    rank: int
    key: InstrKey  # (kind, microbatch, chunk)
    option: int
    start_s: float
    end_s: float
    energy_j: float


@dataclass(kw_only=True, slots=True)
class MethodFrontier:
    """The whole frontier of one method, fastest first, and the indices of the chosen points."""

    method: MethodName
    options: Mapping[OptionKey, Any]
    plans: list[Any]  # SolvedPlan: .choice, .time_s, .energy_j
    time_s: np.ndarray
    energy_j: np.ndarray
    chosen: list[int] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class PlanningResult:
    """Everything one planning run found; inputs kept so plans can be built and re-simulated."""

    gpu: Any
    model: Any
    par: Any
    schedule: ScheduleName
    orders: list[list[InstrKey]]
    dag: Any
    p2p_time_s: float
    dp_reduce_time_s: float | None
    p_blocked_w: float
    gpus_per_stage: int
    methods: dict[MethodName, MethodFrontier]
    calibration_sha256: str | None = None
    cross_layer: bool = False  # the 2-nanobatch options model cross-layer overlap (search/partition.py)
    bound: Any = None  # search.plan_power.PowerBound the frontiers respect (None: unbounded)
    # search.segments.ClockLatency the clock plans assume (None: clock changes take effect at once)
    clock_latency: Any = None


def check_methods(methods: Sequence[str]) -> list[MethodName]:
    """The methods to plan, in canonical order, with the reference methods added."""
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ConfigError(f"unknown method(s) {', '.join(bad)}; known: {', '.join(METHODS)}")
    wanted = set(methods) | set(REFERENCE_METHODS)
    return [m for m in METHODS if m in wanted]


def select_points(time_s: np.ndarray, n: int, must: Sequence[int] = (), allowed: int | None = None) -> list[int]:
    """Indices (sorted) of at most `n` >= 2 points of a time-sorted frontier, spread evenly in time.

    The fastest and the last allowed point (lowest energy) always stay; then the `must` indices in order
    while room is left; the rest are added one by one, each the point farthest in time from those chosen.
    `allowed` limits the candidates to the first `allowed` points (a time budget).
    """
    t = np.asarray(time_s, float)
    count = t.size if allowed is None else max(1, min(allowed, t.size))
    chosen = sorted({0, count - 1})
    for i in must:
        if len(chosen) < n and 0 <= i < count and i not in chosen:
            chosen.append(int(i))
    while len(chosen) < min(n, count):
        dist = np.min(np.abs(t[:count, None] - t[chosen][None, :]), axis=1)
        dist[chosen] = -1.0
        chosen.append(int(np.argmax(dist)))
    return sorted(chosen)


def reduction_indices(time_s: np.ndarray, energy_j: np.ndarray, ref_time_s: float, ref_energy_j: float) -> list[int]:
    """Frontier points that decide the iso-time and iso-energy reductions (docs/sources.md#kareus-evaluation).

    `ref_time_s` is the reference's fastest time; `ref_energy_j` its lowest energy. Returns the index of the
    lowest-energy point with T <= ref_time_s and of the fastest point with E <= ref_energy_j, where they exist.
    """
    out = []
    tol = ISO_REL_TOL  # as plan/frontier.py's reductions, so the chosen points reproduce them
    ok_t = np.flatnonzero(time_s <= ref_time_s * (1 + tol))
    if ok_t.size:
        out.append(int(ok_t[np.argmin(energy_j[ok_t])]))
    ok_e = np.flatnonzero(energy_j <= ref_energy_j * (1 + tol))
    if ok_e.size:
        out.append(int(ok_e[np.argmin(time_s[ok_e])]))
    return out


def choose_points(methods: Mapping[MethodName, MethodFrontier], points: int, max_time_s: float | None = None) -> None:
    """Fill `chosen` of every method: fastest, lowest energy, the reduction points, spread in time.

    With `max_time_s`, only plans no slower than it are chosen; a method with none keeps its fastest plan
    (for reference). Raises PlanError when no method has a plan within `max_time_s`.
    """
    if points < 2:
        raise ConfigError(f"--points {points}: need at least 2 (the fastest and the lowest-energy plan)")
    if max_time_s is not None:
        fastest = min(float(m.time_s[0]) for m in methods.values())
        if not max_time_s >= fastest:
            raise PlanError(
                f"--max-time {max_time_s:g} s is below the fastest plan of any method ({fastest:.4g} s); "
                f"use --max-time >= {fastest:.4g} or leave it out"
            )
    ref = methods[PERSEUS]
    ref_t, ref_e = float(ref.time_s[0]), float(np.min(ref.energy_j))
    for m in methods.values():
        allowed = None
        if max_time_s is not None:
            allowed = int(np.searchsorted(m.time_s, max_time_s * (1 + 1e-12), side="right"))
        must = reduction_indices(m.time_s, m.energy_j, ref_t, ref_e)
        m.chosen = select_points(m.time_s, points, must=must, allowed=allowed)


def _frontier_arrays(plans: Sequence[Any]) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """Sort solver plans fastest first and keep only the non-dominated ones."""
    from kareus_megatron.search.frontier import pareto_indices

    t = np.array([p.time_s for p in plans], float)
    e = np.array([p.energy_j for p in plans], float)
    keep = pareto_indices(t, e)
    return [plans[i] for i in keep], t[keep], e[keep]


def pipeline_comm_times_s(model: Any, par: Any, kernel: Any) -> tuple[float, float | None]:
    """(P2P send/recv time s of one microbatch, DP gradient reduction time s or None) of the layout.

    P2P: the slowest stage boundary (NVLink inside a node, the network between nodes) on NCCL's default
    comm SMs at the max clock. DP: the slowest stage's gradient reduction, None without DP×CP > 1.
    """
    from kareus_megatron.workload.opgraph import dp_grad_ops, p2p_op

    sms = kernel.params.default_comm_sms
    bounds = range(par.pp - 1) if par.pp > 1 else ()
    p2p = max((float(kernel.collective_time_s(p2p_op(model, par, s), sms)) for s in bounds), default=0.0)
    dp = [sum(float(kernel.collective_time_s(op, sms)) for op in dp_grad_ops(model, par, s)) for s in range(par.pp)]
    return p2p, (max(dp) if any(dp) else None)


def node_options(dag: Any, options: Mapping[OptionKey, Any]) -> list[Any]:
    """Options of every DAG node (stage, kind, microbatch, chunk), from options keyed (stage, chunk, kind)."""
    return [options[(s, c, kind)] for s, kind, _mb, c in dag.keys]


def plan_methods(
    gpu: Any,
    model: Any,
    par: Any,
    kernel: Any,
    *,
    methods: Sequence[str] = METHODS,
    points: int = 10,
    schedule: ScheduleName = SCHEDULE_1F1B,
    max_time_s: float | None = None,
    clocks_mhz: Sequence[int] | None = None,
    calibration_sha256: str | None = None,
    progress: Progress | None = None,
    cross_layer: bool = False,
    bound: Any = None,
    clock_latency: Any = None,
) -> PlanningResult:
    """Solve the frontier of every method on one pipeline DAG and choose the points to write.

    `progress(message, fraction)` is called as the work advances (fraction 0..1 of the whole run).
    cross_layer: the 2-nanobatch options model cross-layer overlap (run by the overlap engine with and without
        SP; refused at run time with CP).
    clock_latency: a search.segments.ClockLatency (None: the GPU preset's latency, CLOCK_SEGMENT_LATENCIES);
        every clock plan's short clock segments are merged and its time and energy carry the lag of each
        clock change (search/segments.py). ClockLatency(0.0): changes take effect at once.
    bound: a search.plan_power.PowerBound; each frontier then keeps only plans that meet it, with the least
        costed power floor each needs (PlanError naming the least reachable swing when a method has none).
    """
    from kareus_megatron.search.options import build_options
    from kareus_megatron.search.pipeline import build_dag
    from kareus_megatron.search.segments import ClockLatency, latency_aware_plans
    from kareus_megatron.search.solver import solve_frontier

    say = progress or (lambda msg, frac: None)
    latency = ClockLatency(float(gpu.clock_latency_s)) if clock_latency is None else clock_latency
    todo = check_methods(methods)
    if points < 2:
        raise ConfigError(f"--points {points}: need at least 2 (the fastest and the lowest-energy plan)")
    blocked = overlap_blocker(schedule)
    if NANOBATCH_PERSEUS in todo and blocked is not None:
        raise InfeasibleConfigError(
            f"method {NANOBATCH_PERSEUS} splits each microbatch into 2 nanobatches, but {blocked}; "
            f"leave {NANOBATCH_PERSEUS} out of --methods (kareus plans clocks only on this schedule)."
        )
    if NANOBATCH_PERSEUS in todo and par.micro_batch_size % 2:
        raise InfeasibleConfigError(
            f"method {NANOBATCH_PERSEUS} splits each microbatch into 2 nanobatches, but --mbs is "
            f"{par.micro_batch_size}; use an even --mbs or leave {NANOBATCH_PERSEUS} out of --methods."
        )
    orders = instruction_order(schedule, par.pp, par.num_microbatches, par.vp)
    p2p_s, dp_s = pipeline_comm_times_s(model, par, kernel)
    dag = build_dag(orders, p2p_s, dp_s)
    gpus_per_stage = par.tp * par.cp * par.dp
    p_blocked = float(kernel.p_blocked_w)
    # Rough share of the work per method: megatron has one option per instruction, kareus the most.
    weight = {MEGATRON: 0.3, PERSEUS: 1.0, NANOBATCH_PERSEUS: 1.0, KAREUS: 1.6, POWERCAP: 0.3}
    total = sum(weight[m] for m in todo)
    done = 0.0
    found: dict[MethodName, MethodFrontier] = {}
    for name in todo:
        w = weight[name] / total
        say(f"{name}: options", done)
        if name == POWERCAP:
            found[name] = _powercap_frontier(dag, model, par, kernel, p_blocked, gpus_per_stage)
            done += w
            continue
        opts = build_options(
            gpu, model, par, kernel, name, clocks_mhz=clocks_mhz, schedule=schedule, cross_layer=cross_layer
        )
        say(f"{name}: frontier", done + 0.1 * w)

        def frontier_progress(f: float, d: float = done, w: float = w, n: str = name) -> None:
            say(f"{n}: frontier", d + w * (0.1 + 0.9 * f))

        solved = solve_frontier(dag, node_options(dag, opts), p_blocked, gpus_per_stage, progress=frontier_progress)
        if not solved:
            raise PlanError(f"method {name}: the solver found no plan")
        if latency.latency_s > 0:  # segments the controller can apply, the lag in time and energy
            solved = latency_aware_plans(dag, node_options(dag, opts), solved, p_blocked, gpus_per_stage, latency)
        kept, t, e = _frontier_arrays(solved)
        found[name] = MethodFrontier(method=name, options=opts, plans=kept, time_s=t, energy_j=e)
        done += w
    if bound is not None and bound.active:
        say("power bound", done)
        _apply_bound(found, dag, p_blocked, gpus_per_stage, float(gpu.power_limit_w), bound, latency.latency_s)
    choose_points(found, points, max_time_s)
    say("done", 1.0)
    return PlanningResult(
        gpu=gpu,
        model=model,
        par=par,
        schedule=schedule,
        orders=orders,
        dag=dag,
        p2p_time_s=p2p_s,
        dp_reduce_time_s=dp_s,
        p_blocked_w=p_blocked,
        gpus_per_stage=gpus_per_stage,
        methods=found,
        calibration_sha256=calibration_sha256,
        cross_layer=cross_layer,
        bound=bound,
        clock_latency=latency if latency.latency_s > 0 else None,
    )


def _apply_bound(
    found: dict[MethodName, MethodFrontier],
    dag: Any,
    p_blocked_w: float,
    gpus_per_stage: int,
    max_floor_w: float,
    bound: Any,
    clock_latency_s: float = 0.0,
) -> None:
    """Replace every method's frontier by its plans that meet `bound` (search/plan_power.py), in place; the
    clock plans' instructions carry the lag of a clock change of `clock_latency_s` (s)."""
    from kareus_megatron.search.plan_power import bounded_plans, check_reachable

    per = {
        name: bounded_plans(
            dag,
            node_options(dag, mf.options),
            mf.plans,
            p_blocked_w,
            gpus_per_stage,
            max_floor_w,
            bound,
            0.0 if name == POWERCAP else clock_latency_s,
        )
        for name, mf in found.items()
    }
    check_reachable(per, bound)
    for name, (plans, _frac, _ramp) in per.items():
        kept, t, e = _frontier_arrays(plans)
        mf = found[name]
        mf.plans, mf.time_s, mf.energy_j = kept, t, e


def _powercap_frontier(
    dag: Any, model: Any, par: Any, kernel: Any, p_blocked_w: float, gpus_per_stage: int
) -> MethodFrontier:
    """The ``powercap`` frontier: one simulated plan per power limit of the grid, Pareto over caps."""
    from kareus_megatron.search.powercap import cap_grid_w, powercap_options, powercap_plans

    caps = cap_grid_w(kernel, model, par)
    opts = powercap_options(kernel, model, par, caps)
    plans = powercap_plans(dag, node_options(dag, opts), caps, p_blocked_w, gpus_per_stage)
    kept, t, e = _frontier_arrays(plans)
    return MethodFrontier(method=POWERCAP, options=opts, plans=kept, time_s=t, energy_j=e)


def simulate_plan(result: PlanningResult, method: MethodName, index: int) -> tuple[Any, list[TimedInstruction]]:
    """Event simulation of frontier plan `index` of `method`: (Simulation, instructions per rank in order)."""
    from kareus_megatron.search.simulate import simulate

    mf = result.methods[method]
    plan = mf.plans[index]
    dag = result.dag
    opts = node_options(dag, mf.options)
    ch = np.asarray(plan.choice, dtype=np.int64)
    dur = np.array([float(o.time_s[c]) for o, c in zip(opts, ch)])
    en = np.array([float(o.energy_j[c]) for o, c in zip(opts, ch)])
    if result.clock_latency is not None and method != POWERCAP:  # the lag of every clock change
        from kareus_megatron.search.segments import lagged_costs

        dur, en = lagged_costs(dag, opts, ch, result.clock_latency.latency_s)
    sim = simulate(dag, dur, en, result.p_blocked_w, result.gpus_per_stage)
    timed = []
    for rank, order in enumerate(dag.rank_orders):
        for i in order:
            _s, kind, mb, chunk = dag.keys[i]
            timed.append(
                TimedInstruction(
                    rank=rank,
                    key=(kind, mb, chunk),
                    option=int(ch[i]),
                    start_s=float(sim.start_s[i]),
                    end_s=float(sim.end_s[i]),
                    energy_j=float(en[i]),
                )
            )
    return sim, timed
