"""Frontier solver: exact on tiny DAGs (against enumeration), well-formed frontiers, errors."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import ConfigError, PlanError
from kareus_megatron.search.frontier import pareto_indices
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.schedules import instruction_order
from kareus_megatron.search.simulate import simulate_choice
from kareus_megatron.search.solver import solve_frontier

P_BLOCKED = 60.0


def _random_options(rng, n, max_opts):
    """Per node 1..max_opts clock-like options: slower ones draw less power."""
    opts = []
    for _ in range(n):
        k = int(rng.integers(1, max_opts + 1))
        t = np.sort(rng.uniform(0.5, 2.0, k))
        power = rng.uniform(150.0, 400.0) * (t[0] / t) ** rng.uniform(1.0, 3.0)
        opts.append(SimpleNamespace(time_s=t, energy_j=t * power))
    return opts


def _enumerate(dag, opts, p_blocked, gpus):
    ts, es = [], []
    for choice in itertools.product(*[range(o.time_s.size) for o in opts]):
        sim = simulate_choice(dag, opts, np.array(choice), p_blocked, gpus)
        ts.append(sim.time_s)
        es.append(sim.energy_j)
    ts, es = np.array(ts), np.array(es)
    idx = pareto_indices(ts, es)
    return ts[idx], es[idx]


TINY = [("1f1b", 1, 2), ("1f1b", 2, 1), ("1f1b", 3, 1), ("interleaved-1f1b", 2, 1), ("1f1b", 1, 3)]


def _tiny_dag(case, p2p):
    schedule, pp, m = case
    vp = 2 if schedule == "interleaved-1f1b" else 1
    if schedule == "interleaved-1f1b" and pp == 2 and m == 1:
        # 2 ranks x 2 chunks x F/B = 8 nodes is over the tiny limit; use a 1-rank, 2-chunk order instead.
        orders = [[("forward", 0, 0), ("forward", 0, 1), ("backward", 0, 1), ("backward", 0, 0)]]
        return build_dag(orders, p2p)
    return build_dag(instruction_order(schedule, pp, m, vp=vp), p2p)


def _assert_same_frontier(plans, t_ref, e_ref):
    """Every plan is a point of the enumerated frontier, and every frontier point is found, except one within
    the exact method's deadline step (1e-5 of the fastest time, search/solver.py) of a found, slower one."""
    t = np.array([p.time_s for p in plans])
    e = np.array([p.energy_j for p in plans])
    match = [int(np.argmin(np.abs(t_ref - x))) for x in t]
    assert np.allclose(t, t_ref[match], rtol=1e-9) and np.allclose(e, e_ref[match], rtol=1e-9), (t, t_ref)
    step = 1e-5 * t_ref.min()
    for k in sorted(set(range(t_ref.size)) - set(match)):
        slower = t[t >= t_ref[k]]
        assert slower.size and slower.min() - t_ref[k] <= step * (1 + 1e-9), (k, t, t_ref)


@pytest.mark.parametrize("case", TINY)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_dags_equal_exhaustive_enumeration(case, seed):
    rng = np.random.default_rng(seed)
    dag = _tiny_dag(case, p2p=0.05 * seed)
    assert dag.n <= 6
    opts = _random_options(rng, dag.n, 3)
    plans = solve_frontier(dag, opts, P_BLOCKED, gpus_per_stage=2)
    _assert_same_frontier(plans, *_enumerate(dag, opts, P_BLOCKED, 2))


@settings(max_examples=25, deadline=None)
@given(
    case=st.sampled_from(TINY), seed=st.integers(0, 2**31 - 1), p_blocked=st.floats(0.0, 200.0), p2p=st.floats(0.0, 0.5)
)
def test_tiny_dags_equal_enumeration_hypothesis(case, seed, p_blocked, p2p):
    rng = np.random.default_rng(seed)
    dag = _tiny_dag(case, p2p)
    opts = _random_options(rng, dag.n, 3)
    plans = solve_frontier(dag, opts, p_blocked, gpus_per_stage=1)
    _assert_same_frontier(plans, *_enumerate(dag, opts, p_blocked, 1))


