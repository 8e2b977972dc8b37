"""GPU presets: read hardware/gpus.toml into frozen GPUSpec values.

Terms: *SM clock* is the graphics clock a pipeline instruction is locked to (MHz); *peak* throughputs
are dense tensor-core FLOP/s at the maximum SM clock on all SMs; bandwidths are bytes/s per direction
per GPU. Power-model parameters are documented in hardware/power.py, gpus.toml and dies.toml (the curves a
preset shares with the other boards of its die).
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from kareus_megatron.errors import ConfigError, UnknownPresetError

_GB = 1e9
# The SM-clock grid every command plans and predicts on by default (clock_grid_mhz; docs/sources.md#clock-grid).
CLOCK_GRID_STEP_MHZ = 30
CLOCK_GRID_LOWEST_FRACTION = 0.6


def clock_grid_mhz(
    lockable_mhz: Sequence[int],
    step_mhz: int = CLOCK_GRID_STEP_MHZ,
    lowest_fraction: float = CLOCK_GRID_LOWEST_FRACTION,
) -> tuple[int, ...]:
    """Clocks (MHz, descending) every step_mhz from the highest lockable clock down to lowest_fraction × it.

    Each target is snapped to the highest lockable clock not above it, so any driver clock list works.
    The defaults are the one clock-grid policy of every command: 30 MHz is twice the A100's 15 MHz lock
    step and halves the options to search, at no cost on the measured A100 stage profiles (the best energy
    of every instruction on the 30 MHz grid is within 0.4% of the 15 MHz grid's, 0.0% on GPT-3 175B); 0.6 of
    the max clock lies well below the measured energy minimum (0.76 × max, 1065-1080 MHz on A100), where
    lower clocks only add time and energy. The Kareus evaluation used the same 30 MHz step.
    """
    if step_mhz <= 0 or not 0.0 < lowest_fraction <= 1.0:
        raise ConfigError(f"clock grid step {step_mhz} MHz / fraction {lowest_fraction} must be > 0 / in (0, 1].")
    lockable = sorted({int(c) for c in lockable_mhz}, reverse=True)
    if not lockable:
        return ()
    lo = lowest_fraction * lockable[0]
    out: list[int] = []
    target = float(lockable[0])
    while target >= lo - 1e-9:
        below = [c for c in lockable if c <= target + 1e-9]
        if not below or below[0] < lo - 1e-9:
            break
        if not out or below[0] != out[-1]:
            out.append(below[0])
        target -= step_mhz
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    """One GPU model: compute, memory, links and power-model parameters (units in field names)."""

    name: str
    device_names: tuple[str, ...] = ()
    architecture: str = ""  # "ampere", "hopper", ... (datasheet; selects NCCL's algorithms in cost/collectives.py)
    sm_count: int
    sm_clocks_mhz: tuple[int, ...]  # every lockable SM clock, descending
    # dense TFLOP/s per precision at the max SM clock: tensor cores, except "fp32" = CUDA-core FP32 (every
    # preset has it: the arithmetic of memory-bound ops runs at that rate, cost/kernel.py)
    peak_tflops: dict[str, float] = field(hash=False)
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # intra-node link, per direction
    internode_bytes_per_s: float  # network bandwidth per GPU, per direction
    power_limit_w: float
    die: str = ""  # hardware/dies.toml table whose curves this board shares ("": the preset carries its own)
    # NVML's minimum enforceable power limit (W; nvidia-smi -q -d POWER "Min Power Limit"); None: not in the
    # preset, hardware/device/base.min_power_limit_w falls back to a quarter of power_limit_w
    min_power_limit_w: float | None = None
    p_blocked_w: float  # power while blocked on P2P or idle in a pipeline bubble
    static_power_w: float
    idle_dynamic_w: float  # clock-tree/idle dynamic power at the max clock, no kernel activity
    compute_dynamic_w: float  # extra dynamic power at the max clock and compute_activity = 1
    memory_dynamic_w: float  # extra power at memory_activity = 1 (does not scale with the SM clock)
    voltage_floor: float  # V(f)/V(f_max) at and below voltage_knee_mhz
    voltage_knee_mhz: float
    # the clock controller's latency (s): from a locked-clock request to the new SM clock in force
    # (gpus.toml [LAT]); plans keep every clock segment at least CLOCK_SEGMENT_LATENCIES times as long
    clock_latency_s: float
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def max_sm_clock_mhz(self) -> int:
        """Highest lockable SM clock (MHz)."""
        return self.sm_clocks_mhz[0]

    @property
    def min_sm_clock_mhz(self) -> int:
        """Lowest lockable SM clock (MHz)."""
        return self.sm_clocks_mhz[-1]

    def peak_flops(self, precision: str = "bf16") -> float:
        """Peak dense FLOP/s at the max clock on all SMs for `precision`."""
        if precision not in self.peak_tflops:
            raise ConfigError(
                f"{self.name} has no {precision!r} tensor throughput; "
                f"supported: {', '.join(sorted(self.peak_tflops))}. Pick one of those with --precision."
            )
        return self.peak_tflops[precision] * 1e12

    def check_clocks(self, sm_clocks_mhz: Iterable[int]) -> tuple[int, ...]:
        """Return the clocks (MHz) unchanged if every one is lockable on this GPU; else ConfigError."""
        clocks = tuple(int(c) for c in sm_clocks_mhz)
        allowed = set(self.sm_clocks_mhz)
        for c in clocks:
            if c not in allowed:
                raise ConfigError(
                    f"SM clock {c} MHz is not lockable on {self.name}; allowed: "
                    f"{self.min_sm_clock_mhz}..{self.max_sm_clock_mhz} MHz in steps of "
                    f"{self.sm_clocks_mhz[0] - self.sm_clocks_mhz[1]} MHz."
                )
        return clocks

    def clock_grid_mhz(
        self, step_mhz: int = CLOCK_GRID_STEP_MHZ, lowest_fraction: float = CLOCK_GRID_LOWEST_FRACTION
    ) -> tuple[int, ...]:
        """The default SM-clock grid (MHz, descending) of every command on this GPU (see clock_grid_mhz)."""
        return clock_grid_mhz(self.sm_clocks_mhz, step_mhz, lowest_fraction)


_SOURCE_RE = re.compile(r"^\s*(\w+)\s*=.*?#\s*(.*)$")


def _sources(text: str) -> dict[str, dict[str, str]]:
    """Map table -> key -> the comment written beside it in gpus.toml."""
    out: dict[str, dict[str, str]] = {}
    table = ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("[") and s.endswith("]"):
            table = s[1:-1]
            out[table] = {}
        elif table and (m := _SOURCE_RE.match(line)):
            out[table][m.group(1)] = m.group(2).strip()
    return out


def _min_power_limit_w(name: str, t: Mapping[str, Any]) -> float | None:
    """The preset's optional min_power_limit_w (W), checked to lie in (0, power_limit_w]."""
    if "min_power_limit_w" not in t:
        return None
    lo, hi = float(t["min_power_limit_w"]), float(t["power_limit_w"])
    if not 0.0 < lo <= hi:
        raise ConfigError(
            f"GPU preset {name!r}: min_power_limit_w {lo:g} W must be > 0 and at most power_limit_w {hi:g} W."
        )
    return lo


def _clock_latency_s(name: str, t: Mapping[str, Any]) -> float:
    """The preset's clock_latency_ms as seconds, checked to lie in (0, 1000] ms."""
    ms = float(t["clock_latency_ms"])
    if not 0.0 < ms <= 1000.0:
        raise ConfigError(
            f"GPU preset {name!r}: clock_latency_ms {ms:g} must be > 0 and at most 1000 "
            "(a locked-clock call takes 10-20 ms; `kareus validate` measures it)."
        )
    return ms / 1000.0


# The fields a die (hardware/dies.toml) sets for every board of it; a preset naming the die may not repeat them.
DIE_FIELDS = (
    "architecture",
    "process_node",
    "idle_power_w",
    "p_blocked_w",
    "static_power_w",
    "idle_dynamic_w",
    "compute_dynamic_w",
    "voltage_floor",
    "voltage_knee_mhz",
)


@functools.lru_cache(maxsize=1)
def _dies() -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    text = resources.files("kareus_megatron.hardware").joinpath("dies.toml").read_text(encoding="utf-8")
    return tomllib.loads(text), _sources(text)


def die_names() -> list[str]:
    """Names of the dies of hardware/dies.toml, sorted."""
    return sorted(_dies()[0])


def die_table(die: str) -> dict[str, Any]:
    """The raw dies.toml table of `die` (a copy); ConfigError naming the known dies otherwise."""
    dies = _dies()[0]
    if die not in dies:
        raise ConfigError(
            f"unknown die {die!r}; known: {', '.join(sorted(dies))} (hardware/dies.toml). Add a die "
            "table there, or give the preset its own power fields instead of `die`."
        )
    return dict(dies[die])


def resolve_die(
    name: str, t: Mapping[str, Any], sources: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """(table, sources) of preset `name` with its die's fields filled in (no `die` key: unchanged).

    A preset that repeats a die field is refused: boards of one die differ only where their datasheets do.
    """
    table, src = dict(t), dict(sources or {})
    if "die" not in table:
        return table, src
    die = str(table["die"])
    dt = die_table(die)
    again = [k for k in DIE_FIELDS if k in table]
    if again:
        raise ConfigError(
            f"GPU preset {name!r} names die {die!r} but also sets {', '.join(again)}: boards of one "
            "die share its curves (hardware/dies.toml); drop them from the preset."
        )
    die_src = _dies()[1].get(die, {})
    for k in DIE_FIELDS:
        if k in dt:
            table[k] = dt[k]
            src[k] = f"[die {die}] {die_src.get(k, '')}".strip()
    return table, src


def spec_from_table(name: str, t: Mapping[str, Any], sources: Mapping[str, str] | None = None) -> GPUSpec:
    """Build a GPUSpec from one gpus.toml table (preset units: MHz, TFLOP/s, GB/s, W); a `die` key brings in
    that die's fields (hardware/dies.toml, resolve_die)."""
    t, sources = resolve_die(name, t, sources)
    try:
        lo, hi, step = int(t["sm_clock_min_mhz"]), int(t["sm_clock_max_mhz"]), int(t["sm_clock_step_mhz"])
        clocks = tuple(range(hi, lo - 1, -step))
        peak = {str(k): float(v) for k, v in t["peak_tflops"].items()}
        if "fp32" not in peak:
            raise ConfigError(
                f"GPU preset {name!r} lacks peak_tflops.fp32 (CUDA-core FP32 TFLOP/s, from the "
                "datasheet); the cost model runs memory-bound ops' arithmetic at that rate."
            )
        return GPUSpec(
            name=name,
            device_names=tuple(t.get("device_names", ())),
            architecture=str(t.get("architecture", "")),
            die=str(t.get("die", "")),
            sm_count=int(t["sm_count"]),
            sm_clocks_mhz=clocks,
            peak_tflops=peak,
            hbm_bytes_per_s=float(t["hbm_gb_per_s"]) * _GB,
            memory_bytes=float(t["memory_gb"]) * _GB,
            nvlink_bytes_per_s=float(t["nvlink_gb_per_s"]) * _GB,
            internode_bytes_per_s=float(t["internode_gb_per_s"]) * _GB,
            power_limit_w=float(t["power_limit_w"]),
            min_power_limit_w=_min_power_limit_w(name, t),
            p_blocked_w=float(t["p_blocked_w"]),
            static_power_w=float(t["static_power_w"]),
            idle_dynamic_w=float(t["idle_dynamic_w"]),
            compute_dynamic_w=float(t["compute_dynamic_w"]),
            memory_dynamic_w=float(t["memory_dynamic_w"]),
            voltage_floor=float(t["voltage_floor"]),
            voltage_knee_mhz=float(t["voltage_knee_mhz"]),
            clock_latency_s=_clock_latency_s(name, t),
            sources=dict(sources or {}),
        )
    except KeyError as e:
        raise ConfigError(f"GPU preset {name!r} lacks key {e.args[0]!r}; see hardware/gpus.toml for the keys.") from e


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    text = resources.files("kareus_megatron.hardware").joinpath("gpus.toml").read_text(encoding="utf-8")
    return tomllib.loads(text), _sources(text)


@functools.lru_cache(maxsize=1)
def _presets() -> dict[str, GPUSpec]:
    tables, src = _tables()
    return {name: spec_from_table(name, t, src.get(name)) for name, t in tables.items()}


def preset_table(name: str) -> dict[str, Any]:
    """The gpus.toml table of preset `name` with its die's fields (preset units; datasheet facts included), a copy."""
    gpu_spec(name)  # UnknownPresetError for unknown names
    return resolve_die(name, _tables()[0][name])[0]


def gpu_names() -> list[str]:
    """Names of the shipped GPU presets, sorted."""
    return sorted(_presets())


def gpu_spec(name: str) -> GPUSpec:
    """The preset called `name`; UnknownPresetError (listing known names) otherwise."""
    presets = _presets()
    if name not in presets:
        raise UnknownPresetError(
            f"unknown GPU {name!r}; known: {', '.join(sorted(presets))}. Add a table to hardware/gpus.toml."
        )
    return presets[name]


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def gpu_spec_for_device_name(nvml_name: str) -> GPUSpec | None:
    """The preset whose NVML device name matches `nvml_name` (e.g. "NVIDIA A100-SXM4-40GB"), else None."""
    key = _norm(nvml_name)
    for spec in _presets().values():
        if key in {_norm(n) for n in spec.device_names} or key == _norm(spec.name):
            return spec
    return None
