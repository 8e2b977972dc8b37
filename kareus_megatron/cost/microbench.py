"""Microbenchmark kernels on a GPU: what they are (ops for the model), how to run them (torch), their series.

Three kernels stand for a training step's work: a bf16 *gemm* (compute-bound), causal flash *attention*
(``scaled_dot_product_attention``) and a device-to-device *copy* (memory-bound); *idle* is a sleep. Each
has an ``Op`` so the kernel model predicts its time (s) and power (W) at any SM clock (MHz), and a torch
callable that enqueues one call. torch is imported by ``load_torch`` only (GPU commands), never at import.
``kareus calibrate --run`` (``calibrate_run``) and ``kareus validate`` (cost/gpu_validate.py) measure
them with the thermally stable protocol of hardware/measure.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.cost.calibrate import (
    MICROBENCH_CLOCK_STEP_MHZ,
    MICROBENCH_COPY_BYTES,
    MICROBENCH_GEMM_MNK,
    MICROBENCH_LOWEST_FRACTION,
    FreeParam,
    Series,
    fit_microbenchmarks,
)
from kareus_megatron.cost.calibration import Calibration
from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.errors import ClockControlError, DeviceUnavailableError
from kareus_megatron.hardware.device.base import GPUDevice, SimulationHooks
from kareus_megatron.hardware.gpus import clock_grid_mhz
from kareus_megatron.hardware.measure import Sweep, WindowPolicy, sample_energy_counter, sweep, sweep_seconds
from kareus_megatron.workload.opgraph import Op

CALIBRATE_BUDGET_S = 300.0  # `kareus calibrate --run` on one GPU: at most 5 minutes


@dataclass(frozen=True)
class KernelSizes:
    """Sizes of the three kernels: GEMM (m, n, k), attention (batch, heads, seq, head dim), copy (bytes)."""

    gemm_mnk: tuple[int, int, int] = MICROBENCH_GEMM_MNK
    attention_bhsd: tuple[int, int, int, int] = (4, 32, 4096, 128)
    copy_bytes: int = MICROBENCH_COPY_BYTES


FULL_SIZES = KernelSizes()
DRY_RUN_SIZES = KernelSizes((64, 64, 64), (1, 2, 64, 16), 1 << 16)  # CPU, simulated backend: milliseconds


def kernel_ops(sizes: KernelSizes, element_bytes: int = 2) -> dict[str, Op]:
    """The model's view of each kernel: FLOP and HBM bytes (bf16 elements by default)."""
    m, n, k = sizes.gemm_mnk
    b, h, s, d = sizes.attention_bhsd
    return {
        "gemm": Op(
            name="gemm",
            kind="gemm",
            flops=2.0 * m * n * k,
            hbm_bytes=element_bytes * (m * k + k * n + m * n),
            gemm_mnk=(m, n, k),
        ),
        "attention": Op(
            name="attention",
            kind="attention",
            flops=4.0 * b * h * s * s * d * 0.5,  # causal
            hbm_bytes=element_bytes * 4.0 * b * h * s * d,
        ),  # read q, k, v; write o
        "copy": Op(name="copy", kind="memory", hbm_bytes=2.0 * sizes.copy_bytes),  # read + write
    }


def load_torch(cuda: bool) -> Any:
    """torch (with a CUDA GPU when `cuda`); DeviceUnavailableError naming the fix otherwise."""
    try:
        import torch
    except ImportError as e:
        raise DeviceUnavailableError(
            "this command needs torch (with CUDA on a GPU machine); install the [megatron] extra."
        ) from e
    if cuda and not torch.cuda.is_available():
        raise DeviceUnavailableError(
            "this command needs a CUDA GPU, and torch sees none "
            "(torch.cuda.is_available() is False); use --dry-run on a CPU machine."
        )
    return torch


def torch_kernels(torch: Any, device: str, sizes: KernelSizes, names: Sequence[str]) -> tuple[dict[str, Any], Any]:
    """({name: fn enqueuing one call}, sync) on torch device `device` (bf16 on CUDA, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    out: dict[str, Any] = {}
    if "gemm" in names:
        m, n, k = sizes.gemm_mnk
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        out["gemm"] = lambda: torch.matmul(a, b)
    if "attention" in names:
        bb, h, s, d = sizes.attention_bhsd
        q, kk, v = (torch.randn(bb, h, s, d, device=device, dtype=dtype) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out["attention"] = lambda: sdpa(q, kk, v, is_causal=True)
    if "copy" in names:
        src = torch.empty(sizes.copy_bytes // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        out["copy"] = lambda: dst.copy_(src)
    if "idle" in names:
        out["idle"] = None
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    return {n: out[n] for n in names}, sync


def model_activity(km: KernelModel, ops: dict[str, Op]) -> Callable[[str, int], tuple[float, float]]:
    """(kernel, clock MHz) -> the model's (compute, memory) activity: what the simulated GPU draws power for."""

    def activity(name: str, mhz: int) -> tuple[float, float]:
        prof = km.op_profile([ops[name]], np.array([float(mhz)]))
        return float(prof.compute_activity[0, 0]), float(prof.memory_activity[0, 0])

    return activity


def predicted(km: KernelModel, op: Op | None, clocks_mhz: Sequence[float]) -> tuple[list[float], list[float]]:
    """(time per call s, power W) of `op` at each clock (MHz); op None: idle (time 1 s at blocked power)."""
    f = np.asarray(clocks_mhz, dtype=float)
    if op is None:
        return [1.0] * len(f), [float(p) for p in km.power_w(f, 0.0, 0.0)]
    prof = km.op_profile([op], f)
    return [float(t) for t in prof.time_s[0]], [float(p) for p in prof.power_w[0]]