@pytest.mark.parametrize("seed", [0, 1])
def test_lp_method_never_beats_exact_and_stays_close(seed):
    rng = np.random.default_rng(seed)
    dag = _tiny_dag(("1f1b", 3, 1), 0.02)
    opts = _random_options(rng, dag.n, 3)
    t_ref, e_ref = _enumerate(dag, opts, P_BLOCKED, 1)
    plans = solve_frontier(dag, opts, P_BLOCKED, method="lp")
    for p in plans:
        best = e_ref[t_ref <= p.time_s * (1 + 1e-12)].min()
        assert p.energy_j >= best * (1 - 1e-12)
    assert plans[0].time_s == pytest.approx(t_ref[0])
    assert plans[-1].energy_j == pytest.approx(e_ref[-1], rel=1e-3)


def _gpt_like_options(dag, rng, k):
    """k clock options per node: time grows, power falls with lower clocks (shape: docs/sources.md#perseus-profiles)."""
    opts = []
    base = {}
    for key in dag.keys:
        b = base.setdefault((key[0], key[1]), rng.uniform(0.04, 0.06) * (2.0 if key[1] == "backward" else 1.0))
        f = np.linspace(1.0, 0.6, k)
        t = b * (0.2 + 0.8 / f)
        power = 470.0 * f**1.8 + 60.0
        opts.append(SimpleNamespace(time_s=t, energy_j=t * power))
    return opts


