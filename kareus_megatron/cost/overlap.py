"""Cost of ops over a knob grid, and the overlapped-power rule of a partition (time s, energy J, power W).

Terms: the *grid* is SM clocks (MHz, shape (n_clk,)) × comm SMs (shape (n_sms,)); *comm SMs* are the
SMs given to a collective kernel, the rest run compute. A *partition* is a compute segment running
beside a pending collective, issued just before one of the segment's ops (its *launch slot*); the phase
arithmetic is cost/partition.py's ``simulate_overlap``, this module supplies its inputs.

Overlapped-power rule, per compute op ``i`` beside the collective at clock f with s comm SMs:

- the op runs on (SMs - s) SMs and is never faster than on all SMs: ``b_i = max(b_i(SMs - s), a_i)``
  (the kernel model alone would credit the idle SMs' power headroom to a higher sustained clock, but the
  collective's SMs draw that power during the overlap);
- HBM is shared proportionally (cost/partition.py ``contention``): both slow down by ``r``, so the op
  takes ``b_i r`` and the collective progresses at ``1 / r`` of its stand-alone rate;
- power is the board power (hardware/power.py) at clock f with the op's and the collective's compute
  activities added and divided by r (both run r times slower), at most 1, and memory activity
  ``min((d + D) / B, 1)`` (d, D: their HBM demand, B the peak bandwidth, each demand capped at B).

Everything goes through KernelModel.op_profile, so times include the calibration's time scale and powers
the sustained clock, exactly as ``kareus predict`` sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.partition import PhaseArrays, contention, simulate_overlap


class OverlapCost:
    """Cost-model calls with the grid broadcast: clocks (n_clk,) MHz, comm SMs (n_sms,).

    precision: the training precision whose peak the compute ops run at (the planner passes the layout's).
    default_sms: comm SMs of an unrestricted NCCL collective (the kernel parameters' default_comm_sms,
    docs/sources.md#nccl-default-sms), used by the 1-nanobatch order and the nanobatching baseline.
    """

    def __init__(self, kernel: KernelModel, default_sms: int | None = None, precision: str = "bf16") -> None:
        self.kernel = kernel
        self.precision = precision  # the training precision: GEMM and attention peaks (cost/kernel.py)
        self.gpu = kernel.gpu  # the calibrated preset when the kernel carries a calibration
        self.default_sms = int(default_sms if default_sms is not None else round(kernel.params.default_comm_sms))

    def compute(self, ops: Sequence[Any], clocks: np.ndarray, sms: Any = None) -> tuple[np.ndarray, ...]:
        """(time s, power W, HBM bytes/s, compute activity) of ops; arrays (n_ops, *broadcast grid)."""
        prof = self.kernel.op_profile(list(ops), clocks, sms=sms, precision=self.precision)
        return prof.time_s, prof.power_w, prof.hbm_bytes_per_s, prof.compute_activity

    def collective(self, op: Any, clocks: np.ndarray, sms: np.ndarray) -> tuple[np.ndarray, ...]:
        """(time s, power W, HBM bytes/s, compute activity) of a collective alone: arrays (n_clk, n_sms)."""
        full = np.full((1, sms.size), float(self.gpu.sm_count))
        prof = self.kernel.op_profile([op], clocks[:, None], sms=full, comm_sms=np.asarray(sms, float)[None, :])
        return prof.time_s[0], prof.power_w[0], prof.hbm_bytes_per_s[0], prof.compute_activity[0]

    def exposed(self, op: Any, clocks: np.ndarray, sms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) of a collective alone: arrays (n_clk, n_sms)."""
        t, p, _, _ = self.collective(op, clocks, sms)
        return t, t * p

    def phase_arrays(self, compute: Sequence[Any], collective: Any, clocks: np.ndarray, sms: np.ndarray) -> PhaseArrays:
        """Inputs of simulate_overlap for compute ops beside `collective` (the module's overlapped-power rule).

        Arrays broadcast to (n_ops, n_clk, n_sms); clocks in MHz, sms the comm-SM values.
        """
        bw = float(self.gpu.hbm_bytes_per_s)
        c = clocks[:, None]  # (n_clk, 1)
        a, pa, _, _ = self.compute(compute, c)  # (n, n_clk, 1): alone on all SMs
        b, _, d, ca = self.compute(compute, c, sms=(self.gpu.sm_count - sms)[None, :])  # (n, n_clk, n_sms)
        b = np.maximum(b, a)  # fewer SMs never make an op faster (see the module docstring)
        ct, pc, cd, cca = self.collective(collective, clocks, sms)  # (n_clk, n_sms)
        r = contention(d, cd, bw)
        ma = np.minimum((np.minimum(d, bw) + np.minimum(cd, bw)) / bw, 1.0)
        po = self.kernel.power_w(c, np.minimum((ca + cca) / r, 1.0), ma)
        return PhaseArrays(a_s=a, pa_w=pa, w_s=b * r, rho=1.0 / r, po_w=po, coll_s=ct, pc_w=pc)

    def partition(
        self,
        compute: Sequence[Any],
        collective: Any,
        slot_positions: Sequence[int],
        clocks: np.ndarray,
        sms: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) of one partition per launch slot: arrays (n_clk, n_slots, n_sms).

        slot_positions: indices into `compute` of the ops the collective may be issued before.
        """
        t, e = simulate_overlap(self.phase_arrays(compute, collective, clocks, sms))  # axis 0: launch position
        pos = list(slot_positions)
        return np.moveaxis(t[pos], 0, 1), np.moveaxis(e[pos], 0, 1)

    def instance(self, inst: Any, clocks: np.ndarray, sms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """partition() of an object with .compute, .collective and .slot_positions (search.partition's instances)."""
        return self.partition(inst.compute, inst.collective, inst.slot_positions, clocks, sms)

    def alone(self, ops: Sequence[Any], clocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) of ops run back to back (collectives on NCCL's default SMs): arrays (n_clk,)."""
        if not ops:
            z = np.zeros(clocks.shape)
            return z, z.copy()
        t, p, _, _ = self.compute(ops, clocks)
        return t.sum(axis=0), (t * p).sum(axis=0)
