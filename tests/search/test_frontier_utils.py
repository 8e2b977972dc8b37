"""Pareto utilities (search/frontier.py) and the reductions of plan/frontier.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import PlanError
from kareus_megatron.plan.frontier import frontier_document, reductions
from kareus_megatron.search.frontier import pareto_indices, pareto_mask, pareto_sum, thin_indices

points = st.lists(
    st.tuples(st.floats(0.1, 100, allow_nan=False), st.floats(0.1, 100, allow_nan=False)), min_size=1, max_size=40
)


def _dominated(p, q):
    """True when q dominates p."""
    return q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1])


@given(points)
def test_pareto_mask_matches_brute_force(pts):
    t = np.array([p[0] for p in pts])
    e = np.array([p[1] for p in pts])
    mask = pareto_mask(t, e)
    for i, p in enumerate(pts):
        dominated = any(_dominated(p, q) for q in pts)
        if dominated:
            assert not mask[i]
    kept = {pts[i] for i in np.flatnonzero(mask)}
    undominated = {p for p in pts if not any(_dominated(p, q) for q in pts)}
    assert kept == undominated  # exact duplicates collapse to one kept copy


@given(points)
def test_pareto_indices_sorted_with_strictly_decreasing_energy(pts):
    t = np.array([p[0] for p in pts])
    e = np.array([p[1] for p in pts])
    idx = pareto_indices(t, e)
    assert np.all(np.diff(t[idx]) > 0)
    assert np.all(np.diff(e[idx]) < 0)


@settings(max_examples=50)
@given(points, points)
def test_pareto_sum_equals_brute_force(a, b):
    ta, ea = np.array([p[0] for p in a]), np.array([p[1] for p in a])
    tb, eb = np.array([p[0] for p in b]), np.array([p[1] for p in b])
    t, e, pairs = pareto_sum(ta, ea, tb, eb)
    allpts = [(x[0] + y[0], x[1] + y[1]) for x, y in itertools.product(a, b)]
    want = sorted({p for p in allpts if not any(_dominated(p, q) for q in allpts)})
    assert sorted(zip(t.tolist(), e.tolist())) == want
    for k, (i, j) in enumerate(pairs):
        assert t[k] == pytest.approx(ta[i] + tb[j]) and e[k] == pytest.approx(ea[i] + eb[j])


def test_thin_keeps_ends():
    t = np.linspace(0, 1, 100)
    idx = thin_indices(t, 7)
    assert idx[0] == 0 and idx[-1] == 99 and len(idx) <= 7


def test_reductions_hand_computed():
    fr = {
        "megatron": [(10.0, 100.0)],
        "perseus": [(10.0, 90.0), (12.0, 70.0)],
        "kareus": [(9.0, 85.0), (10.0, 80.0), (11.0, 68.0), (13.0, 60.0)],
    }
    r = reductions(fr)
    # iso-time: E_P(fastest)=90 at T=10; kareus best with T<=10 is 80 -> 1/9
    assert r["kareus"]["iso_time_energy"] == pytest.approx(10 / 90)
    # iso-energy: P min-energy (12, 70); kareus fastest with E<=70 is 11 -> 1/12
    assert r["kareus"]["iso_energy_time"] == pytest.approx(1 / 12)
    assert r["kareus"]["max_throughput_time_vs_megatron"] == pytest.approx(0.1)
    assert r["kareus"]["max_throughput_energy_vs_megatron"] == pytest.approx(0.15)
    assert r["perseus"]["iso_time_energy"] == 0.0 and r["perseus"]["iso_energy_time"] == 0.0
    assert r["megatron"]["iso_energy_time"] is None  # megatron never reaches 70 J


def test_reductions_need_references():
    with pytest.raises(PlanError):
        reductions({"kareus": [(1.0, 1.0)]})


def test_frontier_document_sorts_and_rejects_unknown_method():
    doc = frontier_document(
        {"model": "x"},
        {
            "megatron": [{"time_s": 2.0, "energy_j": 5.0}],
            "perseus": [{"time_s": 3.0, "energy_j": 3.0}, {"time_s": 2.0, "energy_j": 4.0}],
        },
    )
    assert doc["format"] == "kareus-frontier/1"
    assert [p["time_s"] for p in doc["methods"]["perseus"]["points"]] == [2.0, 3.0]
    with pytest.raises(PlanError):
        frontier_document({}, {"bogus": [{"time_s": 1.0, "energy_j": 1.0}]})
