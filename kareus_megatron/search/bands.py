"""Prediction bands: the planned schedules re-evaluated under drawn cost-model parameters.

A plan's schedule (each instruction's SM clock MHz, nanobatch count, comm SMs and launch slot; a power cap W)
is fixed; only its predicted iteration time (s) and energy (J) move with the parameters. For every drawn cost
model (cost/uncertainty.py) each instruction option is re-costed from that model's layer tables
(search/options.py), the DAG's P2P and DP lags are recomputed, and every plan asked for is simulated again,
clock-change lag and power floor included. The draws are *paired*: draw s is the same parameters for every
method, so differences between methods are taken draw by draw (plan/frontier.py's reduction bands).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.cost.energy import idle_time_s
from kareus_megatron.search.options import InstructionOptions, LayerTables, instruction_phases
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.planner import PlanningResult, node_options, pipeline_comm_times_s
from kareus_megatron.search.segments import lagged_costs, simulate_many
from kareus_megatron.vocab import POWERCAP, MethodName


@dataclass(frozen=True, kw_only=True, slots=True)
class SampledPlans:
    """Predicted time (s) and energy (J, all GPUs) of frontier plans `indices` under each draw: (draws, plans)."""

    indices: tuple[int, ...]
    time_s: np.ndarray
    energy_j: np.ndarray

    def column(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) of frontier plan `index` under every draw."""
        j = self.indices.index(index)
        return self.time_s[:, j], self.energy_j[:, j]


class _Recost:
    """Per instruction key, the table lookups that re-cost each of its options (fixed across draws)."""

    def __init__(self, tables: LayerTables, key: tuple[int, int, str], opts: InstructionOptions) -> None:
        stage, chunk, kind = key
        self.key = key
        clock_index = {int(c): i for i, c in enumerate(tables.clocks_mhz)}
        self.ci = np.array([clock_index[int(c)] for c in opts.clock_mhz], dtype=np.int64)
        self.two = np.asarray(opts.nanobatches) > 1
        # per partition name: (option positions, slot index, comm-SM index) of the 2-nanobatch options
        self.knobs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for ph in instruction_phases(tables.par, kind) if self.two.any() else ():
            for _mult, table in tables.phases[ph].terms(tables.par.chunk_layers(stage, chunk)):
                for name, pt in table.partitions.items():
                    if name in self.knobs:
                        continue
                    rows = np.flatnonzero(self.two)
                    sms = [int(np.flatnonzero(pt.comm_sms == opts.partitions[k][name][0])[0]) for k in rows]
                    slot = [pt.slots.index(opts.partitions[k][name][1]) for k in rows]
                    self.knobs[name] = (rows, np.array(slot, dtype=np.int64), np.array(sms, dtype=np.int64))

    def costs(self, tables: LayerTables) -> tuple[np.ndarray, np.ndarray]:
        """(time s, energy J) of every option under `tables` (a drawn cost model's)."""
        stage, chunk, kind = self.key
        t1, e1 = tables.sequential(stage, chunk, kind)
        t, e = t1[self.ci].astype(float), e1[self.ci].astype(float)
        if not self.two.any():
            return t, e
        rows = np.flatnonzero(self.two)
        ci = self.ci[rows]
        et, ee = tables.extras(stage, chunk, kind)
        t2, e2 = et[ci].astype(float), ee[ci].astype(float)
        for ph in instruction_phases(tables.par, kind):
            for mult, table in tables.phases[ph].terms(tables.par.chunk_layers(stage, chunk)):
                t2 += mult * table.alone_time_s[ci]
                e2 += mult * table.alone_energy_j[ci]
                for name, pt in table.partitions.items():
                    _rows, slot, sms = self.knobs[name]
                    t2 += mult * pt.time_s[ci, slot, sms]
                    e2 += mult * pt.energy_j[ci, slot, sms]
        t[rows], e[rows] = t2, e2
        return t, e


def _phases(par: Any) -> tuple[str, ...]:
    """The layer phases the job's instructions run (recompute only with activation recompute)."""
    return tuple(sorted({ph for kind in ("forward", "backward") for ph in instruction_phases(par, kind)}))


