"""Prediction bands (issue 24 item 5): parameter draws, re-evaluated plans, paired reduction bands."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kareus_megatron.cost import KernelModel
from kareus_megatron.cost.calibration import Calibration
from kareus_megatron.cost.uncertainty import PARAM_CLASS, PRESET_LOG_SD, kernel_draw, kernel_draws, parameter_prior
from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.build import build_outputs
from kareus_megatron.plan.frontier import distinguishable, reduction_bands
from kareus_megatron.search.bands import sample_plans
from kareus_megatron.search.planner import plan_methods
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.parallel import ParallelConfig

GPU = "a100-sxm4-40gb"


@pytest.fixture(scope="module")
def planned():
    """A small job with every method (2 nanobatches, powercap, clock latency), planned once."""
    gpu = gpu_spec(GPU)
    par = ParallelConfig(
        tp=2,
        pp=2,
        micro_batch_size=2,
        seq_length=1024,
        num_microbatches=4,
        nodes=1,
        gpus_per_node=4,
        layers_per_stage=(1, 1),
    )
    model = dataclasses.replace(model_spec("llama3.2-3b"), num_layers=2)
    kernel = KernelModel(gpu)
    result = plan_methods(gpu, model, par, kernel, points=4)
    return result, kernel


def test_the_nominal_parameters_reproduce_every_plans_prediction(planned):
    """Re-evaluating the schedules under the model's own parameters gives the plans' predicted time and energy."""
    result, kernel = planned
    doc, _ = build_outputs(result)
    sampled = sample_plans(result, [kernel], {m: mf.chosen for m, mf in result.methods.items()})
    for method, entry in doc["methods"].items():
        t = [p["time_s"] for p in entry["points"]]
        e = [p["energy_j"] for p in entry["points"]]
        np.testing.assert_allclose(sampled[method].time_s[0], t, rtol=1e-12, err_msg=method)
        np.testing.assert_allclose(sampled[method].energy_j[0], e, rtol=1e-12, err_msg=method)


def test_draws_are_seeded_and_spread_as_stated(planned):
    _, kernel = planned
    a, b = kernel_draws(kernel, 64), kernel_draws(kernel, 64)
    c = kernel_draws(kernel, 64, seed=1)
    cdw = np.array([k.gpu.compute_dynamic_w for k in a.kernels])
    assert np.array_equal(cdw, [k.gpu.compute_dynamic_w for k in b.kernels])
    assert not np.array_equal(cdw, [k.gpu.compute_dynamic_w for k in c.kernels])
    sd = np.std(np.log(cdw / kernel.gpu.compute_dynamic_w))
    assert sd == pytest.approx(PRESET_LOG_SD["power"], rel=0.3)
    up = kernel_draw(kernel, ["gemm_efficiency", "compute_dynamic_w"], np.array([0.5, 0.5]))
    assert up.params.gemm_efficiency == 1.0  # an efficiency stays at most 1
    assert up.gpu.compute_dynamic_w == pytest.approx(kernel.gpu.compute_dynamic_w * np.exp(0.5))
    with pytest.raises(ConfigError, match="--band-samples 1"):
        kernel_draws(kernel, 1)


def test_a_run_log_posterior_replaces_the_class_prior(planned):
    _, kernel = planned
    gpu = gpu_spec(GPU)
    fit = {
        "parameters": {"compute_dynamic_w": {"value": gpu.compute_dynamic_w, "sd": 0.01 * gpu.compute_dynamic_w}},
        "correlation": {"names": ["compute_dynamic_w", "static_power_w"], "matrix": [[1.0, -0.5], [-0.5, 1.0]]},
    }
    cal = Calibration(gpu=GPU, params={"compute_dynamic_w": gpu.compute_dynamic_w}, fit=fit)
    prior = parameter_prior(KernelModel(gpu, cal))
    i, j = prior.names.index("compute_dynamic_w"), prior.names.index("static_power_w")
    assert prior.log_sd[i] == pytest.approx(0.01)
    assert prior.source[i] == "posterior"
    assert prior.source[j] == f"prior: {PARAM_CLASS['static_power_w']}"
    assert prior.correlation[i, j] == -0.5
    assert not parameter_prior(kernel).calibrated


def test_reduction_bands_are_paired_draw_by_draw():
    """Two methods that move together: the difference's band is narrow even though each point's band is wide."""
    scale = np.linspace(0.7, 1.3, 41)  # one common factor per draw
    frontiers = {
        "megatron": (np.array([10.0]), np.array([100.0])),
        "perseus": (np.array([10.0, 12.0]), np.array([95.0, 80.0])),
        "kareus": (np.array([9.0, 10.0]), np.array([90.0, 76.0])),
    }

    def draws(method, index):
        t, e = frontiers[method]
        return t[index] * scale, e[index] * scale

    bands = reduction_bands(frontiers, draws)
    lo, hi = bands["kareus"]["iso_time_energy_band"]
    assert lo == pytest.approx(1 - 76 / 95) and hi == pytest.approx(1 - 76 / 95)
    assert distinguishable([lo, hi]) is True
    assert bands["perseus"]["iso_time_energy_band"] == [0.0, 0.0]
    assert bands["megatron"]["iso_energy_time_band"] is None  # no Megatron plan within Perseus's least energy
    assert distinguishable([-0.01, 0.02]) is False
