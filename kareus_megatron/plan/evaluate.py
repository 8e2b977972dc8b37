"""A plan's iteration time (s) and energy (J) under a given kernel model: the planner's own pipeline simulation.

``evaluate_plan(plan, kernel)`` costs every instruction of `plan` at its SM clock with `kernel` (a KernelModel,
e.g. with a calibration: "the truth"), on the same pipeline DAG the planner solves (schedule order, P2P and
DP-reduction times, blocked power of the kernel's GPU), and simulates the iteration. So a plan made with one
model can be judged under another: the closed loop's benchmark compares the plan it made from a job's own
measurements with the plan made offline from the truth itself, both under the truth. Instructions are costed
in their 1-nanobatch form (``KernelModel.instruction_cost``); a plan with 2-nanobatch instructions is refused.
"""

from __future__ import annotations

import numpy as np

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.schema import Plan
from kareus_megatron.plan.workload import plan_model, plan_parallel
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.planner import pipeline_comm_times_s
from kareus_megatron.search.schedules import instruction_order
from kareus_megatron.search.simulate import Simulation, simulate


def evaluate_plan(plan: Plan, kernel: KernelModel) -> Simulation:
    """Simulate `plan` with every instruction costed by `kernel` at the plan's clock (see the module doc)."""
    if any(i.nanobatches > 1 for st in plan.stages for i in st.instructions):
        raise ConfigError("evaluate_plan costs 1-nanobatch instructions only; this plan runs 2 nanobatches")
    model, par = plan_model(plan), plan_parallel(plan)
    orders = instruction_order(plan.parallel.schedule, par.pp, par.num_microbatches, par.vp)
    p2p_s, dp_s = pipeline_comm_times_s(model, par, kernel)
    dag = build_dag(orders, p2p_s, dp_s)
    by_key = {(st.pp_rank, i.kind, i.microbatch, i.chunk): i for st in plan.stages for i in st.instructions}
    cache: dict[tuple[int, int, str, int], tuple[float, float]] = {}
    dur, energy = np.zeros(dag.n), np.zeros(dag.n)
    for n, key in enumerate(dag.keys):
        stage, kind, _mb, chunk = key
        ins = by_key.get(key)
        if ins is None:
            raise ConfigError(f"the plan has no instruction {kind} of microbatch {_mb} chunk {chunk} on stage {stage}")
        ck = (stage, chunk, kind, ins.sm_clock_mhz)
        if ck not in cache:
            t, e = kernel.instruction_cost(model, par, stage, kind, np.array([float(ins.sm_clock_mhz)]), chunk)
            cache[ck] = (float(t[0]), float(e[0]))
        dur[n], energy[n] = cache[ck]
    return simulate(dag, dur, energy, float(kernel.p_blocked_w), par.tp * par.cp * par.dp)
