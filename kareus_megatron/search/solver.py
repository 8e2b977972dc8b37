"""Iteration time–energy frontier of a pipeline: every instruction picks one of its options.

Input: a PipelineDAG and, per node, its options (``.time_s`` s and ``.energy_j`` J of one GPU, numpy
arrays). Output: SolvedPlans (option index per node, iteration time s, energy J of all GPUs), a Pareto
frontier sorted fastest first, from the fastest plan to the minimum-energy plan. Time and energy of every
plan come from the event simulation (simulate.py), with blocked power ``p_blocked_w`` (W) for every
GPU's idle time and ``gpus_per_stage`` GPUs (tp * cp * dp) running each stage.

Method ``"lp"`` (default for all but tiny DAGs), multi-pass:
1. LP relaxation (solver_lp.HullLP, HiGHS, warm-started): each instruction's duration moves along the
   convex hull of its options' (time, effective cost) points, blocked power x idle time is in the
   objective, the iteration time is capped by a deadline. Solved without a cap first (its iteration time
   bounds the useful range), then on a grid of deadlines down to the fastest plan's time;
2. discrete plans: between neighbouring deadlines the parametric LP optimum moves linearly, so convex
   combinations of neighbouring solutions give relaxed plans for deadlines in between; every one is
   rounded down to an option (stays within its deadline) and its leftover slack filled greedily
   (solver_local). Greedy fills of the all-fastest plan are kept as independent candidates;
3. every candidate is simulated; the Pareto set is kept; refinement passes add LP deadlines where
   neighbouring frontier points differ most in energy, within a wall-time budget.
Method ``"exact"``: epsilon-constraint on the discrete MILP (one solve per frontier point, each just
below the previous point's time); ``"auto"`` uses it when the DAG is tiny.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.cost.energy import iteration_energy_j
from kareus_megatron.errors import ConfigError, PlanError
from kareus_megatron.search.frontier import pareto_indices, thin_indices
from kareus_megatron.search.pipeline import PipelineDAG
from kareus_megatron.search.simulate import earliest_times, iteration_time, option_arrays
from kareus_megatron.search.solver_local import durations, fill_slack, round_down
from kareus_megatron.search.solver_lp import ExactMILP, HullLP
from kareus_megatron.search.solver_options import PreparedOptions, prepare_options

# Engineering choices of the search, not physical constants; docs/sources.md#solver-budgets has the
# measurements behind the values.
# - The exact MILP runs only on DAGs this small: it costs one MILP per frontier point, and a point took
#   0.2-10 s on a 4 x 4 GPT-3 pipeline (32 nodes), so beyond a dozen nodes the LP method is used.
EXACT_MAX_NODES = 12
EXACT_MAX_OPTIONS = 48  # total useful options over all nodes
# - Relaxed plans interpolated between neighbouring LP solutions, in total per discretisation pass (at
#   least 2 per gap; about 10 per gap with the default 24 deadlines). On the GPT-3 A100 profile (8 stages,
#   M = 16 and 32) 256 keeps the frontier within 0.02% mean energy of 1024 plans at half the solver time.
INTERPOLATED_PLANS = 256
# - The deadline grid ends this factor above the relaxed minimum-energy iteration time (slower deadlines
#   only add blocked power; a rounded, slack-filled plan may end a little after its LP optimum). Not
#   critical: 1.00-1.10 find the same minimum energy within 0.02% on that profile.
MIN_ENERGY_TIME_MARGIN = 1.02
# - With a wall-time budget the first deadline grid shrinks to what fits in this share of it. The
#   default solve cap (grid + grid // 2 + 1) makes the first pass about 2/3 of the LP solves, so 70% of
#   the time goes to it and the rest to the refinement passes.
FIRST_PASS_BUDGET_SHARE = 0.7


@dataclass(frozen=True, eq=False)
class SolvedPlan:
    """One frontier plan: option index per node, simulated iteration time (s) and energy (J, all GPUs)."""

    choice: np.ndarray
    time_s: float
    energy_j: float


class _Evaluator:
    """Simulates batches of position plans and keeps every distinct candidate."""

    def __init__(self, dag: PipelineDAG, prep: PreparedOptions, p_blocked_w: float, gpus: int) -> None:
        self.dag, self.prep, self.p, self.g = dag, prep, p_blocked_w, gpus
        self.pos: list[np.ndarray] = []
        self.time: list[float] = []
        self.energy: list[float] = []
        self._seen: set[bytes] = set()

    def add(self, pos: np.ndarray) -> None:
        pos = np.atleast_2d(pos)
        dur = durations(self.prep, pos)
        _, end = earliest_times(self.dag, dur)
        t = iteration_time(self.dag, end)
        en = np.take_along_axis(
            np.broadcast_to(self.prep.energy_j, pos.shape + (self.prep.energy_j.shape[1],)), pos[..., None], -1
        )[..., 0]
        e = iteration_energy_j(en.sum(-1), dur.sum(-1), t, self.p, self.g, ranks=self.dag.pp)
        for k in range(pos.shape[0]):
            key = pos[k].tobytes()
            if key in self._seen:
                continue
            self._seen.add(key)
            self.pos.append(pos[k].copy())
            self.time.append(float(t[k]))
            self.energy.append(float(e[k]))

    def frontier(self, max_time_s: float = np.inf) -> np.ndarray:
        t, e = np.array(self.time), np.array(self.energy)
        idx = pareto_indices(t, e)
        return idx[t[idx] <= max_time_s * (1 + 1e-12)]


def _check_inputs(p_blocked_w: float, gpus_per_stage: int, points: int | None) -> None:
    if not (np.isfinite(p_blocked_w) and p_blocked_w >= 0):
        raise ConfigError(f"blocked power {p_blocked_w!r} W must be a finite number >= 0")
    if not (isinstance(gpus_per_stage, (int, np.integer)) and gpus_per_stage >= 1):
        raise ConfigError(f"gpus_per_stage={gpus_per_stage!r} must be a positive integer (tp * cp * dp)")
    if points is not None and (not isinstance(points, (int, np.integer)) or points < 1):
        raise ConfigError(f"points={points!r} must be a positive integer (or None for the whole frontier)")


def _solve_lp(
    dag: PipelineDAG,
    prep: PreparedOptions,
    ev: _Evaluator,
    t_fast: float,
    t_hi: float,
    grid: int,
    resolution: float,
    max_solves: int,
    budget_s: float | None,
    progress: Callable[[float], None] | None,
) -> None:
    lp = HullLP(dag, prep, ev.p)
    t_start = time.perf_counter()
    sols: dict[float, np.ndarray] = {}  # deadline (s) -> LP durations (s)

    def over_budget() -> bool:
        return budget_s is not None and len(sols) >= 3 and time.perf_counter() - t_start > budget_s

    def solve(deadlines: np.ndarray) -> None:
        for d in deadlines:
            if over_budget():
                return
            dur = lp.solve(float(d))
            if dur is not None:
                sols[float(d)] = dur
            if progress is not None:
                progress(min(len(sols) / max_solves, 0.99))

    def discretise(deadlines: list[float]) -> None:
        # Between two LP optima the parametric optimum moves linearly in the deadline, so convex
        # combinations of neighbouring solutions are (near-)optimal relaxed plans for deadlines in between.
        keys = sorted(sols)
        per_gap = max(2, -(-INTERPOLATED_PLANS // len(keys)))  # interpolated plans per gap
        durs, dls = [], []
        for d in deadlines:
            k = keys.index(d)
            durs.append(sols[d][None, :])
            dls.append(np.array([d]))
            if k + 1 < len(keys):
                d2 = keys[k + 1]
                a = np.linspace(0.0, 1.0, per_gap + 1)[1:-1, None]
                durs.append((1 - a) * sols[d] + a * sols[d2])
                dls.append((1 - a[:, 0]) * d + a[:, 0] * d2)
        dur, dl = np.concatenate(durs), np.concatenate(dls)
        pos = round_down(prep, dur)
        t_own = iteration_time(dag, earliest_times(dag, durations(prep, pos))[1])
        ev.add(pos)
        # Fill slack only up to each plan's own makespan: lengthening the iteration costs every rank's
        # blocked power, a trade the LP has already made.
        ev.add(fill_slack(dag, prep, pos, np.minimum(dl, t_own)))

    # The unconstrained LP optimum gives the relaxed minimum-energy iteration time; slower deadlines
    # only add blocked power, so the grid stops a little beyond it.
    solve(np.array([t_hi]))
    if sols:
        t_hi = min(t_hi, max(lp.last_time_s * MIN_ENERGY_TIME_MARGIN, t_fast))
    # Deadlines are solved in descending order (each LP warm-starts from the previous basis); when a
    # budget is set, the grid shrinks to what the first solves say fits into FIRST_PASS_BUDGET_SHARE of it.
    first = np.linspace(t_fast, t_hi, grid)
    t0 = time.perf_counter()
    solve(first[::-1][:2])
    rest = first[:-2]
    if budget_s is not None and grid > 4:
        per_lp = (time.perf_counter() - t0) / 2
        fit = int((FIRST_PASS_BUDGET_SHARE * budget_s - (time.perf_counter() - t_start)) / max(per_lp, 1e-6))
        if fit < rest.size:
            rest = np.linspace(t_fast, first[-2], max(fit, 2) + 1)[:-1]
            first = np.r_[rest, first[-2:]]
    solve(rest[::-1])
    discretise(sorted(sols))
    # Greedy fill of the all-fastest plan up to each deadline: a cheap, independent second opinion.
    ev.add(fill_slack(dag, prep, np.zeros((first.size, dag.n), dtype=np.int64), first))
    tried: set[tuple[float, float]] = set()
    while len(sols) < max_solves and not over_budget():
        # Refine where the frontier's staircase is steepest: a new LP deadline between two neighbours
        # whose energies differ by more than `resolution` (relative).
        idx = ev.frontier(t_hi)
        t, e = np.array(ev.time)[idx], np.array(ev.energy)[idx]
        if t.size < 2:
            break
        loss = (e[:-1] - e[1:]) / e[1:]
        gap = np.diff(t)
        pick = [
            k
            for k in np.argsort(loss)[::-1]
            if loss[k] > resolution and gap[k] > 1e-7 * t_hi and (t[k], t[k + 1]) not in tried
        ][: min(grid, max_solves - len(sols))]
        if not pick:
            break
        tried.update((t[k], t[k + 1]) for k in pick)
        new = [float(0.5 * (t[k] + t[k + 1])) for k in pick]
        new = [d for d in new if d not in sols]
        solve(np.array(new))
        keys = sorted(sols)
        redo = {keys[max(keys.index(d) - 1, 0)] for d in new if d in sols} | {d for d in new if d in sols}
        if redo:
            discretise(sorted(redo))
    if progress is not None:
        progress(1.0)


def _solve_exact(dag: PipelineDAG, prep: PreparedOptions, ev: _Evaluator, t_fast: float, t_hi: float) -> None:
    """Epsilon-constraint: min energy with T <= deadline, then just below that plan's time, until infeasible."""
    mip = ExactMILP(dag, prep, ev.p)
    step = 1e-5 * t_fast  # keeps deadlines clear of HiGHS's tolerance around known makespans
    deadline = t_hi
    while deadline >= t_fast - step:
        pos = mip.solve(deadline)
        if pos is None:
            break
        ev.add(pos)
        t = float(iteration_time(dag, earliest_times(dag, durations(prep, pos))[1]))
        deadline = min(deadline, t) - step


