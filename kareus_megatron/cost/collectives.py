"""NCCL collective algorithms on NVSwitch nodes: bus bandwidth (bytes/s) against CTAs (SMs) and the SM clock (MHz).

Design (ring and NVLS per collective, ceilings, per-CTA drive, which NCCL picks under a CTA limit):
docs/concepts/energy-model.md#collectives-on-hopper-nvswitch-nodes; sources: docs/sources.md#hopper-collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.gpus import GPUSpec

_GB = 1e9

# NCCL's channels (one CTA each) on an 8-GPU NVSwitch node when nothing limits them, per architecture and
# algorithm (docs/sources.md#nccl-default-sms, #hopper-collectives): Ampere 24 ring channels (`NCCL INFO
# Channel 23/24` in NVIDIA/nccl-tests#100 and NVIDIA/nccl#578); Hopper 32 ring (NVIDIA/nccl#1259 logs) and 16
# NVLS (nvlsChannels, NCCL src/enqueue.cc) for every NVLS collective.
DEFAULT_CHANNELS: dict[str, dict[str, int]] = {"ampere": {"ring": 24}, "hopper": {"ring": 32, "nvls": 16}}
_NVSWITCH_NODE_GPUS = 8  # GPUs behind one NVSwitch fabric of an HGX/DGX node (the NVLS group the figures are for)


@dataclass(frozen=True, slots=True)
class Algorithm:
    """One NCCL algorithm on one node type: ceiling (bytes/s busbw), per-CTA drive (bytes/cycle), latency (s)."""

    name: str
    bus_bytes_per_s: float
    cta_bytes_per_cycle: float
    latency_s: float | None  # None: the generic NVLink latency of the kernel parameters
    default_ctas: int  # channels NCCL runs when nothing limits it
    families: tuple[str, ...]  # collective families it serves
    hbm_per_bus_byte: float | None = None  # None: the ring figure of cost/kernel.py
    # busbw ceiling ∝ (n-1)/n of the group (NVLS all-gather/reduce-scatter: R·(n-1)/n); False: size-independent
    ceiling_scales_with_group: bool = False


_N = _NVSWITCH_NODE_GPUS
_HOPPER = DEFAULT_CHANNELS["hopper"]
_NVLS_CTA_BYTES_PER_CYCLE = 27.6  # 480 GB/s × 95% over 16 CTAs at 1980 MHz
_NVLS_LATENCY_S = 23e-6  # tuning.cc baseLat, NVLS/Simple (per algorithm and protocol, not per collective)
HOPPER_RING = Algorithm(
    "ring",
    370 * _GB,
    36.7 * _GB / 1980e6,
    None,
    _HOPPER["ring"],
    ("all_reduce", "all_gather", "reduce_scatter", "send_recv"),
)
HOPPER_NVLS = Algorithm(
    "nvls",
    480 * _GB,
    _NVLS_CTA_BYTES_PER_CYCLE,
    _NVLS_LATENCY_S,
    _HOPPER["nvls"],
    ("all_reduce",),
    hbm_per_bus_byte=2.0 / (2 * (_N - 1) / _N),
)
HOPPER_NVLS_GATHER = Algorithm(
    "nvls",
    300 * _GB,
    _NVLS_CTA_BYTES_PER_CYCLE,
    _NVLS_LATENCY_S,
    _HOPPER["nvls"],
    ("all_gather", "reduce_scatter"),
    hbm_per_bus_byte=(_N + 1) / (_N - 1),
    ceiling_scales_with_group=True,
)
_SHARPNESS = 3.0  # p of the smooth minimum, as the generic model's comm_sharpness


def check_architecture(gpu: GPUSpec) -> str:
    """gpu's architecture if the collective model knows it (a key of DEFAULT_CHANNELS); else ConfigError naming it.

    A generation this module has no NCCL figures for (channel counts, algorithms) is refused rather than silently
    given the Ampere ring model: its collectives' clock and SM sensitivity would be a guess.
    """
    arch = gpu.architecture
    if arch not in DEFAULT_CHANNELS:
        raise ConfigError(
            f"GPU {gpu.name!r}: architecture {arch or '(none)'!r} has no collective model; known: "
            f"{', '.join(sorted(DEFAULT_CHANNELS))} (cost/collectives.py DEFAULT_CHANNELS). Set `architecture` in the "
            "preset to one of those, or add that generation's NCCL channel counts and algorithms."
        )
    return arch


def node_algorithms(gpu: GPUSpec) -> tuple[Algorithm, ...]:
    """The algorithm table of `gpu`'s NVLink node, or () when the generic model applies (Ampere, or no NVSwitch).

    Raises ConfigError for an architecture the module does not know (check_architecture).
    """
    if check_architecture(gpu) == "hopper" and gpu.nvlink_bytes_per_s >= 400 * _GB:
        return (HOPPER_RING, HOPPER_NVLS, HOPPER_NVLS_GATHER)
    return ()


def algorithm_bandwidth(
    algo: Algorithm, ctas: ArrayLike, sm_clock_mhz: ArrayLike, scale: float = 1.0, group_size: int | None = None
) -> np.ndarray:
    """Bus bandwidth (bytes/s) of `algo` on `ctas` CTAs at sm_clock_mhz (MHz); `scale` multiplies the ceiling.

    group_size (GPUs; None: the 8-GPU node the figures are for) rescales a group-dependent ceiling by
    ((n-1)/n) / ((8-1)/8), NVLS all-gather/reduce-scatter's busbw = R·(n-1)/n.
    """
    c = np.maximum(np.asarray(ctas, dtype=float), 1e-9)
    drive = c * algo.cta_bytes_per_cycle * np.asarray(sm_clock_mhz, dtype=float) * 1e6
    ceiling = algo.bus_bytes_per_s * scale
    if algo.ceiling_scales_with_group and group_size is not None and group_size > 1:
        ceiling *= ((group_size - 1) / group_size) / ((_N - 1) / _N)
    return (ceiling**-_SHARPNESS + drive**-_SHARPNESS) ** (-1.0 / _SHARPNESS)


def saturating_ctas(algo: Algorithm, sm_clock_mhz: float, fraction: float = 0.9) -> int:
    """Fewest CTAs whose bandwidth reaches `fraction` of the ceiling at sm_clock_mhz (MHz)."""
    for c in range(1, 257):
        if float(algorithm_bandwidth(algo, c, sm_clock_mhz)) >= fraction * algo.bus_bytes_per_s:
            return c
    return 256


def default_comm_ctas(gpu: GPUSpec) -> int | None:
    """CTAs (SMs) of NCCL's default large all-reduce on gpu's node (Hopper NVSwitch: NVLS's 16), None: generic."""
    algos = [a for a in node_algorithms(gpu) if "all_reduce" in a.families]
    if not algos:
        return None
    return max(algos, key=lambda a: a.bus_bytes_per_s).default_ctas


def fastest_algorithm(gpu: GPUSpec, family: str, ctas: float, sm_clock_mhz: float) -> Algorithm | None:
    """The algorithm of the highest large-message bandwidth for `family` on `ctas` CTAs (None: no table)."""
    algos = [a for a in node_algorithms(gpu) if family in a.families]
    if not algos:
        return None
    return max(algos, key=lambda a: float(algorithm_bandwidth(a, ctas, sm_clock_mhz)))


def comm_sms_grid(gpu: GPUSpec, families: tuple[str, ...]) -> tuple[int, ...] | None:
    """Comm-SM knob values (ascending) for collectives of `families` on gpu's node; None: no algorithm table.

    From 1-2 CTAs up to a little past where the slowest-saturating algorithm serving them reaches 90% of its
    ceiling at the max clock: beyond that more SMs buy no bandwidth, only take SMs from compute.
    """
    algos = [a for a in node_algorithms(gpu) if any(f in a.families for f in families)]
    if not algos:
        return None
    top = max(saturating_ctas(a, gpu.max_sm_clock_mhz) for a in algos) + 4
    step = 2 if "all_reduce" in families else 1
    return tuple(range(step, top + 1, step))