def _drawn_options(
    result: PlanningResult, tables: LayerTables | None, recost: Mapping[MethodName, dict[Any, _Recost]]
) -> dict[MethodName, dict[Any, InstructionOptions]]:
    """Every method's options re-costed from `tables`, a drawn cost model's (powercap apart)."""
    out: dict[MethodName, dict[Any, InstructionOptions]] = {}
    for method, per_key in recost.items():
        opts = result.methods[method].options
        drawn = {}
        for key, rc in per_key.items():
            assert tables is not None  # recost is empty without tables
            t, e = rc.costs(tables)
            o = opts[key]
            drawn[key] = InstructionOptions(
                time_s=t, energy_j=e, clock_mhz=o.clock_mhz, nanobatches=o.nanobatches, partitions=o.partitions
            )
        out[method] = drawn
    return out


def sample_plans(
    result: PlanningResult, kernels: Sequence[Any], indices: Mapping[MethodName, Sequence[int]]
) -> dict[MethodName, SampledPlans]:
    """Frontier plans `indices[method]` of `result` re-evaluated under every cost model of `kernels` (the draws)."""
    from kareus_megatron.search.powercap import powercap_options

    clocks = sorted(
        {
            int(c)
            for mf in result.methods.values()
            if mf.method != POWERCAP
            for o in mf.options.values()
            for c in o.clock_mhz
        },
        reverse=True,
    )
    recost: dict[MethodName, dict[Any, _Recost]] = {}
    latency = result.clock_latency.latency_s if result.clock_latency is not None else 0.0
    durs: dict[MethodName, list[np.ndarray]] = {m: [] for m in indices}
    ens: dict[MethodName, list[np.ndarray]] = {m: [] for m in indices}
    dags = []
    for kernel in kernels:
        tables = (
            LayerTables(
                result.gpu,
                result.model,
                result.par,
                kernel,
                clocks,
                result.schedule,
                result.cross_layer,
                phases=_phases(result.par),
            )
            if clocks
            else None
        )
        if not recost and tables is not None:  # the lookups depend on the options only: built once
            recost = {
                m: {key: _Recost(tables, key, o) for key, o in mf.options.items()}
                for m, mf in result.methods.items()
                if m != POWERCAP and m in indices
            }
        drawn = _drawn_options(result, tables, recost)
        p2p_s, dp_s = pipeline_comm_times_s(result.model, result.par, kernel)
        dag = build_dag(result.orders, p2p_s, dp_s)
        dags.append((dag, float(kernel.p_blocked_w)))
        for method, idx in indices.items():
            mf = result.methods[method]
            if method == POWERCAP:
                caps = np.array([mf.plans[i].power_limit_w for i in idx])
                node_opts = node_options(dag, powercap_options(kernel, result.model, result.par, caps))
                choices = [np.full(dag.n, j, dtype=np.int64) for j in range(len(idx))]
                lag = 0.0
            else:
                node_opts = node_options(dag, drawn[method])
                choices = [np.asarray(mf.plans[i].choice, dtype=np.int64) for i in idx]
                lag = latency
            for ch in choices:
                d, e = lagged_costs(dag, node_opts, ch, lag)
                durs[method].append(d)
                ens[method].append(e)
    out = {}
    for method, idx in indices.items():
        mf = result.methods[method]
        floors = [getattr(mf.plans[i], "power_floor_w", None) for i in idx]
        t = np.empty((len(kernels), len(idx)))
        e = np.empty_like(t)
        extra_w = np.array([0.0 if f is None else float(f) for f in floors])
        for s, (dag, p_blocked_w) in enumerate(dags):
            rows = slice(s * len(idx), (s + 1) * len(idx))
            d, en = np.array(durs[method][rows]), np.array(ens[method][rows])
            t[s], e[s] = simulate_many(dag, d, en, p_blocked_w, result.gpus_per_stage)
            # blocked GPUs held at a plan's power floor (W) where that is above the draw's blocked power
            held_w = np.maximum(extra_w - p_blocked_w, 0.0)
            e[s] += result.gpus_per_stage * held_w * idle_time_s(d.sum(axis=-1), t[s], dag.pp)
        out[method] = SampledPlans(indices=tuple(int(i) for i in idx), time_s=t, energy_j=e)
    return out
