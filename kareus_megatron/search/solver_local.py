"""Discrete repair of pipeline plans: rounding continuous durations and filling slack.

Plans here are *positions* into each node's useful options (see solver_options), batched as (B, n)
arrays with one deadline (s) per plan. Along the useful options a slower option always has a lower
effective cost, so any slack a node has should be spent on the slowest option that still fits.

- ``round_down``: the slowest option no slower than the LP duration (keeps the LP's feasibility).
- ``fill_backward``: walk the DAG from the end, level by level; each node takes the slowest option that
  fits between its earliest start (current plan) and the latest finish its already-final successors allow.
- ``fill_forward``: the mirror image, walking from the start.
Both only ever slow nodes down within their float, so a plan stays within its deadline and its cost
never rises.
"""

from __future__ import annotations

import numpy as np

from kareus_megatron.search.pipeline import PipelineDAG
from kareus_megatron.search.simulate import earliest_times, latest_finish
from kareus_megatron.search.solver_options import PreparedOptions

_EPS = 1e-12


def durations(prep: PreparedOptions, pos: np.ndarray) -> np.ndarray:
    """Durations (s) of positions `pos` (..., n)."""
    return np.take_along_axis(np.broadcast_to(prep.time_s, pos.shape[:-1] + prep.time_s.shape), pos[..., None], -1)[
        ..., 0
    ]


def costs(prep: PreparedOptions, pos: np.ndarray) -> np.ndarray:
    """Effective costs (J) of positions `pos` (..., n)."""
    return np.take_along_axis(np.broadcast_to(prep.cost_j, pos.shape[:-1] + prep.cost_j.shape), pos[..., None], -1)[
        ..., 0
    ]


def round_down(prep: PreparedOptions, dur_s: np.ndarray) -> np.ndarray:
    """Position of the slowest useful option no slower than `dur_s` (..., n) (the fastest if none)."""
    tol = _EPS * (1.0 + np.abs(dur_s))
    pos = (prep.time_s <= (dur_s + tol)[..., None]).sum(-1) - 1
    return np.maximum(pos, 0)


def _slowest_fitting(prep: PreparedOptions, lv: np.ndarray, allowed_s: np.ndarray, cur: np.ndarray) -> np.ndarray:
    tol = _EPS * (1.0 + np.abs(allowed_s))
    fit = (prep.time_s[lv] <= (allowed_s + tol)[..., None]).sum(-1) - 1
    return np.maximum(fit, cur)


def fill_backward(dag: PipelineDAG, prep: PreparedOptions, pos: np.ndarray, deadline_s: np.ndarray) -> np.ndarray:
    """Slow nodes into their slack from the end of the DAG backwards; returns new positions (B, n)."""
    pos = pos.copy()
    start, _ = earliest_times(dag, durations(prep, pos))
    dl = np.asarray(deadline_s, float)
    lstart = np.empty(pos.shape[:-1] + (dag.n + 1,))
    lstart[..., dag.n] = dl
    cap = np.full(pos.shape, np.inf)
    cap[..., dag.last_nodes] = dl[..., None] - dag.end_lag_s
    for lv in reversed(dag.levels):
        lf = np.minimum((lstart[..., dag.succ[lv]] - dag.succ_lag_s[lv]).min(-1), cap[..., lv])
        new = _slowest_fitting(prep, lv, lf - start[..., lv], pos[..., lv])
        pos[..., lv] = new
        lstart[..., lv] = lf - prep.time_s[lv, new] if new.ndim == 1 else lf - prep.time_s[lv[None, :], new]
    return pos


def fill_forward(dag: PipelineDAG, prep: PreparedOptions, pos: np.ndarray, deadline_s: np.ndarray) -> np.ndarray:
    """Slow nodes into their slack from the start of the DAG forwards; returns new positions (B, n)."""
    pos = pos.copy()
    lfin = latest_finish(dag, durations(prep, pos), deadline_s)
    end = np.zeros(pos.shape[:-1] + (dag.n + 1,))
    for lv in dag.levels:
        es = (end[..., dag.pred[lv]] + dag.pred_lag_s[lv]).max(-1)
        new = _slowest_fitting(prep, lv, lfin[..., lv] - es, pos[..., lv])
        pos[..., lv] = new
        end[..., lv] = es + (prep.time_s[lv, new] if new.ndim == 1 else prep.time_s[lv[None, :], new])
    return pos


def fill_slack(
    dag: PipelineDAG, prep: PreparedOptions, pos: np.ndarray, deadline_s: np.ndarray, max_rounds: int = 4
) -> np.ndarray:
    """Alternate backward and forward slack filling until nothing changes (at most `max_rounds` rounds)."""
    for _ in range(max_rounds):
        new = fill_forward(dag, prep, fill_backward(dag, prep, pos, deadline_s), deadline_s)
        if np.array_equal(new, pos):
            break
        pos = new
    return pos
