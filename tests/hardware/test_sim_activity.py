"""The simulated GPU's busy activity is the planner's: the time-weighted mean activity of the default job.

The simulated backend (hardware/device/sim.py, sim_model.py) sits below the cost model, so it cannot ask the model
per instruction; its default compute and memory activities are the cost model's time-weighted means
over every op of the default job's forward and backward instructions (both stages, at the maximum SM
clock). This test recomputes those means, so the constants follow the model when it changes.
"""

from __future__ import annotations

import numpy as np

from kareus_megatron.cli.workload_args import DEFAULT_JOB
from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.hardware.device import sim_model
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.parallel import make_parallel


def planner_mean_activities() -> tuple[float, float]:
    """(compute, memory) activity of the default job, weighted by each op's time at the max clock."""
    d = DEFAULT_JOB
    gpu, model = gpu_spec(d["gpu"]), model_spec(d["model"])
    par = make_parallel(
        model,
        tp=d["tp"],
        cp=d["cp"],
        pp=d["pp"],
        vp=d["vp"],
        micro_batch_size=d["mbs"],
        seq_length=d["seq"],
        num_microbatches=d["microbatches"],
        recompute=d["recompute"],
        first_stage_layers=d["first_stage_layers"],
        last_stage_layers=d["last_stage_layers"],
        gpus_per_node=d["gpus_per_node"],
        precision=d["precision"],
    )
    k = KernelModel(gpu)
    t_sum = ca_sum = ma_sum = 0.0
    for stage in range(par.pp):
        for phase in ("forward", "backward"):
            layer, extra, n_layers = k.instruction_ops(model, par, stage, phase)
            prof = k.op_profile(layer + extra, gpu.max_sm_clock_mhz, precision=par.precision)
            w = np.r_[np.full(len(layer), float(n_layers)), np.ones(len(extra))] * prof.time_s
            t_sum += w.sum()
            ca_sum += (w * prof.compute_activity).sum()
            ma_sum += (w * prof.memory_activity).sum()
    return ca_sum / t_sum, ma_sum / t_sum


def test_simulated_activities_are_the_planners_means():
    compute, memory = planner_mean_activities()
    assert abs(sim_model.DEFAULT_COMPUTE_ACTIVITY - compute) <= 0.02, compute
    assert abs(sim_model.DEFAULT_MEMORY_ACTIVITY - memory) <= 0.02, memory
