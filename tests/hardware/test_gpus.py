"""GPU presets (hardware/gpus.toml) and the power model (hardware/power.py)."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from importlib import resources

import numpy as np
import pytest

from kareus_megatron.errors import ConfigError, UnknownPresetError
from kareus_megatron.hardware import power
from kareus_megatron.hardware.gpus import (
    CLOCK_GRID_LOWEST_FRACTION,
    CLOCK_GRID_STEP_MHZ,
    clock_grid_mhz,
    gpu_names,
    gpu_spec,
    gpu_spec_for_device_name,
    spec_from_table,
)
from kareus_megatron.hardware.power import power_w, raw_power_w, relative_voltage, sustained_clock_mhz

# Every table of gpus.toml (adding a preset is one table: these tests pick it up); REQUIRED must ship.
PRESETS = sorted(tomllib.loads(resources.files("kareus_megatron.hardware").joinpath("gpus.toml").read_text()))
REQUIRED = ["a100-sxm4-40gb", "a100-sxm4-80gb", "a100-pcie-80gb", "a40", "h100-sxm5-80gb", "h200-sxm-141gb"]


def test_every_required_preset_ships():
    assert set(REQUIRED) <= set(gpu_names()) == set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_consistent(name):
    g = gpu_spec(name)
    assert g.name == name
    clocks = np.array(g.sm_clocks_mhz)
    assert np.all(np.diff(clocks) < 0), "lockable clocks must be descending"
    assert g.max_sm_clock_mhz == clocks[0] and g.min_sm_clock_mhz == clocks[-1]
    assert g.peak_tflops["bf16"] > g.peak_tflops["fp32"] > 0
    assert 0 < g.static_power_w < g.p_blocked_w < g.power_limit_w
    assert 0.5 <= g.voltage_floor < 1 and g.min_sm_clock_mhz < g.voltage_knee_mhz < g.max_sm_clock_mhz
    # blocked power is static + idle-clock power: the two presets' numbers must roughly agree
    idle = float(power_w(g, g.max_sm_clock_mhz, 0.0, 0.0))
    assert 0.6 * g.p_blocked_w < idle < 1.4 * g.p_blocked_w


def test_spec_sheet_numbers():
    a = gpu_spec("a100-sxm4-40gb")
    assert (a.sm_count, a.max_sm_clock_mhz, a.peak_tflops["bf16"], a.hbm_bytes_per_s) == (108, 1410, 312.0, 1555e9)
    assert 1395 in a.sm_clocks_mhz and 900 in a.sm_clocks_mhz  # 15 MHz steps (docs/sources.md#lockable-clocks)
    h = gpu_spec("h100-sxm5-80gb")
    assert (h.sm_count, h.max_sm_clock_mhz) == (132, 1980) and "fp8" in h.peak_tflops
    assert gpu_spec("a40").p_blocked_w == 70.0 and a.p_blocked_w == 83.64


def test_every_number_has_a_source_comment():
    """Beside the number in gpus.toml, or in dies.toml for the fields a preset takes from its die."""
    for name in PRESETS:
        src = gpu_spec(name).sources
        keys = [
            f
            for f in (
                "sm_count",
                "sm_clock_max_mhz",
                "peak_tflops",
                "hbm_gb_per_s",
                "nvlink_gb_per_s",
                "internode_gb_per_s",
                "power_limit_w",
                "p_blocked_w",
                "static_power_w",
                "compute_dynamic_w",
                "memory_dynamic_w",
                "voltage_floor",
                "voltage_knee_mhz",
            )
        ]
        missing = [k for k in keys if not src.get(k) or src[k].startswith("[die") and "[" not in src[k][4:]]
        assert not missing, f"{name}: no source beside {missing}"


def test_unknown_preset_lists_known_names():
    with pytest.raises(UnknownPresetError, match="a100-sxm4-40gb"):
        gpu_spec("a100-sxm9")


def test_device_name_mapping():
    assert gpu_spec_for_device_name("NVIDIA A100-SXM4-40GB").name == "a100-sxm4-40gb"
    assert gpu_spec_for_device_name("NVIDIA A100-SXM4-80GB").name == "a100-sxm4-80gb"
    assert gpu_spec_for_device_name("NVIDIA H100 80GB HBM3").name == "h100-sxm5-80gb"
    assert gpu_spec_for_device_name("NVIDIA A40").name == "a40"
    assert gpu_spec_for_device_name("Tesla V100-SXM2-16GB") is None


def test_unsupported_clock_is_rejected():
    a = gpu_spec("a100-sxm4-40gb")
    assert a.check_clocks([1410, 900]) == (1410, 900)
    with pytest.raises(ConfigError, match="1411 MHz"):
        a.check_clocks([1411])
    with pytest.raises(ConfigError, match="fp8"):
        a.peak_flops("fp8")


@pytest.mark.parametrize("name", PRESETS)
def test_power_is_monotone_in_clock_and_activity(name):
    g = gpu_spec(name)
    f = np.array(g.sm_clocks_mhz, dtype=float)[::-1]  # ascending
    for ca, ma in ((0.0, 0.0), (0.3, 0.8), (1.0, 0.1)):
        p = power_w(g, f, ca, ma)
        assert np.all(np.diff(p) >= -1e-9)
    p_act = raw_power_w(g, 1200, np.linspace(0, 1, 11), 0.2)
    assert np.all(np.diff(p_act) > 0)
    assert np.all(np.diff(power_w(g, 1200, np.linspace(0, 1, 11), 0.2)) >= 0)
    v = relative_voltage(g, f)
    assert np.all(np.diff(v) >= 0) and v[-1] == pytest.approx(1.0)


def test_power_is_clamped_and_clock_is_sustained():
    g = gpu_spec("a100-pcie-80gb")  # 300 W: a full-activity GEMM cannot hold 1410 MHz
    assert float(raw_power_w(g, 1410, 1.0, 0.1)) > g.power_limit_w
    assert float(power_w(g, 1410, 1.0, 0.1)) == g.power_limit_w
    f_s = float(sustained_clock_mhz(g, 1410, 1.0, 0.1))
    assert g.min_sm_clock_mhz < f_s < 1410
    assert float(raw_power_w(g, f_s, 1.0, 0.1)) == pytest.approx(g.power_limit_w, rel=1e-6)
    # below the sustainable clock nothing changes; broadcasting over clocks and activities
    low = sustained_clock_mhz(g, np.array([[900.0], [1410.0]]), np.array([0.2, 1.0]), 0.1)
    assert low.shape == (2, 2) and low[0, 0] == 900.0 and low[1, 1] == pytest.approx(f_s)


def _bisected_clock_mhz(g, f, ca, ma):
    """The sustained clock by the plain bisection on raw_power_w over every element (what power.py once did)."""
    f, ca, ma = np.broadcast_arrays(np.asarray(f, dtype=float), np.asarray(ca, dtype=float), ma)
    over = raw_power_w(g, f, ca, ma) > g.power_limit_w
    if not np.any(over):
        return f.astype(float)
    lo, hi = np.minimum(f, float(g.min_sm_clock_mhz)), f.astype(float)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        ok = raw_power_w(g, mid, ca, ma) <= g.power_limit_w
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
    return np.where(over, lo, f)


@pytest.mark.parametrize("name", PRESETS)
def test_sustained_clock_agrees_with_the_plain_bisection(name, monkeypatch):
    """power.py's Newton steps on the over-limit elements: within the bisection's resolution (1500 MHz / 2**40) of
    bisecting raw_power_w everywhere, also with array-valued fields (the planner's parameter draws); every element
    converged within 8 steps; and each element's result bit for bit what a call with that element alone gives."""
    rng = np.random.default_rng(7)
    base = gpu_spec(name)
    k = 16
    draws = replace(
        base,
        static_power_w=base.static_power_w * rng.uniform(0.8, 1.2, k),
        compute_dynamic_w=base.compute_dynamic_w * rng.uniform(0.8, 1.4, k),
        memory_dynamic_w=base.memory_dynamic_w * rng.uniform(0.8, 1.2, k),
        voltage_floor=base.voltage_floor * rng.uniform(0.9, 1.1, k),
        power_limit_w=base.power_limit_w * rng.uniform(0.4, 1.0, k),
    )
    capped = 0
    for g, shape in ((replace(base, power_limit_w=0.6 * base.power_limit_w), (13, 5)), (draws, (9, 1))):
        f = rng.uniform(base.min_sm_clock_mhz - 30, base.max_sm_clock_mhz, size=shape)
        ca, ma = rng.uniform(-0.1, 1.2, size=shape), rng.uniform(-0.1, 1.2, size=shape)
        got, want = sustained_clock_mhz(g, f, ca, ma), _bisected_clock_mhz(g, f, ca, ma)
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= 2e-9
        capped += int(np.sum(got < np.broadcast_to(f, got.shape)))
        with monkeypatch.context() as mp:
            mp.setattr(power, "_NEWTON_MAX_STEPS", 8)
            assert np.array_equal(sustained_clock_mhz(g, f, ca, ma), got)
        names = ("static_power_w", "compute_dynamic_w", "memory_dynamic_w", "voltage_floor", "power_limit_w")
        for idx in np.ndindex(*got.shape):  # with draws: rows are clocks, columns the parameter draws
            one = replace(g, **{n: getattr(g, n)[idx[1]] for n in names}) if g is draws else g
            src = (idx[0], 0) if g is draws else idx
            alone = sustained_clock_mhz(one, f[src], ca[src], ma[src])
            assert alone.shape == () and alone == got[idx], idx
    assert capped > 10  # the solver really ran


def test_a_limit_no_clock_meets_stops_at_the_lowest_clock():
    g = replace(gpu_spec("a100-sxm4-80gb"), power_limit_w=40.0)  # below static + memory power at any clock
    assert float(raw_power_w(g, g.min_sm_clock_mhz, 0.1, 1.0)) > g.power_limit_w
    assert float(sustained_clock_mhz(g, 1410, 0.1, 1.0)) == g.min_sm_clock_mhz  # not 0 MHz (then times divide by 0)


# ---- the one clock-grid policy (hardware/gpus.py clock_grid_mhz) ----------------------------------


def test_default_clock_grid_is_every_30_mhz_down_to_60_percent():
    a100 = gpu_spec("a100-sxm4-40gb")
    grid = a100.clock_grid_mhz()
    assert grid[0] == 1410 and grid[-1] == 870 and len(grid) == 19
    assert all(a - b == CLOCK_GRID_STEP_MHZ for a, b in zip(grid, grid[1:]))
    assert set(grid) <= set(a100.sm_clocks_mhz) and grid[-1] >= CLOCK_GRID_LOWEST_FRACTION * 1410
    h100 = gpu_spec("h100-sxm5-80gb")
    assert h100.clock_grid_mhz()[0] == 1980 and h100.clock_grid_mhz()[-1] >= 0.6 * 1980


def test_clock_grid_snaps_to_lockable_clocks():
    a100 = gpu_spec("a100-sxm4-40gb")
    assert a100.clock_grid_mhz(step_mhz=100, lowest_fraction=0.9) == (1410, 1305)  # 1310 -> 1305 (15 MHz steps)
    assert a100.clock_grid_mhz(step_mhz=15) == tuple(c for c in a100.sm_clocks_mhz if c >= 0.6 * 1410)
    assert clock_grid_mhz([1400, 1410, 1300, 1000], 50, 0.7) == (1410, 1300, 1000)  # any driver list, any order
    assert clock_grid_mhz([], 30, 0.6) == ()
    for bad in ((0, 0.6), (30, 0.0), (30, 1.5)):
        with pytest.raises(ConfigError, match="clock grid"):
            a100.clock_grid_mhz(*bad)


def test_a_preset_without_fp32_throughput_is_refused():
    t = {
        k: v
        for k, v in tomllib.loads(
            resources.files("kareus_megatron.hardware").joinpath("gpus.toml").read_text(encoding="utf-8")
        )["a40"].items()
    }
    t["peak_tflops"] = {"bf16": 149.7}
    with pytest.raises(ConfigError, match="peak_tflops.fp32"):
        spec_from_table("a40-no-fp32", t)


def test_presets_carry_nvmls_minimum_power_limit_where_published():
    """nvidia-smi -q "Min Power Limit": A100 SXM4 100 W, H100 SXM5 200 W; others fall back to 1/4 of the board."""
    from kareus_megatron.hardware.device.base import min_power_limit_w

    want = {"a100-sxm4-40gb": 100.0, "a100-sxm4-80gb": 100.0, "h100-sxm5-80gb": 200.0}
    for name in PRESETS:
        g = gpu_spec(name)
        assert g.min_power_limit_w == want.get(name)
        assert min_power_limit_w(g) == (want[name] if name in want else g.power_limit_w / 4)
        if name in want:
            assert g.sources["min_power_limit_w"].startswith("[NVSMI-PL]")
    assert min_power_limit_w(gpu_spec("a100-sxm4-80gb")) != gpu_spec("a100-sxm4-80gb").power_limit_w / 4


@pytest.mark.parametrize("bad", [0, -5, 401])
def test_a_minimum_power_limit_outside_the_board_range_is_refused(bad):
    t = dict(
        tomllib.loads(resources.files("kareus_megatron.hardware").joinpath("gpus.toml").read_text(encoding="utf-8"))[
            "a100-sxm4-40gb"
        ]
    )
    t["min_power_limit_w"] = bad
    with pytest.raises(ConfigError, match="min_power_limit_w"):
        spec_from_table("a100-bad-min", t)
    t["min_power_limit_w"] = 150
    assert spec_from_table("a100-ok-min", t).min_power_limit_w == 150.0


@pytest.mark.parametrize("bad", [0, -1, 1001])
def test_every_preset_carries_its_clock_latency_with_a_source(bad):
    """clock_latency_ms (gpus.toml [LAT]): in seconds on the spec, sourced, and refused outside (0, 1000] ms."""
    for name in PRESETS:
        g = gpu_spec(name)
        assert 0.005 <= g.clock_latency_s <= 0.05, name
        assert g.sources["clock_latency_ms"].startswith("[LAT]"), name
    t = dict(
        tomllib.loads(resources.files("kareus_megatron.hardware").joinpath("gpus.toml").read_text(encoding="utf-8"))[
            "h100-sxm5-80gb"
        ]
    )
    t["clock_latency_ms"] = bad
    with pytest.raises(ConfigError, match="clock_latency_ms"):
        spec_from_table("h100-bad-latency", t)
    del t["clock_latency_ms"]
    with pytest.raises(ConfigError, match="clock_latency_ms"):
        spec_from_table("h100-no-latency", t)
