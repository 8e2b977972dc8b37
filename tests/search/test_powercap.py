"""The power-cap baseline: its cap grid, its frontier against Megatron and Kareus, and its plan files.

One planning run of the documented default job (all methods) is shared by the tests of this module.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kareus_megatron.cost import KernelModel
from kareus_megatron.hardware.device.base import min_power_limit_w
from kareus_megatron.hardware.power import raw_power_w
from kareus_megatron.plan.build import build_outputs
from kareus_megatron.plan.io import plan_from_dict
from kareus_megatron.search.planner import plan_methods
from kareus_megatron.search.powercap import DEFAULT_CAPS, cap_grid_w, capped_kernel
from kareus_megatron.vocab import KAREUS, MEGATRON, PERSEUS, POWERCAP
from tests.search.test_planner import default_job


@pytest.fixture(scope="module")
def planned():
    gpu, model, par = default_job()
    result = plan_methods(gpu, model, par, KernelModel(gpu), methods=[POWERCAP, KAREUS], points=6)
    doc, built = build_outputs(result)
    return result, doc, built


def test_planning_every_a100_preset_divides_by_no_zero():
    import warnings

    from kareus_megatron.hardware.gpus import gpu_spec

    _, model, par = default_job()
    for name in ("a100-sxm4-80gb", "a100-sxm4-40gb"):  # the low caps of the 80GB part reached 0 MHz before
        gpu = gpu_spec(name)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            result = plan_methods(gpu, model, par, KernelModel(gpu), methods=[POWERCAP], points=3)
        front = result.methods[POWERCAP]
        assert np.all(np.isfinite(front.time_s)) and np.all(np.isfinite(front.energy_j))


def test_cap_grid_spans_the_useful_range_up_to_the_board_limit():
    gpu, model, par = default_job()
    caps = cap_grid_w(KernelModel(gpu), model, par)
    assert caps.size == DEFAULT_CAPS and np.all(np.diff(caps) > 0)
    assert caps[-1] == gpu.power_limit_w
    assert caps[0] >= min_power_limit_w(gpu)
    assert np.array_equal(caps, np.rint(caps))  # whole W: what nvidia-smi -pl takes


def test_a_cap_lowers_the_sustained_clock_and_the_power():
    gpu, model, par = default_job()
    kernel = capped_kernel(KernelModel(gpu), 200.0)
    ops = [op for op in kernel.instruction_ops(model, par, 0, "forward")[0] if op.kind not in ("collective", "p2p")]
    prof = kernel.op_profile(ops, gpu.max_sm_clock_mhz)
    assert np.all(prof.power_w <= 200.0 + 1e-6)
    hot = raw_power_w(gpu, gpu.max_sm_clock_mhz, prof.compute_activity, prof.memory_activity) > 200.0
    assert hot.any() and np.all(prof.sm_clock_mhz[hot] < gpu.max_sm_clock_mhz)


def test_the_board_limit_is_megatron_and_lower_caps_trade_time_for_energy(planned):
    result, _, _ = planned
    pc, mg = result.methods[POWERCAP], result.methods[MEGATRON]
    assert pc.plans[0].power_limit_w == result.gpu.power_limit_w
    assert pc.time_s[0] == pytest.approx(mg.time_s[0], rel=1e-12)
    assert pc.energy_j[0] == pytest.approx(mg.energy_j[0], rel=1e-12)
    assert len(pc.plans) >= 4
    assert np.all(np.diff(pc.time_s) > 0) and np.all(np.diff(pc.energy_j) < 0)
    caps = [p.power_limit_w for p in pc.plans]
    assert caps == sorted(caps, reverse=True)  # fastest first = highest cap first


def test_kareus_and_perseus_beat_every_power_cap(planned):
    result, doc, _ = planned
    pc = result.methods[POWERCAP]
    for name in (KAREUS, PERSEUS):
        mf = result.methods[name]
        for t, e in zip(pc.time_s[1:], pc.energy_j[1:]):  # past the board limit (= megatron)
            ok = mf.time_s <= t
            assert ok.any() and mf.energy_j[ok].min() < e, f"{name} does not beat the cap at {t:.3f} s, {e:.0f} J"
    red = doc["reductions"][POWERCAP]
    assert red["iso_time_energy"] < doc["reductions"][PERSEUS]["iso_time_energy"]
    assert red["max_throughput_time_vs_megatron"] == pytest.approx(0.0, abs=1e-12)


def test_powercap_plan_files_record_the_limit_and_the_max_clock(planned):
    result, doc, built = planned
    mine = [b for b in built if b.method == POWERCAP]
    assert [p["plan"] for p in doc["methods"][POWERCAP]["points"]] == [b.relpath for b in mine]
    limits = [b.plan.power_limit_w for b in mine]
    assert limits[0] == result.gpu.power_limit_w and limits == sorted(limits, reverse=True)
    for b in mine:
        ins = [i for s in b.plan.stages for i in s.instructions]
        assert {i.sm_clock_mhz for i in ins} == {result.gpu.max_sm_clock_mhz}
        assert {i.nanobatches for i in ins} == {1}
    assert all(b.plan.power_limit_w is None for b in built if b.method != POWERCAP)


def test_the_schema_ties_the_limit_to_the_method(planned):
    _, _, built = planned
    cap = next(b.plan for b in built if b.method == POWERCAP)
    d = cap.model_dump(mode="json")
    with pytest.raises(ValueError, match="power_limit_w is set exactly for method powercap"):
        plan_from_dict({**d, "method": KAREUS})
    with pytest.raises(ValueError, match="power_limit_w is set exactly for method powercap"):
        plan_from_dict({**d, "power_limit_w": None})
    d["stages"][0]["instructions"][0]["sm_clock_mhz"] = 1200
    with pytest.raises(ValueError, match="one \\(the maximum\\) SM clock"):
        plan_from_dict(d)


def test_a_calibrated_preset_keeps_its_fitted_power_under_the_cap():
    gpu, _, _ = default_job()
    fitted = replace(gpu, compute_dynamic_w=gpu.compute_dynamic_w * 0.5)
    km = capped_kernel(KernelModel(fitted), 250.0)
    assert km.gpu.compute_dynamic_w == fitted.compute_dynamic_w and km.gpu.power_limit_w == 250.0
