"""The one iteration-energy formula (cost/energy.py) and its users: the simulator and the solver."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kareus_megatron.cost.energy import idle_time_s, iteration_energy_j
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.schedules import instruction_order
from kareus_megatron.search.simulate import simulate_choice
from kareus_megatron.search.solver import solve_frontier


def test_blocked_power_fills_the_idle_time():
    # 2 ranks, T = 1 s, 1.5 s busy in all: 0.5 s idle at 80 W, 8 GPUs per stage
    assert iteration_energy_j(300.0, 1.5, 1.0, 80.0, gpus_per_stage=8, ranks=2) == pytest.approx(8 * (300 + 40))
    assert idle_time_s(1.5, 1.0, ranks=2) == pytest.approx(0.5)


def test_idle_time_is_never_negative():
    assert idle_time_s(1.2, 1.0) == 0.0  # a stage compared against a shorter iteration
    assert iteration_energy_j(50.0, 1.2, 1.0, 80.0) == pytest.approx(50.0)


def test_arrays_broadcast():
    e = iteration_energy_j(np.array([10.0, 20.0]), np.array([1.0, 2.0]), np.array([[2.0], [3.0]]), 10.0)
    assert e.shape == (2, 2) and e[1, 0] == pytest.approx(10.0 + 10.0 * 2.0)


def test_simulator_and_solver_charge_the_same_energy():
    dag = build_dag(instruction_order("1f1b", 3, 6), 0.002, dp_reduce_time_s=0.01)
    rng = np.random.default_rng(1)
    opts = [
        SimpleNamespace(time_s=np.sort(rng.uniform(0.05, 0.1, 4)), energy_j=np.sort(rng.uniform(10, 30, 4))[::-1])
        for _ in dag.keys
    ]
    for plan in solve_frontier(dag, opts, 83.64, 8, method="lp", budget_s=None):
        sim = simulate_choice(dag, opts, plan.choice, 83.64, 8)
        dur = np.array([o.time_s[c] for o, c in zip(opts, plan.choice)])
        en = np.array([o.energy_j[c] for o, c in zip(opts, plan.choice)])
        want = iteration_energy_j(en.sum(), dur.sum(), sim.time_s, 83.64, 8, ranks=dag.pp)
        assert plan.energy_j == pytest.approx(want, rel=1e-12) and sim.energy_j == pytest.approx(want, rel=1e-12)
        assert sim.idle_energy_j == pytest.approx(8 * 83.64 * sim.idle_s.sum(), rel=1e-12)
        assert np.all(sim.idle_s >= 0.0)
