"""Knob tables: time (s) and energy (J) of one layer's partitions over clock × launch slot × comm SMs.

Terms: a *phase table* holds, for one phase (forward, backward, recompute) of ONE transformer layer
on one GPU and every SM clock of the grid:

- ``seq_*``: the layer with 1 nanobatch (Megatron's order, collectives exposed on NCCL's default SMs);
- ``alone_*``: with 2 nanobatches, the work no knob changes (nb0's first segment, the tails, the last
  collective);
- ``partitions[name]``: a PartitionTable with the time and energy of every knob setting, summed over
  the instances of that partition in the layer (see search/partition.py; the layer's last collective
  runs on NCCL's default SMs and belongs to ``alone_*``);
- ``inner`` (cross-layer overlap only): the same tables for what each layer after a model chunk's first
  adds (search/partition.py ``layer_schedule(.., cross_layer=True)``); a chunk of L layers costs the
  layer table once plus ``inner`` L - 1 times (``PhaseTable.terms``).

Every time and energy comes from the cost model (cost/overlap.py's OverlapCost, called once per op list
with the whole grid broadcast), so a table costs a few numpy calls regardless of the grid size; this
module only chooses the knob values and sums instances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kareus_megatron.cost.collectives import comm_sms_grid
from kareus_megatron.cost.overlap import OverlapCost
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search.partition import (
    SP_COLLECTIVES,
    LayerSchedule,
    collective_kind,
    layer_schedule,
    schedule_ops,
)
from kareus_megatron.vocab import MAX_COMM_SM_VALUES
from kareus_megatron.workload.opgraph import layer_ops

# Comm-SM knob values the Kareus authors searched on A100 (TP all-reduce 3..30 in steps of 3, CP
# collectives 1..20; docs/sources.md#kareus-knobs). Other GPUs get them scaled by their SM count relative
# to the preset below.
KNOB_REFERENCE_GPU = "a100-sxm4-40gb"
TP_COMM_SMS_A100: tuple[int, ...] = tuple(range(3, 31, 3))
CP_COMM_SMS_A100: tuple[int, ...] = tuple(range(1, 21))


def scale_sms(gpu: Any, values: Sequence[int]) -> np.ndarray:
    """SM counts from an A100 range scaled to gpu.sm_count: unique, ascending, in 1..sm_count-1."""
    reference_sms = gpu_spec(KNOB_REFERENCE_GPU).sm_count
    v = np.rint(np.asarray(values, dtype=float) * gpu.sm_count / reference_sms).astype(np.int64)
    return np.unique(np.clip(v, 1, gpu.sm_count - 1))


def comm_sms_range(gpu: Any, partition: str) -> np.ndarray:
    """Comm-SM knob values (ascending) searched for `partition` on `gpu`.

    On a node with an NCCL algorithm table (Hopper NVSwitch: ring and NVLS, cost/collectives.py) the grid
    follows from where those algorithms saturate; elsewhere the Kareus A100 grid scaled by the SM count.
    Sequence-parallel partitions (all-gather / reduce-scatter over TP) use the all-gather/reduce-scatter
    algorithms' grid on such a node, and the TP A100 grid elsewhere.
    """
    kind = collective_kind(partition)
    cp = kind.startswith("cp_")
    families: tuple[str, ...] = ("all_gather", "reduce_scatter", "send_recv") if cp else ("all_reduce",)
    if kind in SP_COLLECTIVES:
        families = ("all_gather", "reduce_scatter")
    grid = comm_sms_grid(gpu, families)
    if grid is not None:
        return np.asarray(grid, dtype=np.int64)
    return scale_sms(gpu, CP_COMM_SMS_A100 if cp else TP_COMM_SMS_A100)


def knob_sms(gpu: Any, partition: str, default_sms: int) -> np.ndarray:
    """Comm-SM values (ascending) the planner searches for `partition`: its range plus NCCL's default
    (`default_sms`), thinned evenly to at most vocab.MAX_COMM_SM_VALUES (the range's ends and the default
    kept), the runtime's budget of SM-limited communicators per group (runtime/overlap/comm_groups.py)."""
    values = np.union1d(comm_sms_range(gpu, partition), [int(default_sms)]).astype(np.int64)
    if values.size <= MAX_COMM_SM_VALUES:
        return values
    rest = values[values != int(default_sms)]
    keep = np.unique(np.rint(np.linspace(0, rest.size - 1, MAX_COMM_SM_VALUES - 1)).astype(np.int64))
    return np.union1d(rest[keep], [int(default_sms)]).astype(np.int64)


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
    partitions: dict[str, PartitionTable]
    schedule: LayerSchedule
    inner: PhaseTable | None = None  # cross-layer overlap: what each layer after a chunk's first adds

    def terms(self, layers: int) -> list[tuple[int, PhaseTable]]:
        """(multiplicity, table) pairs whose sum is a chunk of `layers` layers of this phase."""
        if self.inner is None or layers == 1:
            return [(layers, self)]
        return [(1, self), (layers - 1, self.inner)]


def phase_table(
    adapter: OverlapCost,
    model: Any,
    par: Any,
    phase: str,
    clocks_mhz: Sequence[int] | NDArray[np.integer[Any]],
    nanobatches: int = 2,
    cross_layer: bool = False,
) -> PhaseTable:
    """Knob tables of one layer of `phase` at every clock (1-nanobatch order and `nanobatches` overlap).

    cross_layer: also the table of the layers after a chunk's first with cross-layer overlap (``inner``).
    """
    clocks = np.asarray(clocks_mhz, dtype=float)
    seq_t, seq_e = adapter.alone(layer_ops(model, par, phase, 1), clocks)  # Megatron's order
    seq = layer_schedule(phase, layer_ops(model, par, phase, 1), 1)
    if nanobatches == 1:
        return PhaseTable(phase, clocks, seq_t, seq_e, seq_t, seq_e, {}, seq)
    ops = schedule_ops(model, par, phase, nanobatches)  # selective recompute: inside the backward
    sched = layer_schedule(phase, ops, nanobatches)
    alone_t, alone_e, tables = _overlap_tables(adapter, sched, clocks)
    inner = None
    if cross_layer:
        more = layer_schedule(phase, ops, nanobatches, cross_layer=True)
        in_t, in_e, in_tables = _overlap_tables(adapter, more, clocks)
        inner = PhaseTable(phase, clocks, seq_t, seq_e, in_t, in_e, in_tables, more)
    return PhaseTable(phase, clocks, seq_t, seq_e, alone_t, alone_e, tables, sched, inner)


def _overlap_tables(
    adapter: OverlapCost, sched: LayerSchedule, clocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray, dict[str, PartitionTable]]:
    """(time s, energy J) per clock of the work no knob changes, and the partition tables, of `sched`."""
    gpu = adapter.gpu
    default = np.array([adapter.default_sms], dtype=float)
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
        sms = knob_sms(gpu, name, adapter.default_sms).astype(float)  # the baselines' default is always a knob
        t = np.zeros((clocks.size, len(slots[name]), sms.size))
        e = np.zeros_like(t)
        for inst in sched.instances:
            if inst.name == name:
                ti, ei = adapter.instance(inst, clocks, sms)
                t, e = t + ti, e + ei
        tables[name] = PartitionTable(name, slots[name], sms.astype(np.int64), t, e, sched.count(name))
    return alone_t, alone_e, tables
