"""The pipeline LP through HiGHS's public Python API (search/solver_lp.py): warm re-solves and the fallback."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kareus_megatron.search import solver_lp
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.schedules import instruction_order
from kareus_megatron.search.simulate import earliest_times, iteration_time, option_arrays
from kareus_megatron.search.solver import solve_frontier
from kareus_megatron.search.solver_local import durations
from kareus_megatron.search.solver_options import prepare_options

P_BLOCKED_W = 83.64


def _problem(pp: int = 4, microbatches: int = 8, clocks: int = 16):
    """A 1F1B DAG whose instructions slow down and draw less power at lower clocks; (dag, options, prep)."""
    dag = build_dag(instruction_order("1f1b", pp, microbatches), 0.002, dp_reduce_time_s=0.01)
    rng = np.random.default_rng(7)
    base: dict[tuple[int, str], float] = {}
    opts = []
    for stage, kind, _mb, _chunk in dag.keys:
        b = base.setdefault((stage, kind), rng.uniform(0.04, 0.06) * (2.0 if kind == "backward" else 1.0))
        f = np.linspace(1.0, 0.6, clocks)
        t = b * (0.2 + 0.8 / f)
        opts.append(SimpleNamespace(time_s=t, energy_j=t * (470.0 * f**1.8 + 60.0)))
    return dag, opts, prepare_options(*option_arrays(dag, opts), P_BLOCKED_W)


def _deadlines(dag, prep) -> np.ndarray:
    t_fast = float(iteration_time(dag, earliest_times(dag, durations(prep, np.zeros(dag.n, int)))[1]))
    return t_fast * np.array([1.3, 1.2, 1.15, 1.1, 1.05, 1.0])


def test_highspy_re_solves_warm_from_the_last_basis():
    dag, _, prep = _problem()
    lp = solver_lp.HullLP(dag, prep, P_BLOCKED_W)
    deadlines = _deadlines(dag, prep)
    for d in deadlines:
        assert lp.solve(d) is not None
    assert lp.backend == solver_lp.BACKEND_HIGHSPY
    assert (lp.solves, lp.warm_solves) == (6, 5)
    cold = []
    for d in deadlines[1:]:  # each deadline from scratch: a fresh model per solve
        fresh = solver_lp.HullLP(dag, prep, P_BLOCKED_W)
        fresh.solve(d)
        cold.append(fresh.simplex_iterations[0])
    # the warm re-solves start next to the optimum: far fewer simplex iterations than cold ones
    assert sum(lp.simplex_iterations[1:]) < 0.6 * sum(cold)


def test_without_highspy_it_solves_cold_and_says_so_once(monkeypatch, caplog):
    dag, _, prep = _problem()
    warm = solver_lp.HullLP(dag, prep, P_BLOCKED_W)
    monkeypatch.setattr(solver_lp, "highspy", None)
    monkeypatch.setattr(solver_lp, "_warned_missing", False)
    with caplog.at_level(logging.WARNING, logger=solver_lp.__name__):
        cold = solver_lp.HullLP(dag, prep, P_BLOCKED_W)
        solver_lp.HullLP(dag, prep, P_BLOCKED_W)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pip install highspy==" in warnings[0].getMessage()
    assert cold.backend == solver_lp.BACKEND_LINPROG
    for d in _deadlines(dag, prep):
        warm.solve(d)
        b = cold.solve(d)
        assert warm.last_time_s == pytest.approx(cold.last_time_s, rel=1e-7)
        assert iteration_time(dag, earliest_times(dag, b)[1]) <= d * (1 + 1e-7)
    assert (cold.solves, cold.warm_solves, cold.simplex_iterations) == (6, 0, [])


def test_the_frontier_does_not_depend_on_the_backend(monkeypatch):
    dag, opts, _ = _problem(pp=4, microbatches=6, clocks=10)
    fast = solve_frontier(dag, opts, P_BLOCKED_W, 8, method="lp", budget_s=None)
    monkeypatch.setattr(solver_lp, "highspy", None)
    monkeypatch.setattr(solver_lp, "_warned_missing", True)
    slow = solve_frontier(dag, opts, P_BLOCKED_W, 8, method="lp", budget_s=None)
    e_fast, e_slow = np.array([p.energy_j for p in fast]), np.array([p.energy_j for p in slow])
    assert e_fast.min() == pytest.approx(e_slow.min(), rel=1e-3) and fast[0].time_s == pytest.approx(slow[0].time_s)


def test_highs_prints_nothing():
    """HiGHS's banner (printed by the first highspy.Highs() of a process) never reaches stdout."""
    code = (
        "import numpy as np, sys; sys.path.insert(0, 'tests/search'); from test_solver_lp import _problem;"
        "from kareus_megatron.search.solver_lp import HullLP; dag, _, prep = _problem(2, 4, 4);"
        "print('x' if HullLP(dag, prep, 83.64).solve(1e3) is not None else 'none')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "x\n" and "HiGHS" not in out.stderr
