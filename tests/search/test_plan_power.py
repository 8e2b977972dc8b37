"""Plans that respect a power bound (search/plan_power.py): the least costed floor, the bounded frontier."""

from __future__ import annotations

import numpy as np
import pytest

from kareus_megatron.cost import KernelModel
from kareus_megatron.cost.waveform import metrics_arrays
from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.build import build_plan
from kareus_megatron.search.plan_power import PowerBound, least_floor
from kareus_megatron.search.planner import plan_methods
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.parallel import make_parallel


def test_least_floor_is_the_boundary_of_the_bound():
    a = np.array([4000.0, 4000.0, 0.0, 0.0])  # two busy bins, two bins with 8 GPUs blocked
    b = np.array([0.0, 0.0, 8.0, 8.0])
    bound = PowerBound(max_swing=0.3)
    floor, least, _ramp = least_floor(a, b, 0.25, 100.0, 900.0, bound)
    assert floor == pytest.approx(0.7 * 4000 / 8, rel=1e-3)  # min = 8 F must reach 0.7 × peak
    assert least == pytest.approx(0.0)  # F = 500 W (on the grid of 25 W steps) flattens it
    below = metrics_arrays(a + 0.99 * floor * b, 0.25)
    assert not bound.met(below)
    assert least_floor(a, b, 0.25, 100.0, 300.0, bound)[0] is None  # the board limit is too low
    smooth = a + np.array([0.0, 0.0, 3000.0, 3000.0])  # troughs at 3800 W ≥ 0.7 × 4000 W
    assert least_floor(smooth, b, 0.25, 100.0, 600.0, bound)[0] == 100.0  # the clocks suffice: no floor
    for bad in ({"max_swing": -0.1}, {"max_swing": 1.2}, {"max_ramp_w_per_s": 0.0}):
        with pytest.raises(ConfigError):
            PowerBound(**bad)


def test_bounded_frontier_prices_the_floor_into_the_plans():
    gpu = gpu_spec("a100-sxm4-40gb")
    model = model_spec("llama3.2-3b")
    par = make_parallel(
        model, tp=8, pp=2, nodes=2, gpus_per_node=8, micro_batch_size=8, seq_length=4096, num_microbatches=8
    )
    kernel = KernelModel(gpu)
    free = plan_methods(gpu, model, par, kernel, methods=["perseus"], points=4)
    bound = PowerBound(max_swing=0.3)
    capped = plan_methods(gpu, model, par, kernel, methods=["perseus"], points=4, bound=bound)
    assert capped.bound is bound
    for name, mf in capped.methods.items():
        assert mf.time_s.size and np.all(np.diff(mf.time_s) > 0)
        for idx in mf.chosen:
            plan, _timed = build_plan(capped, name, idx)
            assert plan.predicted.iteration_energy_j == pytest.approx(mf.energy_j[idx], rel=1e-9)
            assert plan.predicted.power.swing_w <= 0.3 * plan.predicted.power.peak_power_w * (1 + 1e-9)
        # what smoothness costs: no bounded plan is cheaper than the unbounded frontier at its time
        f = free.methods[name]
        for t, e in zip(mf.time_s, mf.energy_j):
            ok = f.time_s <= t * (1 + 1e-12)
            assert e >= f.energy_j[ok].min() * (1 - 1e-12)