def kernel_series(ops: dict[str, Op], measured: Sweep, kernels: Sequence[str]) -> list[Series]:
    """One fit Series per kernel (highest clock first) from a sweep; "idle" predicts the blocked power."""
    out = []
    for name in kernels:
        clocks, t, e = measured.per_clock(name)
        fs = np.asarray(clocks[::-1], dtype=float)
        ts, es = np.asarray(t[::-1]), np.asarray(e[::-1])
        if name == "idle":

            def idle(km: KernelModel, fs: np.ndarray = fs, ts: np.ndarray = ts) -> tuple[np.ndarray, np.ndarray]:
                return ts, km.power_w(fs, 0.0, 0.0) * ts

            out.append(Series("idle", fs, ts, es, idle))
            continue

        def predict(km: KernelModel, op: Op = ops[name], fs: np.ndarray = fs) -> tuple[np.ndarray, np.ndarray]:
            prof = km.op_profile([op], fs)
            return prof.time_s[0], prof.energy_j[0]

        out.append(Series(name, fs, ts, es, predict))
    return out


def attention_free_param() -> FreeParam:
    """The attention kernel's efficiency, freed when the attention microbenchmark is fitted too."""
    return FreeParam("attention_efficiency", 0.1, 1.0, 0.3)


def counter_period(device: GPUDevice, work: Any, sync: Any, seconds: float) -> dict[str, Any]:
    """The energy counter under load (hardware/measure.py: sample_energy_counter), work flushed after."""
    return sample_energy_counter(device, seconds, work, sync)


def calibrate_run(
    device: GPUDevice,
    *,
    dry_run: bool,
    sim: SimulationHooks | None,
    seconds: float,
    progress: Callable[[str], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> tuple[Calibration, dict[str, Any]]:
    """`kareus calibrate --run`: warm up, sweep GEMM, copy and idle over the clock grid in interleaved random
    order with windows of >= `seconds` (s) and >= 10 counter periods, fit; (calibration, measurement record)."""
    if device.read_only:  # each window is labelled with the clock it locked: read-only, none is locked
        raise ClockControlError(
            "calibrating with microbenchmarks locks the SM clock at each measured clock; this "
            "device is read-only (--no-clock-control or KAREUS_GPU_READ_ONLY), so it would "
            "measure nothing"
        )
    torch = load_torch(cuda=not dry_run)
    sizes = DRY_RUN_SIZES if dry_run else FULL_SIZES
    gpu = device.spec
    names = ["gemm", "copy", "idle"]
    kernels, sync = torch_kernels(torch, "cpu" if dry_run else f"cuda:{device.index}", sizes, names)
    ops = kernel_ops(sizes)
    supported = device.supported_sm_clocks_mhz() or gpu.sm_clocks_mhz
    clocks = list(clock_grid_mhz(supported, MICROBENCH_CLOCK_STEP_MHZ, MICROBENCH_LOWEST_FRACTION))
    if dry_run:
        policy = WindowPolicy(
            min_window_s=min(seconds, 0.02), cooldown_s=0.0, repeats=2, warmup_max_s=0.05, warmup_stable_s=0.02
        )
        clocks = clocks[:: max(1, len(clocks) // 6)]
    else:
        policy = WindowPolicy(min_window_s=seconds)
    counter = counter_period(device, kernels["gemm"], sync, 0.1 if dry_run else 2.0)
    period = counter["update_period_s"] if not dry_run else 0.0
    while policy.repeats > 1 and sweep_seconds(policy, period, len(clocks), len(names)) > CALIBRATE_BUDGET_S:
        policy = dataclasses.replace(policy, repeats=policy.repeats - 1)
    while len(clocks) > 6 and sweep_seconds(policy, period, len(clocks), len(names)) > CALIBRATE_BUDGET_S:
        clocks = clocks[::2] if clocks[-1] in clocks[::2] else clocks[::2] + clocks[-1:]
    if on_plan is not None:
        on_plan(len(clocks) * len(names) * policy.repeats)
    activity = model_activity(KernelModel(gpu), ops) if sim is not None else None
    try:
        measured = sweep(
            device,
            kernels,
            sync,
            clocks,
            policy,
            period,
            warmup_kernel="gemm",
            sim=sim,
            activity=activity,
            progress=progress,
        )
    finally:
        device.reset_clocks()
    meas: dict[str, Sequence[tuple[float, float]]] = {}
    for name in names:
        cl, t, e = measured.per_clock(name)
        meas[name] = list(zip(t[::-1], e[::-1]))
        fit_clocks = cl[::-1]
    m, n, k = sizes.gemm_mnk
    source = (
        f"kareus calibrate --run{' --dry-run (simulated)' if dry_run else ''} on GPU {device.index} "
        f"({gpu.name}): bf16 GEMM {m}x{n}x{k}, {sizes.copy_bytes / 2**20:g} MiB copy, idle; clocks "
        f"{fit_clocks[0]}..{fit_clocks[-1]} MHz in random order x{policy.repeats}, windows "
        f">= {measured.window_s:.2f} s"
    )
    cal = fit_microbenchmarks(
        gpu, fit_clocks, meas, source, verbose=False, ops={k: v for k, v in ops.items() if k in names}
    )
    record = {"energy_counter": counter, **measured.to_dict(), "repeats": policy.repeats}
    return cal.model_copy(update={"fit": {**cal.fit, "protocol": record}}), record
