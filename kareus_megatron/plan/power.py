"""A plan's predicted power waveform rebuilt from the plan file alone (for reports of runs of it).

The planner writes each plan's waveform metrics (``predicted.power``); a report that plots the waveform rebuilds
it from the plan's instructions: each one's predicted time (s) and energy (J, one GPU) on the planner's pipeline
DAG (schedule order; P2P and DP-reduction lags from the GPU preset's cost model), every GPU of a stage alike
(TP × CP × DP, in phase), blocked GPUs at the plan's blocked power or its power floor (W).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def predicted_waveform(plan: Any) -> tuple[np.ndarray, float] | None:
    """The plan's predicted job waveform (W per bin, bin s), rebuilt from its instructions; None without a
    model record or per-instruction predictions (older plans)."""
    from kareus_megatron.cost import KernelModel
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.plan.workload import plan_model, plan_parallel
    from kareus_megatron.search.pipeline import build_dag
    from kareus_megatron.search.plan_power import plan_parts, waveform_w
    from kareus_megatron.search.planner import pipeline_comm_times_s
    from kareus_megatron.search.schedules import instruction_order

    if plan.model is None or plan.p_blocked_w is None:
        return None
    by_key = {(st.pp_rank, i.kind, i.microbatch, i.chunk): i for st in plan.stages for i in st.instructions}
    if any(i.predicted_time_s is None or i.predicted_energy_j is None for i in by_key.values()):
        return None
    model, par = plan_model(plan), plan_parallel(plan)
    p2p_s, dp_s = pipeline_comm_times_s(model, par, KernelModel(gpu_spec(plan.gpu)))
    dag = build_dag(instruction_order(plan.parallel.schedule, par.pp, par.num_microbatches, par.vp), p2p_s, dp_s)
    dur = np.array([float(by_key[k].predicted_time_s) for k in dag.keys])
    en = np.array([float(by_key[k].predicted_energy_j) for k in dag.keys])
    a, b, step, _t = plan_parts(dag, dur, en, par.tp * par.cp * par.dp)
    return waveform_w(a, b, float(plan.p_blocked_w), plan.power_floor_w), step
