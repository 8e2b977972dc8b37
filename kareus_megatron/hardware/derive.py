"""Power-model parameters (W, MHz, dimensionless) derived from datasheet facts and one measured die.

Facts (keys of a gpus.toml table with its die's from hardware/dies.toml; every GPU's datasheet or its
driver has them): ``tdp_w`` (the standard board power the base clock is rated at), ``sm_clock_base_mhz``
and ``sm_clock_max_mhz`` (base and boost clock), ``idle_power_w`` (board power at the max clock with no
kernel running; the measured blocked power where one exists), ``memory_type`` and ``hbm_gb_per_s``,
``process_node``, ``architecture``, ``sm_count``.
The mapping, argued in docs/sources.md#derived-power:

- *Voltage curve* (``voltage_floor``, ``voltage_knee_mhz``): GPU Boost raises clock and voltage together
  above the base clock, and below it the voltage sits at its floor (NVIDIA GPU Boost description). The knee
  is the base clock; the floor is the voltage the alpha-power law f ∝ (V − Vt)^α / V (Sakurai & Newton,
  IEEE JSSC 1990) needs for base/boost, with α and Vt/V_max of the process node (_NODES).
- *Static vs idle dynamic* (``static_power_w``, ``idle_dynamic_w``): the idle power at the max clock is
  leakage plus the always-on board (static) plus clock-tree switching (dynamic ∝ f·V²); the leakage share
  of it is a property of the node (_NODES).
- *Memory* (``memory_dynamic_w``): bandwidth × energy per bit of the memory type, DRAM access and I/O plus
  the on-die transport from the memory controller to the SMs (_MEMORY_PJ_PER_BIT).
- *Compute* (``compute_dynamic_w``): full compute activity (no memory traffic) at the base clock draws
  ``base_draw_fraction()`` × ``tdp_w``, which fixes the compute coefficient. The fraction is measured, not
  assumed: it is what the GA100 die's curves, fitted to the measured Perseus A100 profile, draw at the
  A100-SXM4's base clock (1095 MHz) over its 400 W TDP, 0.816 (docs/sources.md#base-clock-rule).
  The rule it replaces, "the heaviest load (compute and memory activity 1) at the base clock draws exactly the
  TDP", is contradicted by that profile: the GA100 curves put that load at 1.13 × TDP at 1095 MHz, and a
  measured GPT-3 175B stage draws about 292 W there on a 400 W-TDP (500 W-limit) board.

Boards of one die share its curves (hardware/dies.toml): ``derived_die_fields`` derives them once, from the
die's reference board.

``derive_power_params`` returns the fields of hardware/power.py; ``derived_spec`` gives a preset with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware import power as _power
from kareus_megatron.hardware.gpus import DIE_FIELDS, GPUSpec, die_table, gpu_spec, preset_table

# Process node -> (alpha-power-law exponent α, threshold voltage / V at the max clock, leakage share of the idle
# power at the max clock). α ≈ 1.3 for velocity-saturated short-channel CMOS (Sakurai & Newton 1990, measured
# α = 1.2–1.4 below 0.25 µm); Vt ≈ 0.35 V against ≈ 0.95 V at boost on 7/8 nm and ≈ 0.33 V on 4 nm (FinFET Vt and
# the Ampere/Hopper V–f tables in public undervolting curves, ~0.7–1.0 V). Leakage share: a third of the idle
# power on 7/8 nm FinFET, a little less on 4 nm (lower-leakage FinFET generation; TSMC N5 reports ~30% lower
# power at iso-speed, most of it leakage at idle). Engineering values, not fits: docs/sources.md#derived-power.
_NODES: dict[str, tuple[float, float, float]] = {
    "TSMC N7": (1.3, 0.37, 0.34),
    "Samsung 8N": (1.3, 0.37, 0.34),
    "TSMC 4N": (1.3, 0.35, 0.30),
}
# Memory type -> energy per bit moved (pJ/bit): DRAM access + I/O (HBM2/2e ~3.9 pJ/bit, O'Connor et al., MICRO
# 2017 "Fine-Grained DRAM"; HBM3 ~15% and HBM3e ~25% less per bit by JEDEC/vendor figures; GDDR6 ~7.5 pJ/bit,
# Micron TN-ED-04) plus ~2 pJ/bit of on-die transport memory controller -> L2 -> SM (Dally, "GPU computing to
# exascale and beyond", SC10: ~1 pJ/bit/mm-class wires over a few mm).
_MEMORY_PJ_PER_BIT: dict[str, float] = {"HBM2": 5.9, "HBM2e": 5.9, "HBM3": 5.3, "HBM3e": 4.9, "GDDR6": 9.5}
# The measured die whose curves (at its reference board's base clock and TDP) set base_draw_fraction().
MEASURED_DIE = "ga100"
_FACT_KEYS = (
    "tdp_w",
    "sm_clock_base_mhz",
    "sm_clock_max_mhz",
    "idle_power_w",
    "memory_type",
    "hbm_gb_per_s",
    "process_node",
    "architecture",
    "sm_count",
)


def _alpha_speed(v: float, vt: float, alpha: float) -> float:
    return (v - vt) ** alpha / v


def voltage_floor(base_mhz: float, max_mhz: float, node: str) -> float:
    """V(base)/V(max) (dimensionless) by the alpha-power law of `node`, solved by bisection."""
    alpha, vt, _ = _node(node)
    target = (base_mhz / max_mhz) * _alpha_speed(1.0, vt, alpha)
    lo, hi = vt + 1e-9, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _alpha_speed(mid, vt, alpha) < target else (lo, mid)
    return 0.5 * (lo + hi)


def _node(node: str) -> tuple[float, float, float]:
    if node not in _NODES:
        raise ConfigError(f"unknown process node {node!r}; known: {', '.join(sorted(_NODES))} (hardware/derive.py).")
    return _NODES[node]


def derive_power_params(facts: Mapping[str, Any]) -> dict[str, float]:
    """Power-model fields (W, MHz, dimensionless) of hardware/power.py from one preset's datasheet facts."""
    missing = [k for k in _FACT_KEYS if k not in facts]
    if missing:
        raise ConfigError(f"cannot derive power parameters: facts lack {', '.join(missing)} (hardware/derive.py).")
    mem = str(facts["memory_type"])
    if mem not in _MEMORY_PJ_PER_BIT:
        raise ConfigError(f"unknown memory type {mem!r}; known: {', '.join(sorted(_MEMORY_PJ_PER_BIT))}.")
    base, fmax = float(facts["sm_clock_base_mhz"]), float(facts["sm_clock_max_mhz"])
    if not 0 < base < fmax:
        raise ConfigError(f"base clock {base:g} MHz must lie below the max clock {fmax:g} MHz.")
    node = str(facts["process_node"])
    _, _, leak = _node(node)
    floor = voltage_floor(base, fmax, node)
    idle = float(facts["idle_power_w"])
    static = leak * idle
    idle_dyn = idle - static
    memory = float(facts["hbm_gb_per_s"]) * 1e9 * 8 * _MEMORY_PJ_PER_BIT[mem] * 1e-12
    scale = (base / fmax) * floor * floor  # (f/f_max)·v² at the base clock
    compute = (base_draw_fraction() * float(facts["tdp_w"]) - static) / scale - idle_dyn
    if compute <= 0:
        raise ConfigError(f"TDP {facts['tdp_w']} W leaves no compute power after the static and idle power.")
    return {
        "static_power_w": static,
        "idle_dynamic_w": idle_dyn,
        "compute_dynamic_w": compute,
        "memory_dynamic_w": memory,
        "voltage_floor": floor,
        "voltage_knee_mhz": base,
    }


def base_draw_fraction() -> float:
    """Board power (W) of full compute activity, no memory traffic, at the base clock over the TDP (W), on the
    measured die (MEASURED_DIE: its curves at its reference board's base clock and TDP); dimensionless."""
    board = preset_table(str(die_table(MEASURED_DIE)["reference_preset"]))
    spec = gpu_spec(str(die_table(MEASURED_DIE)["reference_preset"]))
    return float(_power.raw_power_w(spec, float(board["sm_clock_base_mhz"]), 1.0, 0.0)) / float(board["tdp_w"])


def derived_die_fields(die: str) -> dict[str, float]:
    """The power-model fields of `die` (hardware/dies.toml) derived from its reference board's datasheet facts."""
    d = derive_power_params(preset_table(str(die_table(die)["reference_preset"])))
    return {k: v for k, v in d.items() if k in DIE_FIELDS}


def derived_spec(name: str) -> GPUSpec:
    """Preset `name` with every power-model field replaced by derive_power_params of its gpus.toml facts."""
    from kareus_megatron.hardware.gpus import gpu_spec

    fields: dict[str, Any] = dict(derive_power_params(preset_table(name)))
    return dataclasses.replace(gpu_spec(name), **fields)
