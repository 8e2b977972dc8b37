"""The power waveform a plan causes, and the frontier of plans that respect a power bound.

Terms (cost/waveform.py for the waveform and its metrics):

- *bound*: ``max_swing`` (fraction: swing ≤ max_swing × the plan's peak power) and/or ``max_ramp_w_per_s``
  (the ramp rate, W/s, of the job's total power).
- *power floor* F (W, one GPU): the power at which a blocked GPU (bubble, waiting for data, gradient
  reduction) is held instead of ``p_blocked_w``, as a hardware power floor (GB200 power smoothing) or a
  power damper (dummy load) does. It raises the waveform's troughs and costs
  ``(F − p_blocked_w) × blocked GPU-seconds`` J per iteration, which is added to the plan's energy.
  F ranges from ``p_blocked_w`` (no floor) to the board power limit.
- *bounded frontier*: for every plan of a method's frontier, the least floor on a grid (then refined by
  bisection) with which it meets the bound; plans that meet it with no floor keep their energy (their
  clocks already fill the bubbles); the Pareto set of what remains, fastest first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.cost.waveform import PowerMetrics, job_parts, metrics_arrays, power_metrics
from kareus_megatron.errors import ConfigError, PlanError
from kareus_megatron.search.pipeline import PipelineDAG
from kareus_megatron.search.simulate import earliest_times, iteration_time

FLOOR_GRID = 33  # floors tried between p_blocked_w and the board limit, before bisection
FLOOR_BISECTIONS = 12  # refinement steps: the floor's cost is then within 1/(32·4096) of the range
_TOL = 1e-9


@dataclass(frozen=True, kw_only=True, slots=True)
class PowerBound:
    """A bound on the job's power: swing ≤ max_swing × peak (fraction) and ramp ≤ max_ramp_w_per_s (W/s)."""

    max_swing: float | None = None
    max_ramp_w_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_swing is not None and not (0.0 <= self.max_swing <= 1.0):
            raise ConfigError(f"--max-swing {self.max_swing:g} must be a fraction of the peak power in [0, 1]")
        if self.max_ramp_w_per_s is not None and not self.max_ramp_w_per_s > 0:
            raise ConfigError(f"--max-ramp {self.max_ramp_w_per_s:g} must be a positive rate in W/s")

    @property
    def active(self) -> bool:
        """Whether any bound is set."""
        return self.max_swing is not None or self.max_ramp_w_per_s is not None

    def describe(self) -> str:
        """The bound as the flags that set it."""
        parts = []
        if self.max_swing is not None:
            parts.append(f"--max-swing {self.max_swing:g}")
        if self.max_ramp_w_per_s is not None:
            parts.append(f"--max-ramp {self.max_ramp_w_per_s:g}")
        return " ".join(parts)

    def met(self, m: Mapping[str, np.ndarray]) -> np.ndarray:
        """Which waveforms (metric arrays of metrics_arrays) meet the bound."""
        ok = np.ones_like(m["peak_power_w"], dtype=bool)
        if self.max_swing is not None:
            ok &= m["swing_w"] <= self.max_swing * m["peak_power_w"] * (1 + _TOL) + _TOL
        if self.max_ramp_w_per_s is not None:
            ok &= m["ramp_w_per_s"] <= self.max_ramp_w_per_s * (1 + _TOL) + _TOL
        return ok


@dataclass(frozen=True, eq=False)
class BoundedPlan:
    """A frontier plan that meets a bound: option per node, time (s), energy (J, floor included), floor (W)."""

    choice: np.ndarray
    time_s: float
    energy_j: float
    power_floor_w: float | None  # None: the clocks alone meet the bound
    power_limit_w: float | None = None  # kept from a powercap plan


