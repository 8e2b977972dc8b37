"""Compose per-partition frontiers into per-instruction options (time s, energy J of one GPU).

Terms: a *knob table* of one partition gives, per SM clock, the time and energy of every knob setting
(comm SMs × launch slot), summed over the instances of that partition in the instruction. Because each
partition's knobs are independent, the instruction's frontier at one clock is the Pareto sum of the
partitions' frontiers plus the work that no knob changes (compute alone, stage extras). Sums are exact
unless ``max_points`` asks for thinning.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kareus_megatron.search.frontier import pareto_indices, pareto_sum, thin_indices


def pareto_compose(
    const_time_s: float,
    const_energy_j: float,
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    max_points: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Frontier of const + Σ parts, each part contributing one of its points.

    Returns (time_s, energy_j, choice) with choice[p, j] the index into part j's arrays used by point p;
    points sorted fastest first, energy strictly decreasing.
    """
    t = np.array([float(const_time_s)])
    e = np.array([float(const_energy_j)])
    choice = np.zeros((1, 0), dtype=np.int64)
    for pt, pe in parts:
        pt, pe = np.asarray(pt, float), np.asarray(pe, float)
        keep = pareto_indices(pt, pe)
        t, e, pairs = pareto_sum(t, e, pt[keep], pe[keep], max_points=max_points)
        choice = np.concatenate([choice[pairs[:, 0]], keep[pairs[:, 1]][:, None]], axis=1)
    return t, e, choice


def union_frontier(
    time_s: Sequence[np.ndarray], energy_j: Sequence[np.ndarray], max_points: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pareto frontier of the union of several point sets.

    Returns (source, index, order): point p of the result is set source[p]'s point index[p];
    fastest first. With max_points, thinned evenly in time keeping both ends.
    """
    sizes = [np.asarray(t).size for t in time_s]
    source = np.repeat(np.arange(len(sizes)), sizes)
    index = np.concatenate([np.arange(n) for n in sizes]) if sizes else np.zeros(0, np.int64)
    t = np.concatenate([np.asarray(x, float).ravel() for x in time_s]) if sizes else np.zeros(0)
    e = np.concatenate([np.asarray(x, float).ravel() for x in energy_j]) if sizes else np.zeros(0)
    keep = pareto_indices(t, e)
    if max_points is not None and keep.size > max_points:
        keep = keep[thin_indices(t[keep], max_points)]
    return source[keep], index[keep], keep