@pytest.mark.parametrize("schedule,vp", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_frontier_is_pareto_sorted_and_simulated(schedule, vp):
    dag = build_dag(instruction_order(schedule, 4, 8, vp=vp), 0.002, dp_reduce_time_s=0.01)
    opts = _gpt_like_options(dag, np.random.default_rng(3), 20)
    plans = solve_frontier(dag, opts, 83.64, gpus_per_stage=8, points=12)
    assert 2 <= len(plans) <= 12
    t = np.array([p.time_s for p in plans])
    e = np.array([p.energy_j for p in plans])
    assert np.all(np.diff(t) > 0) and np.all(np.diff(e) < 0)
    for p in plans:
        sim = simulate_choice(dag, opts, p.choice, 83.64, 8)
        assert sim.time_s == pytest.approx(p.time_s) and sim.energy_j == pytest.approx(p.energy_j)
    fastest = simulate_choice(dag, opts, np.zeros(dag.n, int), 83.64, 8)
    assert t[0] == pytest.approx(fastest.time_s)
    # The minimum-energy end beats every single-clock plan.
    for k in range(20):
        assert e[-1] <= simulate_choice(dag, opts, np.full(dag.n, k), 83.64, 8).energy_j * (1 + 1e-9)


def test_options_by_node_key_and_max_time():
    dag = build_dag(instruction_order("1f1b", 2, 4), 0.0)
    seq = _gpt_like_options(dag, np.random.default_rng(0), 6)
    by_key = dict(zip(dag.keys, seq))
    a = solve_frontier(dag, seq, 50.0)
    b = solve_frontier(dag, by_key, 50.0)
    assert [p.energy_j for p in a] == pytest.approx([p.energy_j for p in b])
    mid = 0.5 * (a[0].time_s + a[-1].time_s)
    c = solve_frontier(dag, seq, 50.0, max_time_s=mid)
    assert all(p.time_s <= mid for p in c) and c[0].time_s == pytest.approx(a[0].time_s)


def test_infeasible_and_bad_requests():
    dag = build_dag(instruction_order("1f1b", 2, 2), 0.0)
    opts = _gpt_like_options(dag, np.random.default_rng(0), 3)
    with pytest.raises(PlanError, match="below the fastest plan"):
        solve_frontier(dag, opts, 50.0, max_time_s=0.01)
    with pytest.raises(ConfigError, match="points"):
        solve_frontier(dag, opts, 50.0, points=0)
    with pytest.raises(ConfigError, match="blocked power"):
        solve_frontier(dag, opts, float("nan"))
    with pytest.raises(ConfigError, match="gpus_per_stage"):
        solve_frontier(dag, opts, 50.0, gpus_per_stage=0)
    with pytest.raises(ConfigError, match="instructions"):
        solve_frontier(dag, opts[:-1], 50.0)
    bad = list(opts)
    bad[0] = SimpleNamespace(time_s=np.array([0.1, -0.2]), energy_j=np.array([1.0, 1.0]))
    with pytest.raises(ConfigError, match="finite and > 0"):
        solve_frontier(dag, bad, 50.0)
    with pytest.raises(ConfigError, match="method"):
        solve_frontier(dag, opts, 50.0, method="magic")


def test_slack_fill_keeps_deadline_and_leaves_no_free_slowdown():
    from kareus_megatron.search.simulate import earliest_times, iteration_time, option_arrays
    from kareus_megatron.search.solver_local import costs, durations, fill_slack
    from kareus_megatron.search.solver_options import prepare_options

    dag = build_dag(instruction_order("interleaved-1f1b", 3, 6, vp=2), 0.003, dp_reduce_time_s=0.02)
    opts = _gpt_like_options(dag, np.random.default_rng(5), 12)
    prep = prepare_options(*option_arrays(dag, opts), 83.64)
    rng = np.random.default_rng(1)
    pos = rng.integers(0, prep.count[None, :], size=(4, dag.n))

    def makespan(p):
        return iteration_time(dag, earliest_times(dag, durations(prep, p))[1])

    deadline = makespan(pos) * np.array([1.0, 1.02, 1.1, 1.3])
    filled = fill_slack(dag, prep, pos, deadline, max_rounds=50)
    assert np.all(makespan(filled) <= deadline * (1 + 1e-12))
    assert np.all(filled >= pos) and np.all(costs(prep, filled).sum(-1) <= costs(prep, pos).sum(-1))
    for b in range(4):
        for i in np.flatnonzero(filled[b] < prep.count - 1):
            slower = filled[b].copy()
            slower[i] += 1
            assert makespan(slower) > deadline[b] * (1 + 1e-12)


def test_single_option_instructions_give_one_plan():
    dag = build_dag(instruction_order("1f1b", 2, 8), 0.001)
    opts = [
        SimpleNamespace(time_s=np.array([0.1 if k[1] == "forward" else 0.2]), energy_j=np.array([30.0]))
        for k in dag.keys
    ]
    for method in ("auto", "lp"):
        plans = solve_frontier(dag, opts, 80.0, 8, method=method)
        assert len(plans) == 1 and np.all(plans[0].choice == 0)
        assert plans[0].time_s == pytest.approx(simulate_choice(dag, opts, plans[0].choice, 80.0, 8).time_s)


def test_warm_started_lp_matches_cold_linprog(monkeypatch):
    from kareus_megatron.search import solver_lp
    from kareus_megatron.search.simulate import earliest_times, iteration_time, option_arrays
    from kareus_megatron.search.solver_local import durations
    from kareus_megatron.search.solver_lp import HullLP
    from kareus_megatron.search.solver_options import prepare_options

    dag = build_dag(instruction_order("1f1b", 4, 8), 0.002, dp_reduce_time_s=0.01)
    opts = _gpt_like_options(dag, np.random.default_rng(7), 16)
    prep = prepare_options(*option_arrays(dag, opts), 83.64)
    warm = HullLP(dag, prep, 83.64)
    monkeypatch.setattr(solver_lp, "highspy", None)  # the fallback path: one cold scipy linprog per deadline
    cold = HullLP(dag, prep, 83.64)

    def relaxed_cost(d):
        return sum(np.interp(d[i], prep.time_s[i, h], prep.cost_j[i, h]) for i, h in enumerate(prep.hull))

    t_fast = float(iteration_time(dag, earliest_times(dag, durations(prep, np.zeros(dag.n, int)))[1]))
    for deadline in t_fast * np.array([1.3, 1.15, 1.05, 1.0, 0.99]):
        a, b = warm.solve(deadline), cold.solve(deadline)
        if deadline < t_fast:
            assert a is None and b is None
            continue
        assert relaxed_cost(a) + 83.64 * 4 * warm.last_time_s == pytest.approx(
            relaxed_cost(b) + 83.64 * 4 * cold.last_time_s, rel=1e-7
        )
        assert iteration_time(dag, earliest_times(dag, a)[1]) <= deadline * (1 + 1e-7)
    assert (warm.backend, cold.backend) == (solver_lp.BACKEND_HIGHSPY, solver_lp.BACKEND_LINPROG)
    assert warm.warm_solves == warm.solves - 1 == 4  # one model, re-solved from its basis at every deadline