def plan_parts(
    dag: PipelineDAG,
    dur_s: np.ndarray,
    energy_j: np.ndarray,
    gpus_per_stage: int,
    start_s: np.ndarray | None = None,
    period_s: float | None = None,
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(A W, B GPUs, step s, T s) of one plan: per-node durations (s) and energies (J, one GPU), ASAP schedule."""
    if start_s is None or period_s is None:
        start_s, end = earliest_times(dag, dur_s)
        period_s = float(iteration_time(dag, end))
    ranks = []
    for order in dag.rank_orders:
        idx = np.asarray(order, dtype=np.int64)
        ranks.append((start_s[idx], start_s[idx] + dur_s[idx], energy_j[idx]))
    a, b, step = job_parts(ranks, period_s, gpus_per_stage)
    return a, b, step, period_s


def waveform_w(a: np.ndarray, b: np.ndarray, p_blocked_w: float, power_floor_w: float | None = None) -> np.ndarray:
    """The job's power (W) per bin: instruction power plus blocked GPUs at the floor (or blocked power)."""
    return a + (p_blocked_w if power_floor_w is None else max(power_floor_w, p_blocked_w)) * b


def plan_metrics(
    dag: PipelineDAG,
    dur_s: np.ndarray,
    energy_j: np.ndarray,
    p_blocked_w: float,
    gpus_per_stage: int,
    power_floor_w: float | None = None,
) -> PowerMetrics:
    """The power metrics of one plan (durations s and energies J of one GPU per node), with its floor (W)."""
    a, b, step, _t = plan_parts(dag, dur_s, energy_j, gpus_per_stage)
    return power_metrics(waveform_w(a, b, p_blocked_w, power_floor_w), step)


def least_floor(
    a: np.ndarray, b: np.ndarray, step_s: float, p_blocked_w: float, max_floor_w: float, bound: PowerBound
) -> tuple[float | None, float, float]:
    """(floor W or None, least swing fraction, least ramp W/s) of one plan under `bound`.

    The floor is the least one (grid, then bisection) with which the waveform meets the bound; None when
    no floor up to `max_floor_w` does. The least swing fraction and ramp over the grid say how close it came.
    """
    floors = np.linspace(p_blocked_w, max(max_floor_w, p_blocked_w), FLOOR_GRID)
    m = metrics_arrays(a[None, :] + floors[:, None] * b[None, :], step_s)
    ok = bound.met(m)
    frac = np.divide(m["swing_w"], m["peak_power_w"], out=np.zeros_like(m["swing_w"]), where=m["peak_power_w"] > 0)
    least = (float(frac.min()), float(m["ramp_w_per_s"].min()))
    if not ok.any():
        return None, *least
    k = int(np.argmax(ok))
    if k == 0:
        return float(p_blocked_w), *least
    lo, hi = float(floors[k - 1]), float(floors[k])
    for _ in range(FLOOR_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if bound.met(metrics_arrays(a + mid * b, step_s)):
            hi = mid
        else:
            lo = mid
    return hi, *least


def bounded_plans(
    dag: PipelineDAG,
    node_opts: list[Any],
    plans: list[Any],
    p_blocked_w: float,
    gpus_per_stage: int,
    max_floor_w: float,
    bound: PowerBound,
    clock_latency_s: float = 0.0,
) -> tuple[list[BoundedPlan], float, float]:
    """The plans of one method's frontier that meet `bound` (each with its least floor), and the least swing
    fraction and ramp (W/s) any of them reaches with a floor up to `max_floor_w` (W); with `clock_latency_s`
    (s) each instruction's time and energy carry the lag of a clock change (search/segments.py)."""
    from kareus_megatron.search.segments import lagged_costs

    best_frac, best_ramp = np.inf, np.inf
    out: list[BoundedPlan] = []
    for plan in plans:
        ch = np.asarray(plan.choice, dtype=np.int64)
        dur, en = lagged_costs(dag, node_opts, ch, clock_latency_s)
        a, b, step, _t = plan_parts(dag, dur, en, gpus_per_stage)
        floor, frac, ramp = least_floor(a, b, step, p_blocked_w, max_floor_w, bound)
        best_frac, best_ramp = min(best_frac, frac), min(best_ramp, ramp)
        if floor is None:
            continue
        extra = (floor - p_blocked_w) * float(b.sum()) * step  # J: blocked GPU-seconds at the raised floor
        out.append(
            BoundedPlan(
                choice=ch,
                time_s=float(plan.time_s),
                energy_j=float(plan.energy_j) + extra,
                power_floor_w=floor if floor > p_blocked_w * (1 + _TOL) else None,
                power_limit_w=getattr(plan, "power_limit_w", None),
            )
        )
    return out, float(best_frac), float(best_ramp)


def unreachable_message(bound: PowerBound, method: str, least_frac: float, least_ramp: float) -> str:
    """The one line for a bound that no plan of `method` meets, naming the least swing (and ramp) reachable."""
    got = []
    if bound.max_swing is not None:
        got.append(f"the least swing reachable is {least_frac:.3f} × peak")
    if bound.max_ramp_w_per_s is not None:
        got.append(f"the least ramp reachable is {least_ramp:.4g} W/s")
    return (
        f"{bound.describe()}: no {method} plan meets the bound, even with blocked GPUs held at a power floor "
        f"up to the board limit; {' and '.join(got)}"
    )


def check_reachable(found: Mapping[Any, tuple[list[BoundedPlan], float, float]], bound: PowerBound) -> None:
    """PlanError (one line) naming the least reachable swing when some method has no plan under `bound`."""
    for method, (plans, frac, ramp) in found.items():
        if not plans:
            raise PlanError(unreachable_message(bound, method, frac, ramp))


def timeline_parts(
    timed: list[Any], pp: int, period_s: float, gpus_per_stage: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """(A W, B GPUs, step s) of a simulated timeline (search.planner.TimedInstruction: rank, start_s, end_s,
    energy_j of one GPU) of `pp` ranks and iteration time `period_s` (s)."""
    ranks = []
    for r in range(pp):
        mine = [ti for ti in timed if ti.rank == r]
        ranks.append(
            (
                np.array([ti.start_s for ti in mine]),
                np.array([ti.end_s for ti in mine]),
                np.array([ti.energy_j for ti in mine]),
            )
        )
    return job_parts(ranks, period_s, gpus_per_stage)
