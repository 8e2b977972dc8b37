"""Event simulation against hand-computed pipelines and an independent per-rank event loop."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import ConfigError
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.schedules import instruction_order
from kareus_megatron.search.simulate import earliest_times, latest_finish, simulate


def _event_loop(orders, dur, p2p, reduce_s=0.0):
    """Reference: run ranks step by step; an instruction starts when its rank and its data are ready."""
    pp = len(orders)
    vp = 1 + max(c for o in orders for _, _, c in o)
    end = {}
    free = [0.0] * pp
    nxt = [0] * pp
    done = 0
    total = sum(len(o) for o in orders)
    while done < total:
        progressed = False
        for s in range(pp):
            if nxt[s] == len(orders[s]):
                continue
            kind, mb, c = orders[s][nxt[s]]
            v = c * pp + s
            if kind == "forward":
                dep = None if v == 0 else ((v - 1) % pp, "forward", mb, (v - 1) // pp)
            else:
                dep = (s, "forward", mb, c) if v == vp * pp - 1 else ((v + 1) % pp, "backward", mb, (v + 1) // pp)
            if dep is not None and dep not in end:
                continue
            ready = 0.0 if dep is None else end[dep] + (p2p if dep[0] != s else 0.0)
            start = max(free[s], ready)
            end[(s, kind, mb, c)] = start + dur[(s, kind, mb, c)]
            free[s] = end[(s, kind, mb, c)]
            nxt[s] += 1
            done += 1
            progressed = True
        assert progressed
    return end, max(free) + reduce_s


def test_two_stage_two_microbatch_by_hand():
    # F = 1 s, B = 2 s everywhere, P2P 0.5 s; stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1.
    dag = build_dag(instruction_order("1f1b", 2, 2), p2p_time_s=0.5)
    dur = np.array([1.0 if k[1] == "forward" else 2.0 for k in dag.keys])
    en = dur * 100.0  # 100 W while computing
    sim = simulate(dag, dur, en, p_blocked_w=10.0, gpus_per_stage=4)
    end = dict(zip(dag.keys, sim.end_s))
    # stage 1: F0 1.5-2.5, B0 2.5-4.5, F1 (stage 0 F1 ends 2, +0.5) 4.5-5.5, B1 5.5-7.5
    # stage 0: F0 0-1, F1 1-2, B0 5-7, B1 8-10
    assert end[(1, "backward", 1, 0)] == pytest.approx(7.5)
    assert end[(0, "backward", 0, 0)] == pytest.approx(7.0)
    assert sim.time_s == pytest.approx(10.0)
    busy = 6.0
    assert sim.idle_s == pytest.approx([10.0 - busy, 10.0 - busy])
    assert sim.energy_j == pytest.approx(4 * (en.sum() + 10.0 * 2 * (10.0 - busy)))
    assert sim.compute_energy_j + sim.idle_energy_j == pytest.approx(sim.energy_j)


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.sampled_from(["1f1b", "interleaved-1f1b"]),
    pp=st.integers(2, 4),
    m=st.integers(1, 6),
    vp=st.integers(1, 3),
    p2p=st.floats(0.0, 0.3),
    red=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_independent_event_loop(schedule, pp, m, vp, p2p, red, seed):
    vp = vp if schedule == "interleaved-1f1b" else 1
    if schedule == "interleaved-1f1b" and m % pp:
        m = pp * max(1, m // pp)  # megatron-core runs interleaved 1F1B only on whole microbatch groups
    orders = instruction_order(schedule, pp, m, vp=vp)
    dag = build_dag(orders, p2p, red)
    rng = np.random.default_rng(seed)
    dur = rng.uniform(0.5, 2.0, dag.n)
    ref_end, ref_t = _event_loop(orders, dict(zip(dag.keys, dur)), p2p, red)
    sim = simulate(dag, dur, dur * 50.0, p_blocked_w=20.0)
    assert sim.time_s == pytest.approx(ref_t)
    assert np.allclose(sim.end_s, [ref_end[k] for k in dag.keys])
    # Latest finish for a deadline equal to the iteration time: never earlier than the earliest finish,
    # and some chain of zero-float nodes (the critical path) exists.
    lf = latest_finish(dag, dur, sim.time_s)
    assert np.all(lf >= sim.end_s - 1e-9)
    assert np.any(np.isclose(lf, sim.end_s))


def test_batched_simulation_equals_single():
    dag = build_dag(instruction_order("interleaved-1f1b", 4, 8, vp=2), 0.01)
    rng = np.random.default_rng(0)
    dur = rng.uniform(0.5, 2.0, (5, dag.n))
    start_b, end_b = earliest_times(dag, dur)
    for k in range(5):
        s, e = earliest_times(dag, dur[k])
        assert np.array_equal(s, start_b[k]) and np.array_equal(e, end_b[k])


def test_shape_mismatch_is_an_error():
    dag = build_dag(instruction_order("1f1b", 2, 2))
    with pytest.raises(ConfigError, match="one duration and one energy per instruction"):
        simulate(dag, np.ones(3), np.ones(3), 10.0)