def solve_frontier(
    dag: PipelineDAG,
    options: Sequence[Any] | Mapping[Any, Any],
    p_blocked_w: float,
    gpus_per_stage: int = 1,
    points: int | None = None,
    *,
    max_time_s: float | None = None,
    method: str = "auto",
    grid: int | None = None,
    resolution: float = 1e-3,
    max_solves: int | None = None,
    budget_s: float | None = 10.0,
    progress: Callable[[float], None] | None = None,
) -> list[SolvedPlan]:
    """Pareto frontier of discrete plans, fastest first; at most `points` plans spread in time (None: all).

    `options[i]` (by node index, or a mapping by node key) has arrays ``.time_s`` and ``.energy_j``.
    `max_time_s` drops plans slower than it (PlanError if even the fastest plan is slower). `method` is
    "auto", "lp" or "exact". LP method: `grid` first-pass deadlines (default 24, fewer for few
    `points`); refinement passes add deadlines until neighbouring frontier points differ by at most
    `resolution` in relative energy, `max_solves` LPs were solved or `budget_s` seconds passed (the
    first pass also shrinks to fit FIRST_PASS_BUDGET_SHARE of the budget). `progress(fraction)` is called
    as it goes.
    """
    _check_inputs(p_blocked_w, gpus_per_stage, points)
    if method not in ("auto", "lp", "exact"):
        raise ConfigError(f"solver method {method!r} must be 'auto', 'lp' or 'exact'")
    times, energies = option_arrays(dag, options)
    prep = prepare_options(times, energies, p_blocked_w)
    ev = _Evaluator(dag, prep, p_blocked_w, int(gpus_per_stage))
    fast = np.zeros(dag.n, dtype=np.int64)
    slow = prep.count - 1
    t_fast = float(iteration_time(dag, earliest_times(dag, durations(prep, fast))[1]))
    t_slow = float(iteration_time(dag, earliest_times(dag, durations(prep, slow))[1]))
    if max_time_s is not None and max_time_s < t_fast * (1 - 1e-12):
        raise PlanError(
            f"max time {max_time_s:.6g} s is below the fastest plan ({t_fast:.6g} s); allow at least {t_fast:.6g} s"
        )
    t_hi = t_slow if max_time_s is None else min(t_slow, max(max_time_s, t_fast))
    ev.add(fast)
    ev.add(slow)
    small = dag.n <= EXACT_MAX_NODES and int(prep.count.sum()) <= EXACT_MAX_OPTIONS
    if method == "exact" or (method == "auto" and small):
        _solve_exact(dag, prep, ev, t_fast, t_hi)
        if progress is not None:
            progress(1.0)
    else:
        # Fewer deadlines when only a few points are wanted: the frontier is thinned to them anyway.
        g = grid if grid is not None else (24 if points is None else min(24, max(8, points + 4)))
        cap = max_solves if max_solves is not None else g + g // 2 + 1
        _solve_lp(dag, prep, ev, t_fast, t_hi, g, resolution, cap, budget_s, progress)
    idx = ev.frontier(max_time_s if max_time_s is not None else np.inf)
    if points is not None and idx.size > points:
        idx = idx[thin_indices(np.array(ev.time)[idx], points)]
    out = []
    rows = np.arange(dag.n)
    for k in idx:
        choice = prep.orig[rows, ev.pos[k]]
        out.append(SolvedPlan(choice=choice, time_s=ev.time[k], energy_j=ev.energy[k]))
    return out
