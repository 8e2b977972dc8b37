"""NCCL collective algorithms on NVSwitch nodes: bus bandwidth (bytes/s) against CTAs (SMs) and the SM clock (MHz).

Terms: *bus bandwidth* is nccl-tests' busbw (message bytes × the ring bus factor / time, PERFORMANCE.md), so
figures of different algorithms compare directly; one *CTA* runs on one SM and drives one NCCL channel. An
algorithm's bandwidth is the smooth minimum of its large-message ceiling and of what its CTAs drive
(CTAs × bytes per CTA per cycle × f): below the ceiling it grows with the CTAs and with the SM clock.

Hopper NVSwitch nodes (H100/H200 SXM, NVLink4 450 GB/s per direction) have two algorithms for each of
all-reduce, all-gather and reduce-scatter (docs/sources.md#hopper-collectives):

- *ring* (all-reduce, all-gather, reduce-scatter, send/recv): ~370 GB/s busbw for large messages, the
  450 GB/s line rate less ~20% protocol overhead (NVIDIA, nccl-tests#212); 36.7 GB/s per channel at most
  (NCCL src/graph/tuning.cc, perChMaxRingLL128Bws, Hopper), so ~16 CTAs reach ~93% of the ceiling; NCCL
  runs 32 channels when nothing limits it. Latency: the generic NVLink latency of cost/params.py.
- *NVLS all-reduce* (NVLink SHARP): the switch reduces, each GPU sends its operand and receives the result
  once. ~480 GB/s busbw on 8 GPUs for large messages (nccl-tests#212); "NVLS should not need more than 16
  channels to get peak BW" (NCCL src/enqueue.cc, quoted in NVIDIA/nccl#1041) and NCCL's default is 16 NVLS
  channels, so one CTA drives ~27.6 B/cycle (16 CTAs: 95% of the ceiling at 1980 MHz); base latency 23 µs
  (tuning.cc baseLat, NVLS/Simple), which is why NCCL keeps small all-reduces on the ring. HBM traffic per bus
  byte: operand read + result write = 2 message bytes over 2(n−1)/n bus bytes.
- *NVLS all-gather / reduce-scatter* (NCCL ≥ 2.19): all-gather sends its S/n shard once and the switch
  multicasts it, reduce-scatter sends S and the switch returns the S/n reduced slice (S. Jeaugey, NVIDIA/nccl
  #1083). Less traffic in total than the ring's (n−1)/n·S each way, but the time is set by the larger
  direction, S at the per-direction rate R, so busbw = R·(n−1)/n: NCCL's own model (tuning.cc: NVLS
  allgather/reducescatter bandwidth = bwIntra·(ppn−1)/ppn) gives 324 GB/s at the ring's R = 370 GB/s on 8
  GPUs, and 8×H100 measures ~300 GB/s NVLS all-gather against ~350 GB/s ring (NVIDIA/nccl#1506); the ceiling
  is that 300 GB/s. NCCL runs every NVLS collective on the same nvlsChannels (16) and base latency; no
  per-CTA figure is published for these, so one CTA drives the NVLS all-reduce's 27.6 B/cycle (an
  assumption: "it may also require less SMs which can be a win", nccl#1506): ~8 CTAs reach 90% of the
  lower ceiling. HBM traffic per bus byte: S/n read + S written (all-gather) or S read + S/n written
  (reduce-scatter), over (n−1)/n·S bus bytes = (n+1)/(n−1).

The NVLS ceilings and HBM ratios are those of a full 8-GPU node (NVLS groups span the node's NVSwitch);
``algorithm_bandwidth(..., group_size=n)`` rescales the all-gather/reduce-scatter ceiling to n GPUs.
NCCL's default channel counts per architecture are the data ``DEFAULT_CHANNELS``. NCCL picks the faster
algorithm per call; ``collective_time_s`` of cost/kernel.py does the same, on the CTAs the knob allows. What a
CTA limit (``NCCL_MAX_CTAS``, the comm-SM knob) does: the ring slows below ~16 CTAs, both NVLS variants below
~8. So an unlimited large all-reduce goes NVLS (a small one stays on the ring: NVLS's 23 µs base latency),
unlimited all-gather/reduce-scatter stay on the ring (as NCCL chooses on 8×H100), and under a limit below
~10 CTAs all-gather/reduce-scatter move to NVLS. The comm-SM grid of search/tables.py stops where the
slowest-saturating algorithm saturates. Ampere GPUs (and Hopper without NVSwitch) return no table and use the
calibratable generic model (its default SMs: ``DEFAULT_CHANNELS``' Ampere ring, as cost/params.py); an
architecture ``DEFAULT_CHANNELS`` does not list is refused with a ConfigError that names it (check_architecture).
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
DEFAULT_CHANNELS: dict[str, dict[str, int]] = {
    "ampere": {"ring": 24},
    "hopper": {"ring": 32, "nvls": 16},
}
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
HOPPER_RING = Algorithm("ring", 370 * _GB, 36.7 * _GB / 1980e6, None, _HOPPER["ring"],
                        ("all_reduce", "all_gather", "reduce_scatter", "send_recv"))
HOPPER_NVLS = Algorithm("nvls", 480 * _GB, _NVLS_CTA_BYTES_PER_CYCLE, _NVLS_LATENCY_S, _HOPPER["nvls"],
                        ("all_reduce",), hbm_per_bus_byte=2.0 / (2 * (_N - 1) / _N))
HOPPER_NVLS_GATHER = Algorithm("nvls", 300 * _GB, _NVLS_CTA_BYTES_PER_CYCLE, _NVLS_LATENCY_S, _HOPPER["nvls"],
                               ("all_gather", "reduce_scatter"), hbm_per_bus_byte=(_N + 1) / (_N - 1),
                               ceiling_scales_with_group=True)
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
