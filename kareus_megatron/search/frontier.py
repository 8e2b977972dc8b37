"""Pareto frontiers of (time, energy) points, evaluated as arrays.

A point dominates another when it is no slower and uses no more energy, and is better in one of them.
Frontiers are returned sorted by time ascending, so energy strictly decreases along them.
"""

from __future__ import annotations

import numpy as np


def pareto_mask(time_s: np.ndarray, energy_j: np.ndarray) -> np.ndarray:
    """Boolean mask of the non-dominated points (time s, energy J); among exact ties keeps the first. O(n log n)."""
    t = np.asarray(time_s, dtype=float)
    e = np.asarray(energy_j, dtype=float)
    if t.size == 0:
        return np.zeros(0, dtype=bool)
    order = np.lexsort((e, t))  # by time, then energy
    es = e[order]
    best_before = np.minimum.accumulate(np.r_[np.inf, es[:-1]])
    keep_sorted = es < best_before
    mask = np.zeros(t.size, dtype=bool)
    mask[order[keep_sorted]] = True
    return mask


def pareto_indices(time_s: np.ndarray, energy_j: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated points, sorted by time ascending (energy strictly decreasing)."""
    t = np.asarray(time_s, dtype=float)
    idx = np.flatnonzero(pareto_mask(t, energy_j))
    return idx[np.argsort(t[idx], kind="stable")]


def pareto_sum(
    time_a: np.ndarray, energy_a: np.ndarray, time_b: np.ndarray, energy_b: np.ndarray, max_points: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Frontier of the Minkowski sum of two frontiers (time and energy add).

    Returns (time_s, energy_j, pairs) where pairs[k] = (i, j) are the indices into a and b that make
    point k. With `max_points`, the result is thinned to at most that many points, always keeping the
    fastest and the lowest-energy one and spreading the rest evenly in time.
    """
    ta, ea = np.asarray(time_a, float), np.asarray(energy_a, float)
    tb, eb = np.asarray(time_b, float), np.asarray(energy_b, float)
    grid_i, grid_j = np.meshgrid(np.arange(ta.size), np.arange(tb.size), indexing="ij")
    ii, jj = grid_i.ravel(), grid_j.ravel()
    t, e = ta[ii] + tb[jj], ea[ii] + eb[jj]
    keep = pareto_indices(t, e)
    if max_points is not None and keep.size > max_points:
        keep = keep[thin_indices(t[keep], max_points)]
    return t[keep], e[keep], np.stack([ii[keep], jj[keep]], axis=1)


def thin_indices(sorted_time_s: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of at most `max_points` points of a time-sorted frontier, spread evenly in time, ends kept."""
    n = sorted_time_s.size
    if n <= max_points:
        return np.arange(n)
    targets = np.linspace(sorted_time_s[0], sorted_time_s[-1], max_points)
    idx = np.searchsorted(sorted_time_s, targets).clip(0, n - 1)
    idx[0], idx[-1] = 0, n - 1
    return np.unique(idx)
