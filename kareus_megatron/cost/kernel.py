"""Kernel time (s) and energy (J) model: roofline per op at an SM clock (MHz) on a number of SMs.

Terms: the *compute roof* is peak FLOP/s × (f / f_max) × (sms / sm_count) × efficiency, where the
GEMM efficiency includes tile and wave quantisation (a GEMM's output tiles are spread over the SMs in
waves; a last, partial wave wastes SMs, so halving a GEMM for nanobatches can cost efficiency); the
*memory roof* is the smooth minimum of the HBM bandwidth and of what the SMs can issue (∝ f·sms), so
memory-bound kernels (norms, rope, activations, copies, the optimizer) slow down at low SM clocks.
An op takes the smooth maximum of its compute and memory times plus a launch overhead per kernel.
*compute_activity* (0..1) is the fraction of the GPU's SM capacity kept busy, *memory_activity* the
fraction of HBM bandwidth used: they drive hardware/power.py. When the board power at the locked
clock would exceed the limit the op runs at the sustained (lower) clock instead.
Collectives: bus bytes / bandwidth + latency; the bandwidth is the smooth minimum of the link's and
of what the collective's SMs can drive (∝ comm SMs × f), so it saturates with the SM count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from kareus_megatron.cost.collectives import algorithm_bandwidth, default_comm_ctas, node_algorithms
from kareus_megatron.cost.params import KernelParams
from kareus_megatron.hardware import power as _power
from kareus_megatron.hardware.gpus import GPUSpec
from kareus_megatron.workload.models import ModelSpec
from kareus_megatron.workload.opgraph import Op, layer_ops, stage_extra_ops
from kareus_megatron.workload.parallel import ParallelConfig

if TYPE_CHECKING:  # pydantic loads only when a calibration is used
    from kareus_megatron.cost.calibration import Calibration

# GEMM output tiles (M×N): the cuBLAS tile set of NVIDIA's Matrix Multiplication Background User's Guide
# (section 2.3, "Typical Tile Dimensions In cuBLAS And Performance": 256×128 and 128×256 most efficient,
# 64×64 least; docs/sources.md#gemm-tiles). The kernel with the best effective utilisation is chosen per
# GEMM and SM count. _TILE_EFF, each tile's throughput at full occupancy relative to 256×128, is an
# engineering prior, not a measurement: it follows the guide's order, and it falls more slowly than the
# operand reuse M·N/(M+N) (1, 0.75, 0.5, 0.375) because reuse caps throughput only where operand bandwidth
# binds.
# A calibration scales all of them together through gemm_efficiency (cost/params.py); `kareus calibrate
# --run` times one large GEMM, so the ratios themselves stay unfitted until a run with small-tile shapes.
_TILES = np.array([[256, 128], [128, 256], [128, 128], [128, 64], [64, 128], [64, 64]], dtype=float)
_TILE_EFF = np.array([1.0, 1.0, 0.94, 0.82, 0.82, 0.62])
_BUS_FACTOR = {  # bus bytes / message bytes for a ring over g GPUs (nccl-tests PERFORMANCE.md definitions)
    "all_reduce": lambda g: 2.0 * (g - 1) / g,
    "all_gather": lambda g: (g - 1) / g,
    "reduce_scatter": lambda g: (g - 1) / g,
    "send_recv": lambda g: 1.0,
}
# HBM bytes a collective moves on one GPU per bus byte (it competes with compute for HBM bandwidth while it
# overlaps, cost/partition.py). Engineering estimate from the ring algorithm, not a measurement
# (docs/sources.md#collective-hbm-traffic): every bus byte is written once into this GPU's memory by its
# ring neighbour and read once to be sent on or stored (2: all-gather); a reduction also reads the local
# operand (3: reduce-scatter); all-reduce is counted at its reduce-scatter phase's 3, the upper of its two
# phases; a send/recv reads or writes each byte once (1).
_HBM_PER_BUS_BYTE = {"all_reduce": 3.0, "all_gather": 2.0, "reduce_scatter": 3.0, "send_recv": 1.0}


def _node_defaults(gpu: GPUSpec, params: KernelParams) -> KernelParams:
    """params with NCCL's default comm SMs of gpu's node (cost/collectives.py) unless they were set otherwise."""
    ctas = default_comm_ctas(gpu)
    if ctas is None or params.default_comm_sms != KernelParams().default_comm_sms:
        return params
    return dataclasses.replace(params, default_comm_sms=float(ctas))


def _zero_shape(comm_sms: ArrayLike | None, sm_clock_mhz: ArrayLike | None) -> tuple[int, ...]:
    """Broadcast shape of a collective's result for these arguments (None = scalar)."""
    sms = () if comm_sms is None else np.shape(np.asarray(comm_sms, dtype=float))
    clk = () if sm_clock_mhz is None else np.shape(np.asarray(sm_clock_mhz, dtype=float))
    return np.broadcast_shapes(sms, clk)


