"""Turn a planning run (search.planner.PlanningResult) into plan files and the frontier document.

A *chosen point* of a method becomes plan ``NAME-NN`` (NN = 00 is the method's fastest chosen plan).
Its predicted iteration time (s) and energy (J, every GPU of the job) come from the event simulation of
that plan; each instruction carries its own predicted time (s) and energy (J) on ONE GPU of its stage.
The frontier document's reductions are computed on each method's whole frontier (every plan the solver
kept); the chosen points include the plans that decide them whenever ``--points`` >= 4, so the
reductions can also be recomputed from the points in the file.

Every plan, of ``kareus plan`` (build_plan) or of ``kareus solve`` (solved_plan), is put together by
assemble_plan, which records what a report needs besides the prediction: the GPU, the job's shape and
the blocked power (W, one GPU) the prediction used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.cost.uncertainty import KernelDraws
from kareus_megatron.plan.frontier import band, decision_indices, frontier_document, reduction_bands, reductions
from kareus_megatron.plan.schema import (
    PLAN_FORMAT,
    Instruction,
    ModelShape,
    ParallelLayout,
    PartitionKnobs,
    Plan,
    PowerPrediction,
    Predicted,
    StagePlan,
)
from kareus_megatron.search.planner import PlanningResult, TimedInstruction, simulate_plan
from kareus_megatron.vocab import FRAMEWORK_OF_SCHEDULE, POWERCAP, MethodName, ScheduleName


@dataclass(frozen=True, kw_only=True, slots=True)
class BuiltPlan:
    """A plan file to write: its name (``NAME-NN``), the Plan and its simulated timeline."""

    name: str
    method: MethodName
    frontier_index: int
    plan: Plan
    timeline: list[TimedInstruction]

    @property
    def relpath(self) -> str:
        """Path of the plan file relative to the output directory."""
        return f"plans/{self.name}.json"


def model_shape(model: Any, precision: str | None = None) -> ModelShape:
    """The plan's record of the model (a workload ModelSpec): shape, architecture and training `precision`
    (None: not recorded)."""
    return ModelShape(
        name=model.name,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        vocab_size=model.vocab_size,
        activation=model.activation,
        normalization=model.norm,
        position_embedding=model.position,
        kv_channels=model.kv_channels,
        bias_linear=model.bias_linear,
        qkv_bias=model.has_qkv_bias,
        tied_embeddings=model.tied_embeddings,
        qk_norm=model.qk_norm,
        precision=precision,
    )


def parallel_layout(par: Any, schedule: ScheduleName) -> ParallelLayout:
    """The plan's record of the parallel layout and pipeline schedule."""
    return ParallelLayout(
        tp=par.tp,
        cp=par.cp,
        pp=par.pp,
        vp=par.vp,
        dp=par.dp,
        sequence_parallel=par.sequence_parallel,
        micro_batch_size=par.micro_batch_size,
        seq_length=par.seq_length,
        num_microbatches=par.num_microbatches,
        recompute=par.recompute,
        layers_per_stage=tuple(par.layers_per_stage),
        nodes=par.nodes,
        gpus_per_node=par.gpus_per_node,
        schedule=schedule,
    )


