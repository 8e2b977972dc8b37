"""Kernel time/energy model (cost/kernel.py): first-principles properties and the shipped calibration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.cost import KernelModel, load_calibration
from kareus_megatron.cost.calibration import shipped_calibration_path
from kareus_megatron.errors import CalibrationError
from kareus_megatron.hardware.gpus import gpu_names, gpu_spec
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.opgraph import Op, layer_ops
from kareus_megatron.workload.parallel import make_parallel

A100 = gpu_spec("a100-sxm4-80gb")
CLOCKS = np.array(A100.clock_grid_mhz(step_mhz=15), dtype=float)  # every lockable clock down to 0.6 x max


def gemm(m: int, n: int, k: int) -> Op:
    return Op(name="g", kind="gemm", flops=2.0 * m * n * k, hbm_bytes=2.0 * (m * k + k * n + m * n), gemm_mnk=(m, n, k))


def test_gemm_time_scales_with_flops():
    km = KernelModel(A100)
    prof = km.op_profile([gemm(8192, 8192, 8192), gemm(16384, 8192, 8192), gemm(16384, 16384, 8192)], 1200.0)
    t = prof.time_s
    assert t[1] / t[0] == pytest.approx(2.0, rel=0.03) and t[2] / t[0] == pytest.approx(4.0, rel=0.03)
    # compute-bound: time ∝ 1/f below the power-limited clock
    t2 = km.op_profile([gemm(8192, 8192, 8192)], np.array([1000.0, 900.0])).time_s[0]
    assert t2[1] / t2[0] == pytest.approx(1000 / 900, rel=0.01)


def test_memory_bound_op_slows_a_little_at_low_clocks():
    """SM issue rate ∝ clock (issue 16): slower at low clocks, but far less than a compute-bound op's 1/f."""
    km = KernelModel(A100)
    copy = Op(name="copy", kind="memory", hbm_bytes=2e9, flops=1e8)
    t = km.op_profile([copy], CLOCKS).time_s[0]  # CLOCKS descending
    assert np.all(np.diff(t) > 0)
    assert 1.03 < t[-1] / t[0] < 1.15 < CLOCKS[0] / CLOCKS[-1]
    # at the max clock the issue bound still costs a few % (smooth minimum, params.memory_issue_sharpness)
    assert t[0] == pytest.approx(2e9 / (A100.hbm_bytes_per_s * km.params.memory_efficiency), rel=0.08)


def test_power_monotone_in_clock_and_energy_has_an_interior_minimum():
    km = KernelModel(A100)
    par = make_parallel(model_spec("gpt3-175b"), tp=8, pp=8, micro_batch_size=1, seq_length=2048)
    for phase in ("forward", "backward"):
        t, e = km.instruction_cost(model_spec("gpt3-175b"), par, 3, phase, CLOCKS)
        p = e / t
        assert np.all(np.diff(p) <= 1e-9)  # CLOCKS descend, so power must not rise
        assert np.all(np.diff(t) >= -1e-12)  # lower clock never faster
        f_min = CLOCKS[np.argmin(e)]
        assert CLOCKS[-1] < f_min < CLOCKS[0]  # the Perseus shape: energy lowest mid-range


def test_time_is_flat_above_the_power_limited_clock():
    g = gpu_spec("a100-pcie-80gb")  # 300 W board
    km = KernelModel(g)
    op = gemm(8192, 8192, 8192)
    clocks = np.array(g.sm_clocks_mhz[:40], dtype=float)
    prof = km.op_profile([op], clocks)
    sustained = prof.sm_clock_mhz[0]
    limited = clocks > sustained + 1
    assert limited.sum() >= 3, "a full-activity GEMM must be power-limited at the top clocks of a 300 W board"
    t = prof.time_s[0]
    assert np.allclose(t[limited], t[limited][0], rtol=1e-4)  # time stops improving
    assert np.allclose(prof.power_w[0][limited], g.power_limit_w)  # power sits at the limit
    assert np.all(prof.power_w[0] <= g.power_limit_w + 1e-9)
    assert t[~limited][-1] > t[limited][0]