def _coll_family(op: Op) -> str:
    name = op.collective or "send_recv"
    for fam in _BUS_FACTOR:
        if name.endswith(fam):
            return fam
    raise ValueError(f"op {op.name!r} has unknown collective {op.collective!r}")


@dataclass(frozen=True, slots=True)
class OpProfile:
    """Per-op arrays shaped (n_ops, *clock/SM broadcast shape): time (s), activities, HBM rate, clock."""

    time_s: np.ndarray
    compute_activity: np.ndarray
    memory_activity: np.ndarray
    hbm_bytes_per_s: np.ndarray
    sm_clock_mhz: np.ndarray  # clock actually sustained (MHz), after the power limit
    power_w: np.ndarray

    @property
    def energy_j(self) -> np.ndarray:
        """Energy (J) of each op: power × time."""
        return self.power_w * self.time_s


class KernelModel:
    """Time/energy model of one GPU (a preset, optionally calibrated). All methods are vectorised."""

    def __init__(self, gpu: GPUSpec, calibration: Calibration | None = None) -> None:
        self.calibration = calibration
        self.gpu = calibration.apply_to(gpu) if calibration else gpu
        params = KernelParams(**calibration.kernel_params) if calibration else KernelParams()
        self.params = _node_defaults(self.gpu, params)

    @classmethod
    def from_params(cls, gpu: GPUSpec, params: KernelParams) -> KernelModel:
        """A model with explicit kernel parameters (gpu may already carry fitted power fields)."""
        km = cls(gpu)
        km.params = _node_defaults(km.gpu, params)
        return km

    # ---- power ---------------------------------------------------------------------------------
    def power_w(self, sm_clock_mhz: ArrayLike, compute_activity: ArrayLike, memory_activity: ArrayLike) -> np.ndarray:
        """Board power (W) at a locked SM clock (MHz) and activities (0..1), clamped at the limit."""
        return _power.power_w(self.gpu, sm_clock_mhz, compute_activity, memory_activity)

    @property
    def p_blocked_w(self) -> float:
        """Power (W) of a GPU blocked on P2P or idle in a pipeline bubble."""
        return self.gpu.p_blocked_w

    # ---- compute and memory ops ----------------------------------------------------------------
    def gemm_efficiency(self, mnk: np.ndarray, sms: ArrayLike) -> np.ndarray:
        """Fraction of the compute roof a GEMM reaches: (n, 3) shapes × sms broadcast -> (n, *sms.shape)."""
        p = self.params
        s = np.asarray(sms, dtype=float)
        m, n, k = (mnk[:, i].reshape((-1,) + (1,) * s.ndim + (1,)) for i in range(3))
        tm, tn = _TILES[:, 0], _TILES[:, 1]
        tiles = np.ceil(m / tm) * np.ceil(n / tn)
        tile_util = (m * n) / (tiles * tm * tn)
        waves = tiles / s[..., None]
        wave_util = waves / np.ceil(waves)
        best = np.max(_TILE_EFF * tile_util * wave_util, axis=-1)
        k2 = k[..., 0]
        return p.gemm_efficiency * best * (k2 / (k2 + p.gemm_k_half))

    def _times(self, ops: Sequence[Op], f: np.ndarray, s: np.ndarray, precision: str) -> tuple[np.ndarray, ...]:
        """Unscaled (time, compute_activity, memory_activity, hbm rate) of non-communication ops."""
        p, g = self.params, self.gpu
        nd = s.ndim  # f may be per-op (n, *s.shape) or s.shape
        col = (-1,) + (1,) * nd
        flops = np.array([op.flops for op in ops], dtype=float).reshape(col)
        hbm = np.array([op.hbm_bytes for op in ops], dtype=float).reshape(col)
        kernels = np.array([op.kernels for op in ops], dtype=float).reshape(col)
        kind = np.array([op.kind for op in ops])
        clock_frac = f / g.max_sm_clock_mhz
        sm_frac = s / g.sm_count
        peak = g.peak_flops(precision) * clock_frac * sm_frac
        eff = np.ones((len(ops),) + s.shape)
        is_gemm = kind == "gemm"
        if is_gemm.any():
            mnk = np.array([op.gemm_mnk for op in ops if op.kind == "gemm"], dtype=float)
            eff[is_gemm] = self.gemm_efficiency(mnk, s)
        for i, op in enumerate(ops):
            if op.kind == "attention":
                eff[i] = p.attention_bwd_efficiency if op.phase == "backward" else p.attention_efficiency
        is_mem = (kind == "memory").reshape(col)
        vector_peak = g.peak_flops("fp32") * clock_frac * sm_frac  # elementwise math: CUDA-core FP32
        t_c = flops / np.where(is_mem, vector_peak, peak * eff)
        t_m = hbm / (g.hbm_bytes_per_s * p.memory_efficiency)
        # HBM traffic needs bytes in flight, and the SMs issue them at a rate ∝ the SM clock (Little's law): the
        # achieved bandwidth approaches the HBM roof gradually as the SMs' issue rate grows (Volkov 2016, UC
        # Berkeley EECS-2016-143, latency hiding), so memory-bound kernels slow down at low SM clocks.
        t_issue = hbm / (s * f * 1e6 * p.sm_load_bytes_per_cycle)
        qm = p.memory_issue_sharpness
        t_m = (t_m**qm + t_issue**qm) ** (1.0 / qm)
        q = p.roofline_sharpness
        with np.errstate(divide="ignore", invalid="ignore"):
            hi = np.maximum(t_c, t_m)
            busy = np.where(
                hi > 0,
                hi * ((t_c / np.where(hi > 0, hi, 1)) ** q + (t_m / np.where(hi > 0, hi, 1)) ** q) ** (1 / q),
                0.0,
            )
        t = busy + kernels * p.launch_overhead_s
        safe = np.where(t > 0, t, 1.0)
        act_scale = np.where(kind == "attention", p.attention_activity, 1.0).reshape(col)
        # A GEMM's activity is its achieved FLOP rate against a large, wave-aligned GEMM's (the roof at
        # gemm_efficiency): SMs idle in a partial last wave or waiting on a short reduction draw no tensor power.
        eff_ref = np.where(is_gemm, p.gemm_efficiency, eff.reshape(len(ops), -1)[:, 0]).reshape(col)
        t_ref = np.where(is_gemm.reshape(col), flops / (peak * eff_ref), t_c)
        ca = np.where(
            is_mem,
            np.maximum(p.memory_op_compute_activity, np.maximum(t_c, t_issue) / safe) * (busy / safe),
            act_scale * t_ref / safe,
        )
        ca = np.clip(ca * sm_frac, 0.0, 1.0) * (t > 0)
        rate = hbm / safe
        return t, ca, np.clip(rate / g.hbm_bytes_per_s, 0.0, 1.0), rate

    def op_profile(
        self,
        ops: Sequence[Op],
        sm_clock_mhz: ArrayLike,
        sms: ArrayLike | None = None,
        *,
        precision: str = "bf16",
        comm_sms: ArrayLike | None = None,
    ) -> OpProfile:
        """Time (s), activities, HBM rate, sustained clock (MHz) and power (W) of each op.

        Arrays are shaped (len(ops), *broadcast(sm_clock_mhz, sms)). sms=None: all SMs. Collective
        ops use comm_sms SMs (default: the NCCL default of the calibration).
        """
        f0 = np.asarray(sm_clock_mhz, dtype=float)
        s0 = np.asarray(self.gpu.sm_count if sms is None else sms, dtype=float)
        f0, s0 = np.broadcast_arrays(f0, s0)
        shape = (len(ops),) + f0.shape
        out = {k: np.zeros(shape) for k in ("t", "ca", "ma", "rate", "clk", "pw")}
        comm_idx = [i for i, op in enumerate(ops) if op.kind in ("collective", "p2p")]
        work_idx = [i for i, op in enumerate(ops) if op.kind not in ("collective", "p2p")]
        if work_idx:
            work = [ops[i] for i in work_idx]
            f = np.broadcast_to(f0, (len(work),) + f0.shape).astype(float)
            # Fixed point: the sustained clock depends on the activity, the activity on the clock. A fixed
            # number of rounds keeps every element independent of the others (scalar = vector results).
            for it in range(4):
                t, ca, ma, rate = self._times(work, f, s0, precision)
                f_new = _power.sustained_clock_mhz(self.gpu, f0, ca, ma)
                if it == 0 and np.array_equal(f_new, f):
                    break  # nothing is power-limited
                f = f_new
            else:
                t, ca, ma, rate = self._times(work, f, s0, precision)
            out["t"][work_idx], out["ca"][work_idx], out["ma"][work_idx] = t, ca, ma
            out["rate"][work_idx], out["clk"][work_idx] = rate, f
        csms = None if comm_sms is None else np.asarray(comm_sms, dtype=float)
        for i in comm_idx:
            op = ops[i]
            t = np.broadcast_to(self.collective_time_s(op, csms, f0), shape[1:])
            rate = np.broadcast_to(self.collective_hbm_bytes_per_s(op, csms, f0), shape[1:])
            out["t"][i] = t
            out["rate"][i] = rate
            out["ma"][i] = np.clip(rate / self.gpu.hbm_bytes_per_s, 0, 1)
            out["ca"][i] = np.broadcast_to(self.collective_compute_activity(op, csms, f0), shape[1:]) * (t > 0)
            out["clk"][i] = f0
        out["t"] *= self.params.time_scale
        pw = self.power_w(out["clk"], out["ca"], out["ma"])
        return OpProfile(out["t"], out["ca"], out["ma"], out["rate"], out["clk"], pw)

    # ---- collectives ---------------------------------------------------------------------------
    def _collective(
        self, op: Op, comm_sms: ArrayLike | None, sm_clock_mhz: ArrayLike | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(time s, bandwidth bytes/s, SM drive bytes/s, HBM bytes per bus byte, CTAs) of a collective, group > 1.

        comm_sms=None: NCCL's default (each algorithm's own channel count on a node with an algorithm table).
        On a node with an algorithm table (cost/collectives.py) the fastest algorithm serving the op is taken.
        """
        p, g = self.params, self.gpu
        f = np.asarray(g.max_sm_clock_mhz if sm_clock_mhz is None else sm_clock_mhz, dtype=float)
        fam = _coll_family(op)
        bus = op.comm_bytes * _BUS_FACTOR[fam](op.group_size)
        algos = [a for a in node_algorithms(g) if fam in a.families] if op.link != "network" else []
        if not algos:
            sms = np.maximum(np.asarray(p.default_comm_sms if comm_sms is None else comm_sms, dtype=float), 1e-9)
            link = (
                g.internode_bytes_per_s * p.network_efficiency
                if op.link == "network"
                else (g.nvlink_bytes_per_s * p.nvlink_efficiency)
            )
            drive = sms * p.comm_sm_bytes_per_cycle * f * 1e6
            q = p.comm_sharpness
            bw = (link**-q + drive**-q) ** (-1.0 / q)
            lat = p.network_latency_s if op.link == "network" else p.nvlink_latency_s
            t = op.kernels * lat + bus / bw
            t, bw, drive, hbm, sms = np.broadcast_arrays(t, bw, drive, np.asarray(_HBM_PER_BUS_BYTE[fam]), sms)
            return t, bw, drive, hbm, sms
        scale = p.nvlink_efficiency / KernelParams().nvlink_efficiency  # a calibration scales every ceiling
        best: tuple[np.ndarray, ...] | None = None
        for a in algos:
            ctas = np.maximum(np.asarray(a.default_ctas if comm_sms is None else comm_sms, dtype=float), 1e-9)
            bw = algorithm_bandwidth(a, ctas, f, scale, group_size=op.group_size)
            t = op.kernels * (p.nvlink_latency_s if a.latency_s is None else a.latency_s) + bus / bw
            drive = ctas * a.cta_bytes_per_cycle * f * 1e6
            per_bus = _HBM_PER_BUS_BYTE[fam] if a.hbm_per_bus_byte is None else a.hbm_per_bus_byte
            cand = np.broadcast_arrays(t, bw, drive, np.asarray(per_bus), ctas)
            best = cand if best is None else tuple(np.where(cand[0] < best[0], c, b) for c, b in zip(cand, best))
        assert best is not None
        return best[0], best[1], best[2], best[3], best[4]

    def collective_compute_activity(
        self, op: Op, comm_sms: ArrayLike | None, sm_clock_mhz: ArrayLike | None = None
    ) -> np.ndarray:
        """Compute activity (0..1) of a collective: its SMs' share, weighted by how busy they keep driving data.

        A link-bound collective (slow link, many SMs) leaves its SMs mostly waiting: the activity is
        comm_sms / sm_count × comm_compute_activity × (achieved bandwidth / what the SMs could drive).
        """
        if op.group_size <= 1 or op.comm_bytes <= 0:
            return np.zeros(_zero_shape(comm_sms, sm_clock_mhz))
        _, bw, drive, _, ctas = self._collective(op, comm_sms, sm_clock_mhz)
        busy = np.clip(bw / drive, 0.0, 1.0)
        return np.clip(ctas / self.gpu.sm_count * self.params.comm_compute_activity * busy, 0.0, 1.0)

    def collective_time_s(
        self, op: Op, comm_sms: ArrayLike | None, sm_clock_mhz: ArrayLike | None = None
    ) -> np.ndarray:
        """Time (s) of a collective/P2P op on comm_sms SMs (None: NCCL's default) at sm_clock_mhz (MHz; default max)."""
        if op.group_size <= 1 or op.comm_bytes <= 0:
            return np.zeros(_zero_shape(comm_sms, sm_clock_mhz))
        return self._collective(op, comm_sms, sm_clock_mhz)[0]

    def collective_hbm_bytes_per_s(
        self, op: Op, comm_sms: ArrayLike | None, sm_clock_mhz: ArrayLike | None = None
    ) -> np.ndarray:
        """HBM traffic (bytes/s) a collective generates while it runs (reads, writes, reductions)."""
        if op.group_size <= 1 or op.comm_bytes <= 0:
            return np.zeros(_zero_shape(comm_sms, sm_clock_mhz))
        t, _, _, per_bus, _ = self._collective(op, comm_sms, sm_clock_mhz)
        return op.comm_bytes * _BUS_FACTOR[_coll_family(op)](op.group_size) * per_bus / t

    # ---- pipeline instructions -----------------------------------------------------------------
    def instruction_ops(
        self, model: ModelSpec, par: ParallelConfig, stage: int, phase: str, chunk: int = 0
    ) -> tuple[tuple[Op, ...], tuple[Op, ...], int]:
        """(layer ops, stage extra ops, layer count) of one forward/backward instruction of one microbatch."""
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward' or 'backward', not {phase!r}")
        if not 0 <= stage < par.pp or not 0 <= chunk < par.vp:
            raise ValueError(f"stage {stage} / chunk {chunk} outside PP={par.pp}, VP={par.vp}")
        layer = layer_ops(model, par, phase)
        if phase == "backward":
            layer = layer_ops(model, par, "recompute") + layer
        return layer, stage_extra_ops(model, par, stage, phase, chunk=chunk), par.chunk_layers(stage, chunk)

    def instruction_cost(
        self, model: ModelSpec, par: ParallelConfig, stage: int, phase: str, sm_clock_mhz: ArrayLike, chunk: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """(time_s, energy_j) of one GPU running one forward/backward instruction at each SM clock (MHz).

        The Megatron/Perseus baseline: one nanobatch, ops run one after another, collectives exposed
        (NCCL default SM count); backward includes the recompute pass. Shapes follow sm_clock_mhz.
        """
        layer, extra, n_layers = self.instruction_ops(model, par, stage, phase, chunk)
        prof = self.op_profile(layer + extra, sm_clock_mhz, precision=par.precision)
        weight = np.r_[np.full(len(layer), float(n_layers)), np.ones(len(extra))].reshape(
            (-1,) + (1,) * (prof.time_s.ndim - 1)
        )
        return (weight * prof.time_s).sum(axis=0), (weight * prof.energy_j).sum(axis=0)
