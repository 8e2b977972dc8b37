"""Per-instruction time–energy options of each planning method (one GPU; time s, energy J).

Terms: an *instruction* is the forward or backward pass of one microbatch through one model chunk of
one pipeline stage, keyed ``(stage, chunk, kind)``; an *option* is one way to run it: an SM clock
(MHz), a nanobatch count, and per partition (comm SMs, launch slot). Options of an instruction are
Pareto-filtered and sorted fastest first (energy strictly decreasing).

An instruction is its chunk's layers (forward; or recompute + backward with activation recompute),
all alike, plus the stage's extra work (embedding, final norm, output layer, loss) on the full
microbatch. Its cost with 2 nanobatches at clock f is
``L × (alone(f) + Σ_partitions table_p(f, knob_p)) + extras(f)``; the knobs of different partitions are
independent, so the frontier at f is an exact Pareto sum of the partitions' frontiers. With cross-layer
overlap (``cross_layer``; the overlap engine runs it with and without SP) the L layers cost the layer table
once and its ``inner`` table L - 1 times (search/tables.py), with the same knobs.

Methods (the same machinery):

- ``megatron``: 1 nanobatch at the max clock (a single option);
- ``perseus``: 1 nanobatch, any clock of the grid;
- ``nanobatch_perseus``: 2 nanobatches, every collective launched at the segment start on NCCL's
  default comm SMs (search/tables.py), any clock;
- ``kareus``: union over clocks, nanobatch counts 1 and 2 and every knob setting.

The schedule decides which nanobatch counts exist at all (search/schedules.py ``SCHEDULE_NANOBATCHES``):
for a schedule whose runtime has no overlap engine (DeepSpeed's ``deepspeed-train``) the tables hold
1 nanobatch only, so ``kareus`` plans clocks only and ``nanobatch_perseus`` is infeasible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kareus_megatron.cost.overlap import OverlapCost
from kareus_megatron.errors import ConfigError, InfeasibleConfigError, KareusError
from kareus_megatron.search.compose import pareto_compose, union_frontier
from kareus_megatron.search.frontier import pareto_indices
from kareus_megatron.search.schedules import overlap_blocker
from kareus_megatron.search.tables import PhaseTable, phase_table
from kareus_megatron.vocab import (
    KAREUS,
    MEGATRON,
    NANOBATCH_PERSEUS,
    OPTION_METHODS,
    PERSEUS,
    POWERCAP,
    SCHEDULE_1F1B,
    SUPPORTED_NANOBATCHES,
)
from kareus_megatron.workload.opgraph import stage_extra_ops

OptionKey = tuple[int, int, str]  # (stage, chunk, kind)


@dataclass(frozen=True, slots=True)
class InstructionOptions:
    """Pareto options of one instruction on one GPU, fastest first (energy strictly decreasing).

    partitions[k]: partition name → (comm SMs, launch slot) of option k; empty for 1 nanobatch.
    """

    time_s: np.ndarray
    energy_j: np.ndarray
    clock_mhz: np.ndarray
    nanobatches: np.ndarray
    partitions: list[dict[str, tuple[int, str]]] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.time_s.size)


def check_nanobatches(par: Any, nanobatches: int) -> int:
    """`nanobatches` if supported and dividing the microbatch; InfeasibleConfigError otherwise."""
    if nanobatches not in SUPPORTED_NANOBATCHES:
        raise InfeasibleConfigError(
            f"{nanobatches} nanobatches is not supported; use one of {', '.join(map(str, SUPPORTED_NANOBATCHES))}."
        )
    if par.micro_batch_size % nanobatches:
        raise InfeasibleConfigError(
            f"{nanobatches} nanobatches do not divide the microbatch of {par.micro_batch_size} samples; "
            f"use --nanobatches 1 or an --mbs divisible by {nanobatches}."
        )
    return nanobatches


def instruction_phases(par: Any, kind: str) -> tuple[str, ...]:
    """Layer phases an instruction of `kind` runs: forward; or (recompute,) backward."""
    if kind == "forward":
        return ("forward",)
    if kind != "backward":
        raise ValueError(f"kind must be 'forward' or 'backward', not {kind!r}")
    return ("recompute", "backward") if par.recompute != "none" else ("backward",)


class LayerTables:
    """Phase tables of one (GPU, model, layout, cost model, clock grid, schedule): shared by methods.

    `schedule` names the pipeline schedule the plan runs on; without an overlap engine for it
    (``overlap_blocker``) the tables hold 1 nanobatch only and ``overlap_error`` says why. `phases`: the layer
    phases to tabulate (default all three; search/bands.py asks only for those the instructions run).
    """

    def __init__(
        self,
        gpu: Any,
        model: Any,
        par: Any,
        kernel: Any,
        clocks_mhz: Sequence[int],
        schedule: str = SCHEDULE_1F1B,
        cross_layer: bool = False,
        phases: Sequence[str] = ("forward", "backward", "recompute"),
    ):
        self.gpu, self.model, self.par, self.kernel, self.schedule = gpu, model, par, kernel, schedule
        self.cross_layer = cross_layer
        self.clocks_mhz = np.asarray(clocks_mhz, dtype=np.int64)
        self.adapter = OverlapCost(kernel, precision=par.precision)
        self.overlap_error: KareusError | None = None  # why 2 nanobatches cannot run, if they cannot
        self.phases: dict[str, PhaseTable] = {}
        nb = 2
        try:
            blocked = overlap_blocker(schedule)
            if blocked is not None:
                raise InfeasibleConfigError(f"{blocked}; plan it with 1 nanobatch")
            check_nanobatches(par, nb)
            for ph in phases:
                self.phases[ph] = phase_table(self.adapter, model, par, ph, self.clocks_mhz, nb, cross_layer)
        except InfeasibleConfigError as e:
            self.overlap_error = e
            nb = 1
            for ph in phases:
                self.phases[ph] = phase_table(self.adapter, model, par, ph, self.clocks_mhz, 1)
        self.nanobatches = nb
        self._extras: dict[tuple[int, int, str], tuple[np.ndarray, np.ndarray]] = {}

    def extras(self, stage: int, chunk: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) per clock of the stage's non-layer work (full microbatch, 1 nanobatch)."""
        key = (stage, chunk, kind)
        if key not in self._extras:
            ops = stage_extra_ops(self.model, self.par, stage, kind, 1, chunk=chunk)
            clocks = self.clocks_mhz.astype(float)
            t, e = self.adapter.alone([op for op in ops if op.kind != "p2p"], clocks)
            self._extras[key] = (t, e)
        return self._extras[key]

    def sequential(self, stage: int, chunk: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) per clock with 1 nanobatch (Megatron's order)."""
        layers = self.par.chunk_layers(stage, chunk)
        t, e = self.extras(stage, chunk, kind)
        for ph in instruction_phases(self.par, kind):
            t = t + layers * self.phases[ph].seq_time_s
            e = e + layers * self.phases[ph].seq_energy_j
        return t, e

    def overlapped(self, stage: int, chunk: int, kind: str, ci: int, default_only: bool = False):
        """Frontier at clock index ci with 2 nanobatches: (time s, energy J, [partition dict per point]).

        default_only: every partition at (NCCL's default comm SMs, first slot): nanobatching baseline.
        """
        layers = self.par.chunk_layers(stage, chunk)
        et, ee = self.extras(stage, chunk, kind)
        const_t, const_e = float(et[ci]), float(ee[ci])
        parts, meta = [], []
        for ph in instruction_phases(self.par, kind):
            sums: dict[str, tuple[Any, np.ndarray, np.ndarray]] = {}  # name -> (table, time, energy) of the chunk
            for mult, table in self.phases[ph].terms(layers):
                const_t += mult * float(table.alone_time_s[ci])
                const_e += mult * float(table.alone_energy_j[ci])
                for name, p in table.partitions.items():
                    t, e = mult * p.time_s[ci], mult * p.energy_j[ci]  # (n_slots, n_sms)
                    if name in sums:
                        t, e = sums[name][1] + t, sums[name][2] + e
                    sums[name] = (p, t, e)
            for name, (pt, t, e) in sums.items():
                if default_only:
                    j = int(np.flatnonzero(pt.comm_sms == self.adapter.default_sms)[0])
                    t, e = t[:1, j : j + 1], e[:1, j : j + 1]
                    knobs = [(int(pt.comm_sms[j]), pt.slots[0])]
                else:
                    knobs = [(int(s), slot) for slot in pt.slots for s in pt.comm_sms]
                parts.append((t.ravel(), e.ravel()))
                meta.append((name, knobs))
        t, e, choice = pareto_compose(const_t, const_e, parts)
        dicts = [{name: knobs[c] for (name, knobs), c in zip(meta, row)} for row in choice]
        return t, e, dicts


_CACHE: list[tuple[tuple, LayerTables]] = []


def layer_tables(
    gpu: Any,
    model: Any,
    par: Any,
    kernel: Any,
    clocks_mhz: Sequence[int],
    schedule: str = SCHEDULE_1F1B,
    cross_layer: bool = False,
) -> LayerTables:
    """LayerTables for these inputs, reused across methods of one planning run (small identity cache)."""
    key = (id(gpu), id(kernel), model, par, tuple(int(c) for c in clocks_mhz), schedule, cross_layer)
    for k, v in _CACHE:
        if k == key and v.gpu is gpu and v.kernel is kernel:
            return v
    tables = LayerTables(gpu, model, par, kernel, clocks_mhz, schedule, cross_layer)
    _CACHE.append((key, tables))
    del _CACHE[:-4]
    return tables


def _options(parts: list[tuple[np.ndarray, np.ndarray, int, int, list[dict]]], max_points: int | None = None):
    """Pareto union of (time, energy, clock, nanobatches, partition dicts) point sets, as InstructionOptions."""
    source, index, _ = union_frontier([p[0] for p in parts], [p[1] for p in parts], max_points=max_points)
    return InstructionOptions(
        time_s=np.array([parts[s][0][i] for s, i in zip(source, index)], dtype=float),
        energy_j=np.array([parts[s][1][i] for s, i in zip(source, index)], dtype=float),
        clock_mhz=np.array([parts[s][2] for s in source], dtype=np.int64),
        nanobatches=np.array([parts[s][3] for s in source], dtype=np.int64),
        partitions=[dict(parts[s][4][i]) for s, i in zip(source, index)],
    )


def instruction_options(
    tables: LayerTables, stage: int, chunk: int, kind: str, method: str, max_points: int | None = None
) -> InstructionOptions:
    """Options of one instruction for `method` (see module docstring); max_points thins the final set."""
    clocks = tables.clocks_mhz
    parts: list[tuple[np.ndarray, np.ndarray, int, int, list[dict]]] = []
    t1, e1 = tables.sequential(stage, chunk, kind)
    if method in (MEGATRON, PERSEUS, KAREUS):
        idx = [int(np.argmax(clocks))] if method == MEGATRON else range(clocks.size)
        parts += [(t1[i : i + 1], e1[i : i + 1], int(clocks[i]), 1, [{}]) for i in idx]
    if method in (NANOBATCH_PERSEUS, KAREUS):
        if tables.overlap_error is not None:
            if method == NANOBATCH_PERSEUS:
                raise InfeasibleConfigError(f"method {NANOBATCH_PERSEUS}: {tables.overlap_error}")
        else:
            for ci in range(clocks.size):
                t, e, dicts = tables.overlapped(stage, chunk, kind, ci, default_only=method == NANOBATCH_PERSEUS)
                parts.append((t, e, int(clocks[ci]), tables.nanobatches, dicts))
    return _options(parts, max_points)


def build_options(
    gpu: Any,
    model: Any,
    par: Any,
    kernel: Any,
    method: str,
    clocks_mhz: Sequence[int] | None = None,
    *,
    max_points: int | None = None,
    schedule: str = SCHEDULE_1F1B,
    cross_layer: bool = False,
) -> dict[OptionKey, InstructionOptions]:
    """Options of every instruction (stage, chunk, kind) of the layout for `method` on `schedule`; one GPU each.

    Exact Pareto sets by default; max_points keeps at most that many per instruction (evenly in time,
    both ends kept), after which a baseline option may no longer be matched exactly. cross_layer: the
    2-nanobatch options model cross-layer overlap inside each chunk (search/partition.py).
    """
    if method not in OPTION_METHODS:
        raise ConfigError(
            f"method {method!r} has no per-instruction options; those that do: "
            f"{', '.join(OPTION_METHODS)} ({POWERCAP}: search/powercap.py)."
        )
    clocks = tuple(gpu.check_clocks(clocks_mhz)) if clocks_mhz is not None else gpu.clock_grid_mhz()
    if not clocks:
        raise ConfigError("the clock grid is empty; give at least one SM clock (MHz).")
    clocks = tuple(sorted(set(clocks), reverse=True))
    if method == MEGATRON and gpu.max_sm_clock_mhz not in clocks:
        clocks = (gpu.max_sm_clock_mhz, *clocks)
    tables = layer_tables(gpu, model, par, kernel, clocks, schedule, cross_layer)
    out: dict[OptionKey, InstructionOptions] = {}
    for stage in range(par.pp):
        for chunk in range(par.vp):
            for kind in ("forward", "backward"):
                out[(stage, chunk, kind)] = instruction_options(tables, stage, chunk, kind, method, max_points)
    return out


@dataclass(frozen=True, slots=True)
class PartitionFrontier:
    """Knob frontier of one partition in one layer at one clock, fastest first (point 0 = fastest knob)."""

    phase: str
    name: str
    instances: int
    slots: tuple[str, ...]
    comm_sms_range: tuple[int, ...]
    time_s: np.ndarray
    energy_j: np.ndarray
    comm_sms: np.ndarray
    slot: tuple[str, ...]
    default_knob: tuple[int, str]  # the nanobatching baseline's knob: NCCL's default SMs, first slot
    default_time_s: float
    default_energy_j: float


def partition_frontiers(tables: LayerTables, clock_mhz: int) -> list[PartitionFrontier]:
    """Every partition's knob frontier (per layer, one GPU) at `clock_mhz`, phases in execution order."""
    ci = _clock_index(tables, clock_mhz)
    out: list[PartitionFrontier] = []
    for phase in ("forward", "recompute", "backward"):
        table = tables.phases.get(phase)
        if table is None:
            continue
        for name, pt in table.partitions.items():
            t, e = pt.time_s[ci].ravel(), pt.energy_j[ci].ravel()
            idx = pareto_indices(t, e)
            n_sms = pt.comm_sms.size
            j = int(np.flatnonzero(pt.comm_sms == tables.adapter.default_sms)[0])
            out.append(
                PartitionFrontier(
                    phase=phase,
                    name=name,
                    instances=pt.instances,
                    slots=pt.slots,
                    comm_sms_range=tuple(int(s) for s in pt.comm_sms),
                    time_s=t[idx],
                    energy_j=e[idx],
                    comm_sms=pt.comm_sms[idx % n_sms],
                    slot=tuple(pt.slots[i // n_sms] for i in idx),
                    default_knob=(int(pt.comm_sms[j]), pt.slots[0]),
                    default_time_s=float(pt.time_s[ci, 0, j]),
                    default_energy_j=float(pt.energy_j[ci, 0, j]),
                )
            )
    return out


def _clock_index(tables: LayerTables, clock_mhz: int) -> int:
    hit = np.flatnonzero(tables.clocks_mhz == int(clock_mhz))
    if hit.size == 0:
        raise ConfigError(f"SM clock {clock_mhz} MHz is not in the planning grid {tables.clocks_mhz.tolist()}.")
    return int(hit[0])


def evaluate_overlap(
    tables: LayerTables, stage: int, chunk: int, kind: str, clock_mhz: int, config: dict[str, tuple[int, str]]
) -> tuple[float, float]:
    """(time s, energy J) of one instruction with 2 nanobatches and the given knobs at `clock_mhz`.

    Partitions missing from `config` run at (NCCL's default comm SMs, first slot).
    """
    if tables.overlap_error is not None:
        raise tables.overlap_error
    ci = _clock_index(tables, clock_mhz)
    clocks = tables.clocks_mhz[ci : ci + 1].astype(float)
    layers = tables.par.chunk_layers(stage, chunk)
    et, ee = tables.extras(stage, chunk, kind)
    t, e = float(et[ci]), float(ee[ci])
    ad = tables.adapter
    for ph in instruction_phases(tables.par, kind):
        for mult, table in tables.phases[ph].terms(layers):
            t += mult * float(table.alone_time_s[ci])
            e += mult * float(table.alone_energy_j[ci])
            for name, pt in table.partitions.items():
                sms, slot = config.get(name, (ad.default_sms, pt.slots[0]))
                k = pt.slots.index(slot)
                s = np.array([float(sms)])
                for inst in table.schedule.instances:
                    if inst.name == name:
                        ti, ei = ad.instance(inst, clocks, s)
                        t, e = t + mult * float(ti[0, k, 0]), e + mult * float(ei[0, k, 0])
    return t, e