def test_halving_a_gemm_costs_efficiency():
    km = KernelModel(A100)
    shapes = [(4096, 3072, 3072), (8192, 2048, 3072), (4096, 1024, 3072), (32768, 3072, 1024)]
    for m, n, k in shapes:  # two half GEMMs never beat one full GEMM (launch overhead, waves)
        t = km.op_profile([gemm(m, n, k), gemm(m // 2, n, k)], 1410.0).time_s
        assert 2 * t[1] > t[0]
    # 4096×1024 tiles fill the 108 SMs well; 2048×1024 leaves a partial last wave
    eff = km.gemm_efficiency(np.array([[4096, 1024, 3072], [2048, 1024, 3072]], dtype=float), 108)
    assert eff[1] < 0.9 * eff[0]
    full = gemm(4096, 3072, 3072)
    # fewer SMs (below the power-limited clock): slower, though waves may soften it
    t_sms = km.op_profile([full], 1000.0, sms=np.array([108, 78, 54])).time_s[0]
    assert np.all(np.diff(t_sms) > 0) and t_sms[2] / t_sms[0] > 1.5


def test_collective_bandwidth_saturates_with_sms():
    km = KernelModel(A100)
    par = make_parallel(
        model_spec("llama3.2-3b"),
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        nodes=2,
        gpus_per_node=8,
        first_stage_layers=15,
        last_stage_layers=13,
    )
    ar = next(o for o in layer_ops(model_spec("llama3.2-3b"), par, "forward") if o.kind == "collective")
    sms = np.arange(3, 61, 3)
    t = km.collective_time_s(ar, sms)
    assert np.all(np.diff(t) < 0)
    assert t[0] / t[-1] > 3  # few SMs: SM-bound
    assert t[-2] / t[-1] < 1.02  # many SMs: link-bound, saturated
    bus = ar.comm_bytes * 2 * 7 / 8
    assert bus / t[-1] < A100.nvlink_bytes_per_s  # never faster than the link
    rate = km.collective_hbm_bytes_per_s(ar, sms)
    assert np.all(rate > 0) and np.all(np.diff(rate) > 0)
    slow = km.collective_time_s(ar, 12, sm_clock_mhz=np.array([1410.0, 900.0]))
    assert slow[1] > slow[0]


def test_profile_broadcasts_over_clocks_and_sms():
    km = KernelModel(A100)
    ops = layer_ops(
        model_spec("qwen3-1.7b"),
        make_parallel(model_spec("qwen3-1.7b"), tp=8, micro_batch_size=4, seq_length=4096),
        "forward",
        nanobatches=2,
    )
    prof = km.op_profile(ops, CLOCKS[:, None], sms=np.array([108, 90, 72])[None, :])
    assert prof.time_s.shape == (len(ops), len(CLOCKS), 3)
    for arr in (prof.compute_activity, prof.memory_activity):
        assert np.all((arr >= 0) & (arr <= 1))
    one = km.op_profile(ops, CLOCKS[5], sms=90)
    assert np.allclose(one.time_s, prof.time_s[:, 5, 1])


def test_instruction_cost_is_vectorised_and_recompute_costs_time():
    m = model_spec("llama3.2-3b")
    par = make_parallel(
        m,
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        recompute="full",
        nodes=2,
        gpus_per_node=8,
        first_stage_layers=15,
        last_stage_layers=13,
    )
    km = KernelModel(gpu_spec("a100-sxm4-40gb"))
    t, e = km.instruction_cost(m, par, 0, "backward", CLOCKS)
    for i in (0, 7, len(CLOCKS) - 1):
        ti, ei = km.instruction_cost(m, par, 0, "backward", CLOCKS[i])
        assert float(ti) == pytest.approx(t[i]) and float(ei) == pytest.approx(e[i])
    no_rc = make_parallel(
        m,
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        recompute="none",
        nodes=2,
        gpus_per_node=8,
        first_stage_layers=15,
        last_stage_layers=13,
    )
    t_fwd, _ = km.instruction_cost(m, par, 0, "forward", CLOCKS)
    t_nr, _ = km.instruction_cost(m, no_rc, 0, "backward", CLOCKS)
    assert np.allclose(t - t_nr, t_fwd, rtol=0.02)  # full recompute = one more forward pass


def test_shipped_calibration_loads_and_applies():
    cal = load_calibration(shipped_calibration_path("a100-sxm4-80gb.perseus"))
    assert cal.gpu == "a100-sxm4-80gb" and len(cal.sha256) == 64
    assert cal.fit["calibrated"]["time_ratio_mape_pct"] <= 3 and cal.fit["calibrated"]["power_mape_pct"] <= 5
    km = KernelModel(A100, cal)
    assert km.gpu.static_power_w == cal.params["static_power_w"]
    with pytest.raises(CalibrationError, match="a100-sxm4-80gb"):
        KernelModel(gpu_spec("a100-sxm4-40gb"), cal)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 65536),
    n=st.integers(1, 65536),
    k=st.integers(1, 16384),
    gpu=st.sampled_from(gpu_names()),  # every table of gpus.toml
    sms=st.integers(1, 132),
    frac=st.floats(0.3, 1.0),
)
def test_op_profile_invariants(m, n, k, gpu, sms, frac):
    g = gpu_spec(gpu)
    km = KernelModel(g)
    f = g.sm_clocks_mhz[int((1 - frac) * (len(g.sm_clocks_mhz) - 1))]
    ops = [gemm(m, n, k), Op(name="copy", kind="memory", hbm_bytes=2.0 * m * n)]
    prof = km.op_profile(ops, [float(f), float(g.min_sm_clock_mhz)], sms=min(sms, g.sm_count))
    assert np.all(prof.time_s > 0) and np.all(np.isfinite(prof.time_s))
    for a in (prof.compute_activity, prof.memory_activity):
        assert np.all((a >= 0) & (a <= 1))
    assert np.all(prof.power_w <= g.power_limit_w + 1e-6) and np.all(prof.power_w >= g.static_power_w)
    assert np.all(prof.sm_clock_mhz <= f + 1e-9)
    assert np.all(prof.time_s[:, 0] <= prof.time_s[:, 1] * (1 + 1e-9))  # the lowest clock is never faster
    assert np.allclose(prof.energy_j, prof.power_w * prof.time_s)
