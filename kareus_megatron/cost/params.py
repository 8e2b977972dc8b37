"""Free parameters of the kernel time model, and the GPU power-model fields a calibration may override.

Efficiencies are fractions of a roof (dimensionless); bandwidths per SM are bytes per SM clock cycle;
latencies and overheads are in s. Defaults are first-principles values for Ampere/Hopper-class GPUs:
cuBLAS reaches ~80% of dense bf16 peak on large GEMMs, flash attention ~60% forward and ~45% backward
(Dao 2023, FlashAttention-2, A100 figures), streaming kernels ~85% of HBM bandwidth, NCCL ~80% of
the NVLink bandwidth with enough channels (nccl-tests on DGX A100). Each default is the prior of the
calibration fit (cost/calibrate.py), which frees most of them; docs/sources.md#kernel-parameters lists
every default with its source, and says which ones no fit adjusts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kareus_megatron.hardware.gpus import GPUSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelParams:
    """Kernel-model parameters (fit by cost/calibrate.py; defaults are the uncalibrated model)."""

    gemm_efficiency: float = 0.80  # fraction of peak on a large, wave-aligned GEMM
    gemm_k_half: float = 96.0  # K at which a GEMM's efficiency halves (short reductions are slower)
    attention_efficiency: float = 0.60  # flash attention forward, fraction of peak
    attention_bwd_efficiency: float = 0.45  # flash attention backward
    memory_efficiency: float = 0.85  # streaming kernels, fraction of peak HBM bandwidth
    sm_load_bytes_per_cycle: float = 32.0  # bytes one SM moves per clock on a streaming kernel
    roofline_sharpness: float = 6.0  # p of the smooth maximum (t_c^p + t_m^p)^(1/p)
    # p of the smooth maximum of HBM time and SM-issue time of a streaming kernel: 2 = the rounded knee of
    # bandwidth against issue rate in Volkov's latency-hiding measurements (docs/sources.md#clock-sensitivity)
    memory_issue_sharpness: float = 2.0
    launch_overhead_s: float = 4e-6  # per kernel launch (gap between back-to-back kernels)
    nvlink_efficiency: float = 0.80  # achieved fraction of the per-direction NVLink bandwidth
    network_efficiency: float = 0.80  # achieved fraction of the per-GPU network bandwidth
    nvlink_latency_s: float = 12e-6  # one NVLink collective call (ring set-up and first hop)
    network_latency_s: float = 30e-6  # one inter-node collective call
    # link bytes one communication SM (NCCL channel) drives per clock: ~14 GB/s per SM at 1410 MHz, so
    # ~16-24 SMs saturate A100 NVLink, as NCCL's channel counts on NVSwitch systems suggest
    comm_sm_bytes_per_cycle: float = 10.0
    comm_sharpness: float = 3.0  # p of the smooth minimum of link and SM-driven bandwidth
    # SMs (one CTA per channel) NCCL uses when nobody limits it, the baselines' value: 24 ring channels on an
    # 8×A100 NVSwitch node ("NCCL INFO Channel 23/24" in NVIDIA/nccl-tests#100 and NVIDIA/nccl#578 logs;
    # docs/sources.md#nccl-default-sms)
    default_comm_sms: float = 24.0
    # power of one comm SM driving data, relative to a busy compute SM, link I/O included; fitted with the A100 power
    # presets to the Perseus GPT-3 profile (benchmarks/calibration_fit.py --bake)
    comm_compute_activity: float = 2.773
    attention_activity: float = 0.90  # compute activity of flash attention relative to a GEMM
    memory_op_compute_activity: float = 0.30  # compute activity floor of a streaming kernel
    time_scale: float = 1.0  # multiplies every predicted time (framework gaps; profile units)


KERNEL_PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in fields(KernelParams))
# GPUSpec fields a calibration may override (hardware/power.py's parameters and the board limit).
GPU_PARAM_NAMES: tuple[str, ...] = (
    "static_power_w",
    "idle_dynamic_w",
    "compute_dynamic_w",
    "memory_dynamic_w",
    "voltage_floor",
    "voltage_knee_mhz",
    "power_limit_w",
    "p_blocked_w",
)
PARAM_NAMES: tuple[str, ...] = KERNEL_PARAM_NAMES + GPU_PARAM_NAMES


def with_gpu_params(gpu: GPUSpec, values: Mapping[str, float]) -> GPUSpec:
    """`gpu` with the power-model fields named in `values` (a subset of GPU_PARAM_NAMES) replaced."""
    unknown = sorted(set(values) - set(GPU_PARAM_NAMES))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} not among the GPU power-model fields {', '.join(GPU_PARAM_NAMES)}")
    # Every GPU_PARAM_NAMES field of GPUSpec is a float, a link between keys and fields mypy cannot see.
    overrides: dict[str, Any] = dict(values)
    return dataclasses.replace(gpu, **overrides)
