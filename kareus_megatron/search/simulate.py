"""Event simulation of a pipeline plan: instruction start/end times (s), iteration time (s), energy (J).

Every instruction starts as soon as its rank has finished the previous instruction and its data has
arrived (predecessor's end plus P2P lag): the as-soon-as-possible schedule that the frameworks run. The
*iteration time* T is the latest rank end (last instruction plus DP gradient reduction). The *energy* of
the iteration, over every GPU of the job, is cost/energy.py's ``iteration_energy_j``: each instruction's
energy plus the blocked power ``p_blocked_w`` (W) over each rank's idle time T - busy_rank (pipeline
bubbles, waiting for data, P2P, the gradient reduction, waiting for the slowest rank). Arrays may carry
leading batch dimensions, so many plans are simulated at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.cost.energy import idle_time_s, iteration_energy_j
from kareus_megatron.errors import ConfigError
from kareus_megatron.search.pipeline import PipelineDAG


def earliest_times(dag: PipelineDAG, dur_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ASAP start and end times (s) of every node for durations `dur_s` (..., n); returns (start, end)."""
    dur = np.asarray(dur_s, dtype=float)
    shape = dur.shape[:-1]
    end = np.zeros(shape + (dag.n + 1,))  # index n: virtual predecessor ending at 0
    start = np.zeros(shape + (dag.n,))
    for lv in dag.levels:
        s = (end[..., dag.pred[lv]] + dag.pred_lag_s[lv]).max(axis=-1)
        start[..., lv] = s
        end[..., lv] = s + dur[..., lv]
    return start, end[..., : dag.n]


def iteration_time(dag: PipelineDAG, end_s: np.ndarray) -> np.ndarray:
    """Iteration time (s): the latest rank end (last instruction end plus DP reduction); shape (...)."""
    return (end_s[..., dag.last_nodes] + dag.end_lag_s).max(axis=-1)


def latest_finish(dag: PipelineDAG, dur_s: np.ndarray, deadline_s: np.ndarray | float) -> np.ndarray:
    """Latest end time (s) of every node such that the iteration still ends by `deadline_s`; (..., n)."""
    dur = np.asarray(dur_s, dtype=float)
    shape = dur.shape[:-1]
    dl = np.broadcast_to(np.asarray(deadline_s, dtype=float), shape)
    lstart = np.empty(shape + (dag.n + 1,))
    lstart[..., dag.n] = dl
    lfin = np.empty(shape + (dag.n,))
    last = dag.last_nodes
    cap = np.full(shape + (dag.n,), np.inf)
    cap[..., last] = dl[..., None] - dag.end_lag_s
    for lv in reversed(dag.levels):
        f = (lstart[..., dag.succ[lv]] - dag.succ_lag_s[lv]).min(axis=-1)
        f = np.minimum(f, cap[..., lv])
        lfin[..., lv] = f
        lstart[..., lv] = f - dur[..., lv]
    return lfin


@dataclass(frozen=True)
class Simulation:
    """Result of simulating one plan: times in s, energy in J (all GPUs)."""

    start_s: np.ndarray  # (n,)
    end_s: np.ndarray  # (n,)
    time_s: float
    energy_j: float
    compute_energy_j: float  # all GPUs, instructions only
    idle_energy_j: float  # all GPUs, blocked power x idle time
    idle_s: np.ndarray  # (pp,) idle time of one GPU of each rank


def simulate(
    dag: PipelineDAG, dur_s: np.ndarray, inst_energy_j: np.ndarray, p_blocked_w: float, gpus_per_stage: int = 1
) -> Simulation:
    """Simulate one plan given each instruction's duration (s) and energy (J, one GPU)."""
    dur = np.asarray(dur_s, dtype=float)
    en = np.asarray(inst_energy_j, dtype=float)
    if dur.shape != (dag.n,) or en.shape != (dag.n,):
        raise ConfigError(f"need one duration and one energy per instruction ({dag.n}), got {dur.shape}, {en.shape}")
    start, end = earliest_times(dag, dur)
    t = float(iteration_time(dag, end))
    busy = np.bincount(dag.stage, weights=dur, minlength=dag.pp)
    idle = idle_time_s(busy, t)  # per rank; never negative here (every rank ends by T)
    comp = gpus_per_stage * float(en.sum())
    total = float(iteration_energy_j(en.sum(), busy.sum(), t, p_blocked_w, gpus_per_stage, ranks=dag.pp))
    return Simulation(start, end, t, total, comp, total - comp, idle)


def option_arrays(
    dag: PipelineDAG, options: Sequence[Any] | Mapping[Any, Any]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-node option time (s) and energy (J) arrays from a sequence by node index or a mapping by node key."""
    if isinstance(options, Mapping):
        missing = [k for k in dag.keys if k not in options]
        if missing:
            raise ConfigError(f"no options for instruction {missing[0]} (stage, kind, microbatch, chunk)")
        seq = [options[k] for k in dag.keys]
    else:
        seq = list(options)
        if len(seq) != dag.n:
            raise ConfigError(f"got options for {len(seq)} instructions; the pipeline has {dag.n}")
    times, energies = [], []
    seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # nodes sharing one options object share arrays
    for key, o in zip(dag.keys, seq):
        if id(o) in seen:
            times.append(seen[id(o)][0])
            energies.append(seen[id(o)][1])
            continue
        t = np.asarray(o.time_s, dtype=float).ravel()
        e = np.asarray(o.energy_j, dtype=float).ravel()
        if t.size == 0 or t.shape != e.shape:
            raise ConfigError(f"instruction {key}: need matching, non-empty time_s and energy_j arrays")
        if not (np.all(np.isfinite(t)) and np.all(np.isfinite(e)) and np.all(t > 0) and np.all(e >= 0)):
            raise ConfigError(f"instruction {key}: option times must be finite and > 0, energies finite and >= 0")
        times.append(t)
        energies.append(e)
        seen[id(o)] = (t, e)
    return times, energies


def simulate_choice(
    dag: PipelineDAG,
    options: Sequence[Any] | Mapping[Any, Any],
    choice: np.ndarray,
    p_blocked_w: float,
    gpus_per_stage: int = 1,
) -> Simulation:
    """Simulate the plan that runs option `choice[i]` of instruction i."""
    times, energies = option_arrays(dag, options)
    ch = np.asarray(choice, dtype=np.int64)
    dur = np.array([t[c] for t, c in zip(times, ch)])
    en = np.array([e[c] for e, c in zip(energies, ch)])
    return simulate(dag, dur, en, p_blocked_w, gpus_per_stage)
