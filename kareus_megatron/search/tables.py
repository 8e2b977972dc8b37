"""Knob tables: time (s) and energy (J) of one layer's partitions over clock × launch slot × comm SMs.

Terms: a *phase table* holds, for one phase (forward, backward, recompute) of ONE transformer layer
on one GPU and every SM clock of the grid:

- ``seq_*``: the layer with 1 nanobatch (Megatron's order, collectives exposed on NCCL's default SMs);
- ``alone_*``: with 2 nanobatches, the work no knob changes (nb0's first segment, the tails, the last
  collective);
- ``partitions[name]``: a PartitionTable with the time and energy of every knob setting, summed over
  the instances of that partition in the layer (see search/partition.py; the layer's last collective
  runs on NCCL's default SMs and belongs to ``alone_*``).

The cost model is called once per op list with the whole grid broadcast (cost/partition.py does the
phase arithmetic), so a table costs a few numpy calls regardless of the grid size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kareus_megatron.cost.partition import PhaseArrays, contention, simulate_overlap
from kareus_megatron.search.partition import LayerSchedule, PartitionInstance, collective_kind, layer_schedule
from kareus_megatron.workload.opgraph import layer_ops

A100_SM_COUNT = 108
# Knob ranges the Kareus authors searched on A100 (domain.md §2), scaled by the GPU's SM count.
TP_COMM_SMS_A100: tuple[int, ...] = tuple(range(3, 31, 3))
CP_COMM_SMS_A100: tuple[int, ...] = tuple(range(1, 21))
# NCCL's default on an 8×A100 NVSwitch node: 24 ring channels, one CTA (one SM) each
# ("NCCL INFO Channel 23/24" in the logs of NVIDIA/nccl-tests#100 and NVIDIA/nccl#578).
NCCL_DEFAULT_SMS_A100 = 24


def scale_sms(gpu: Any, values: Sequence[int]) -> np.ndarray:
    """SM counts from an A100 range scaled to gpu.sm_count: unique, ascending, in 1..sm_count-1."""
    v = np.rint(np.asarray(values, dtype=float) * gpu.sm_count / A100_SM_COUNT).astype(np.int64)
    return np.unique(np.clip(v, 1, gpu.sm_count - 1))


def default_comm_sms(gpu: Any, kernel: Any | None = None) -> int:
    """Comm SMs of an unrestricted NCCL collective: the kernel model's value, else NCCL's A100 default scaled."""
    params = getattr(kernel, "params", None)
    if params is not None and getattr(params, "default_comm_sms", None):
        return int(round(float(params.default_comm_sms)))
    return int(scale_sms(gpu, [NCCL_DEFAULT_SMS_A100])[0])


def comm_sms_range(gpu: Any, partition: str) -> np.ndarray:
    """Comm-SM knob values (ascending) searched for `partition` on `gpu`."""
    kind = collective_kind(partition)
    return scale_sms(gpu, CP_COMM_SMS_A100 if kind.startswith("cp_") else TP_COMM_SMS_A100)


@dataclass(frozen=True, slots=True)
class PartitionTable:
    """One partition name in one layer: time/energy per (clock, slot, comm SMs), summed over instances."""

    name: str
    slots: tuple[str, ...]
    comm_sms: np.ndarray  # (n_sms,)
    time_s: np.ndarray  # (n_clk, n_slots, n_sms)
    energy_j: np.ndarray
    instances: int


@dataclass(frozen=True, slots=True)
class PhaseTable:
    """One layer of one phase at every clock of `clocks_mhz` (see module docstring)."""

    phase: str
    clocks_mhz: np.ndarray
    seq_time_s: np.ndarray  # (n_clk,)
    seq_energy_j: np.ndarray
    alone_time_s: np.ndarray  # (n_clk,) 2 nanobatches, no knob
    alone_energy_j: np.ndarray
    partitions: dict[str, PartitionTable] = field(default_factory=dict)
    schedule: LayerSchedule | None = None


class CostAdapter:
    """The cost-model calls the tables need, with the grid broadcast: clocks (n_clk,), comm SMs (n_sms,).

    Everything goes through KernelModel.op_profile, so times include the calibration's time scale and
    powers the sustained clock, exactly as `kareus predict` sees them.
    """

    def __init__(self, gpu: Any, kernel: Any, default_sms: int | None = None):
        self.gpu = getattr(kernel, "gpu", gpu)  # the calibrated preset when the kernel carries one
        self.kernel = kernel
        self.default_sms = int(default_sms or default_comm_sms(gpu, kernel))

    def compute(self, ops: Sequence[Any], clocks: np.ndarray, sms: Any = None) -> tuple[np.ndarray, ...]:
        """(time s, power W, HBM bytes/s, compute activity) of ops; arrays (n_ops, *broadcast grid)."""
        prof = self.kernel.op_profile(list(ops), clocks, sms=sms)
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

    def instance(self, inst: PartitionInstance, clocks: np.ndarray, sms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) of one partition instance: arrays (n_clk, n_slots, n_sms)."""
        bw = float(self.gpu.hbm_bytes_per_s)
        c = clocks[:, None]  # (n_clk, 1)
        a, pa, _, _ = self.compute(inst.compute, c)  # (n, n_clk, 1)
        b, _, d, ca = self.compute(inst.compute, c, sms=(self.gpu.sm_count - sms)[None, :])  # (n, n_clk, n_sms)
        # Fewer SMs never make an op faster: op_profile alone would credit the idle SMs' power headroom
        # to a higher sustained clock, but the collective's SMs draw that power during the overlap.
        b = np.maximum(b, a)
        ct, pc, cd, cca = self.collective(inst.collective, clocks, sms)  # (n_clk, n_sms)
        r = contention(d, cd, bw)
        ma = np.minimum((np.minimum(d, bw) + np.minimum(cd, bw)) / bw, 1.0)
        po = self.kernel.power_w(c, np.minimum((ca + cca) / r, 1.0), ma)
        arrays = PhaseArrays(a_s=a, pa_w=pa, w_s=b * r, rho=1.0 / r, po_w=po, coll_s=ct, pc_w=pc)
        t, e = simulate_overlap(arrays)  # (n_ops, n_clk, n_sms): axis 0 = launch slot position
        pos = list(inst.slot_positions)
        return np.moveaxis(t[pos], 0, 1), np.moveaxis(e[pos], 0, 1)

    def alone(self, ops: Sequence[Any], clocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) of ops run back to back (collectives on NCCL's default SMs): arrays (n_clk,)."""
        if not ops:
            z = np.zeros(clocks.shape)
            return z, z.copy()
        t, p, _, _ = self.compute(ops, clocks)
        return t.sum(axis=0), (t * p).sum(axis=0)


def phase_table(
    adapter: CostAdapter, model: Any, par: Any, phase: str, clocks_mhz: Sequence[int], nanobatches: int = 2
) -> PhaseTable:
    """Knob tables of one layer of `phase` at every clock (1-nanobatch order and `nanobatches` overlap)."""
    clocks = np.asarray(clocks_mhz, dtype=float)
    gpu = adapter.gpu
    default = np.array([adapter.default_sms], dtype=float)
    seq_t, seq_e = adapter.alone(layer_ops(model, par, phase, 1), clocks)  # Megatron's order
    seq = layer_schedule(phase, layer_ops(model, par, phase, 1), 1)
    if nanobatches == 1:
        return PhaseTable(phase, clocks, seq_t, seq_e, seq_t, seq_e, {}, seq)
    sched = layer_schedule(phase, layer_ops(model, par, phase, nanobatches), nanobatches)
    alone_t, alone_e = adapter.alone(sched.alone, clocks)
    for inst in sched.fixed:  # the last collective beside the tails, on NCCL's default SMs
        t, e = adapter.instance(inst, clocks, default)
        alone_t, alone_e = alone_t + t[:, 0, 0], alone_e + e[:, 0, 0]
    for op in sched.exposed:
        t, e = adapter.exposed(op, clocks, default)
        alone_t, alone_e = alone_t + t[:, 0], alone_e + e[:, 0]
    tables: dict[str, PartitionTable] = {}
    slots = sched.slots()
    for name in sched.partition_names():
        sms = np.union1d(comm_sms_range(gpu, name), default)  # the baselines' default is always a knob
        t = np.zeros((clocks.size, len(slots[name]), sms.size))
        e = np.zeros_like(t)
        for inst in sched.instances:
            if inst.name == name:
                ti, ei = adapter.instance(inst, clocks, sms)
                t, e = t + ti, e + ei
        tables[name] = PartitionTable(name, slots[name], sms.astype(np.int64), t, e, sched.count(name))
    return PhaseTable(phase, clocks, seq_t, seq_e, alone_t, alone_e, tables, sched)