def config_dict(result: PlanningResult, memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config`` object of frontier.json: what was planned and with which inputs.

    `memory`: the per-GPU memory estimate (cost/memory.py memory_summary, bytes), written as ``memory``.
    """
    par = result.par
    cfg = {
        "model": result.model.name,
        "gpu": result.gpu.name,
        "calibration_sha256": result.calibration_sha256,
        "framework": FRAMEWORK_OF_SCHEDULE[result.schedule],
        "schedule": result.schedule,
        "tp": par.tp,
        "cp": par.cp,
        "pp": par.pp,
        "vp": par.vp,
        "dp": par.dp,
        "sequence_parallel": par.sequence_parallel,
        "micro_batch_size": par.micro_batch_size,
        "seq_length": par.seq_length,
        "num_microbatches": par.num_microbatches,
        "recompute": par.recompute,
        "layers_per_stage": list(par.layers_per_stage),
        "nodes": par.nodes,
        "gpus_per_node": par.gpus_per_node,
        "precision": par.precision,
        "p_blocked_w": result.p_blocked_w,
        "p2p_time_s": result.p2p_time_s,
        "dp_reduce_time_s": result.dp_reduce_time_s,
    }
    if memory is not None:
        cfg["memory"] = memory
    if result.cross_layer:  # only when set: frontier documents without it stay as they were
        cfg["cross_layer"] = True
    if result.bound is not None and result.bound.active:  # kareus plan --max-swing / --max-ramp
        cfg["power_bound"] = {"max_swing": result.bound.max_swing, "max_ramp_w_per_s": result.bound.max_ramp_w_per_s}
    return cfg


def assemble_plan(
    *,
    method: MethodName,
    gpu: str,
    parallel: ParallelLayout,
    time_s: float,
    energy_j: float,
    p_blocked_w: float,
    ranks: Sequence[Sequence[Instruction]],
    model: ModelShape | None = None,
    calibration_sha256: str | None = None,
    power_limit_w: float | None = None,
    cross_layer: bool = False,
    power: dict[str, float] | None = None,
    power_floor_w: float | None = None,
    clock_latency: Any = None,
    bands: tuple[Sequence[float], Sequence[float]] | None = None,
) -> Plan:
    """A plan of `method`: each rank's instructions in order, the predicted iteration time (s) and energy
    (J, all GPUs), the GPU and blocked power (W, one GPU) the prediction used, and for ``powercap`` the
    power limit (W) of every GPU; `power`: the predicted waveform's metrics (cost/waveform.py) and
    `power_floor_w` the floor (W, one GPU) blocked GPUs are held at to meet a power bound; `clock_latency`
    the search.segments.ClockLatency the prediction assumed (None: clock changes at once); `bands` the
    [low, high] of time (s) and energy (J) over the parameter draws (None: none)."""
    return Plan(
        format=PLAN_FORMAT,
        method=method,
        framework=FRAMEWORK_OF_SCHEDULE[parallel.schedule],
        gpu=gpu,
        calibration_sha256=calibration_sha256,
        p_blocked_w=float(p_blocked_w),
        power_limit_w=None if power_limit_w is None else float(power_limit_w),
        model=model,
        parallel=parallel,
        power_floor_w=None if power_floor_w is None else float(power_floor_w),
        predicted=Predicted(
            iteration_time_s=float(time_s),
            iteration_energy_j=float(energy_j),
            power=None if power is None else PowerPrediction(**power),
            iteration_time_s_band=None if bands is None else (float(bands[0][0]), float(bands[0][1])),
            iteration_energy_j_band=None if bands is None else (float(bands[1][0]), float(bands[1][1])),
        ),
        stages=tuple(StagePlan(pp_rank=r, instructions=tuple(ins)) for r, ins in enumerate(ranks)),
        cross_layer=True if cross_layer else None,  # written only when set: other plans stay as they were
        clock_latency_s=None if clock_latency is None else float(clock_latency.latency_s),
        min_clock_segment_s=None if clock_latency is None else float(clock_latency.min_segment_s),
    )


def solved_plan(
    dag: Any,
    node_opts: Sequence[Any],
    solved: Any,
    *,
    method: MethodName,
    gpu: str,
    parallel: ParallelLayout,
    p_blocked_w: float,
    clock_latency: Any = None,
) -> Plan:
    """The clock plan of one point of search.solver.solve_frontier over measured options (``kareus solve``).

    `node_opts[i]` holds DAG node i's options (clock_mhz, time_s, energy_j: one GPU); `solved.choice[i]` the
    chosen option; `solved.time_s` / `solved.energy_j` the simulated iteration time (s) and energy (J);
    `clock_latency` the search.segments.ClockLatency they assumed (each instruction's time and energy then carry
    the lag of a clock change at its begin; None: changes at once)."""
    from kareus_megatron.search.segments import lagged_costs

    lag_s = 0.0 if clock_latency is None else float(clock_latency.latency_s)
    dur, en = lagged_costs(dag, node_opts, np.asarray(solved.choice, dtype=np.int64), lag_s)
    ranks: list[list[Instruction]] = [[] for _ in range(parallel.pp)]
    for s, order in enumerate(dag.rank_orders):
        for i in order:
            _, kind, mb, chunk = dag.keys[i]
            o, k = node_opts[i], int(solved.choice[i])
            ranks[s].append(
                Instruction(
                    kind=kind,
                    microbatch=mb,
                    chunk=chunk,
                    sm_clock_mhz=int(o.clock_mhz[k]),
                    predicted_time_s=float(dur[i]),
                    predicted_energy_j=float(en[i]),
                )
            )
    return assemble_plan(
        method=method,
        gpu=gpu,
        parallel=parallel,
        time_s=solved.time_s,
        energy_j=solved.energy_j,
        p_blocked_w=p_blocked_w,
        ranks=ranks,
        clock_latency=clock_latency,
    )


def plan_power_metrics(
    result: PlanningResult, timed: list[TimedInstruction], time_s: float, power_floor_w: float | None = None
) -> Any:
    """The power metrics (cost.waveform.PowerMetrics) of a simulated timeline, blocked GPUs at the floor (W)."""
    from kareus_megatron.cost.waveform import power_metrics
    from kareus_megatron.search.plan_power import timeline_parts, waveform_w

    a, b, step = timeline_parts(timed, result.par.pp, time_s, result.gpus_per_stage)
    return power_metrics(waveform_w(a, b, result.p_blocked_w, power_floor_w), step)


def build_plan(
    result: PlanningResult,
    method: MethodName,
    index: int,
    _knobs: dict[Any, dict[str, PartitionKnobs]] | None = None,
    bands: tuple[Sequence[float], Sequence[float]] | None = None,
) -> tuple[Plan, list[TimedInstruction]]:
    """The Plan of frontier plan `index` of `method`, and its simulated timeline; `bands`: its [low, high] time (s)
    and energy (J) over the parameter draws."""
    sim, timed = simulate_plan(result, method, index)
    opts = result.methods[method].options
    knobs = {} if _knobs is None else _knobs  # (stage, chunk, kind, option) -> partition knobs, shared
    # with a clock latency, each instruction's time and energy include the lag of a clock change at its begin
    lag = result.clock_latency if method != POWERCAP else None
    ranks: list[list[Instruction]] = [[] for _ in range(result.par.pp)]
    for ti in timed:
        kind, mb, chunk = ti.key
        key = (ti.rank, chunk, kind)
        o = opts[key]
        k = ti.option
        nb = int(o.nanobatches[k])
        if nb > 1 and (*key, k) not in knobs:
            parts = o.partitions[k]
            knobs[(*key, k)] = {n: PartitionKnobs(comm_sms=int(s), launch_slot=slot) for n, (s, slot) in parts.items()}
        ranks[ti.rank].append(
            Instruction(
                kind=kind,
                microbatch=mb,
                chunk=chunk,
                sm_clock_mhz=int(o.clock_mhz[k]),
                nanobatches=nb,
                partitions=knobs[(*key, k)] if nb > 1 else {},
                predicted_time_s=float(o.time_s[k]) if lag is None else ti.end_s - ti.start_s,
                predicted_energy_j=float(o.energy_j[k]) if lag is None else ti.energy_j,
            )
        )
    floor = getattr(result.methods[method].plans[index], "power_floor_w", None)
    energy = sim.energy_j + (
        0.0
        if floor is None
        # blocked GPU-seconds held at the floor (W) instead
        else result.gpus_per_stage * (floor - result.p_blocked_w) * float(sim.idle_s.sum())
    )
    power = plan_power_metrics(result, timed, sim.time_s, floor)
    plan = assemble_plan(
        method=method,
        gpu=result.gpu.name,
        parallel=parallel_layout(result.par, result.schedule),
        time_s=sim.time_s,
        energy_j=energy,
        p_blocked_w=result.p_blocked_w,
        ranks=ranks,
        power=power.as_dict(),
        power_floor_w=floor,
        model=model_shape(result.model, result.par.precision),
        calibration_sha256=result.calibration_sha256,
        power_limit_w=getattr(result.methods[method].plans[index], "power_limit_w", None),
        cross_layer=result.cross_layer and any(i.nanobatches > 1 for r in ranks for i in r),
        clock_latency=lag,
        bands=bands,
    )
    return plan, timed


def build_outputs(
    result: PlanningResult, memory: dict[str, Any] | None = None, draws: KernelDraws | None = None
) -> tuple[dict[str, Any], list[BuiltPlan]]:
    """The frontier document and every chosen plan (fastest first within each method); `memory` goes
    into the document's ``config`` (see config_dict); `draws`: cost models with drawn parameters
    (cost/uncertainty.py kernel_draws): every point, plan and reduction then carries its band."""
    full: dict[str, tuple[np.ndarray, np.ndarray]] = {m: (mf.time_s, mf.energy_j) for m, mf in result.methods.items()}
    sampled = _sample(result, full, draws) if draws else None
    built: list[BuiltPlan] = []
    points: dict[str, list[dict[str, Any]]] = {}
    for method, mf in result.methods.items():
        points[method] = []
        knobs: dict[Any, dict[str, PartitionKnobs]] = {}
        for nn, idx in enumerate(mf.chosen):
            bands = None
            if sampled is not None:
                t_draws, e_draws = sampled[method].column(idx)
                bands = (band(t_draws).tolist(), band(e_draws).tolist())
            plan, timed = build_plan(result, method, idx, knobs, bands)
            bp = BuiltPlan(name=f"{method}-{nn:02d}", method=method, frontier_index=idx, plan=plan, timeline=timed)
            built.append(bp)
            point = {
                "time_s": plan.predicted.iteration_time_s,
                "energy_j": plan.predicted.iteration_energy_j,
                "plan": bp.relpath,
            }
            if bands is not None:
                point["time_s_band"], point["energy_j_band"] = bands
            if plan.predicted.power is not None:
                point.update(plan.predicted.power.model_dump())
            if plan.power_floor_w is not None:
                point["power_floor_w"] = plan.power_floor_w
            points[method].append(point)
    doc = frontier_document(config_dict(result, memory), points)
    doc["reductions"] = reductions({m: list(zip(t.tolist(), e.tolist())) for m, (t, e) in full.items()})
    if sampled is not None and draws is not None:
        for name, extra in reduction_bands(full, lambda m, i: sampled[m].column(i)).items():
            doc["reductions"][name].update(extra)
        doc["bands"] = draws.record()
    return doc, built


def _sample(result: PlanningResult, full: dict[str, Any], draws: KernelDraws) -> Mapping[Any, Any]:
    """Every chosen plan and every plan a reduction reads, re-evaluated under each draw (search/bands.py)."""
    from kareus_megatron.search.bands import sample_plans

    need = decision_indices(full)
    indices: dict[Any, Sequence[int]] = {m: sorted(set(mf.chosen) | need[m]) for m, mf in result.methods.items()}
    return sample_plans(result, draws.kernels, indices)
