"""Per-instruction options prepared for the pipeline solver: useful options and their convex hull.

With blocked power p (W), the iteration energy over one GPU per rank is
``sum_i c_i + p * pp * T`` where ``c_i = e_i - p * t_i`` is an option's *effective cost* (J): running an
instruction for t seconds saves the blocked power it would otherwise draw while waiting. So an option is
*useful* only if no faster-or-equal option has a lower-or-equal effective cost: every slower, costlier
option can be replaced by a faster, cheaper one without lengthening any path. Along the useful options,
sorted by time, c strictly decreases. The *hull* is their lower convex hull in (t, c), the convex
piecewise-linear cost the LP relaxation uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kareus_megatron.search.frontier import pareto_indices


@dataclass(frozen=True)
class PreparedOptions:
    """Useful options of every node, padded to a common width K (time +inf, cost +inf as padding)."""

    orig: np.ndarray  # (n, K) original option index (-1 padding)
    time_s: np.ndarray  # (n, K) ascending per row
    cost_j: np.ndarray  # (n, K) effective cost e - p t, strictly descending per row
    energy_j: np.ndarray  # (n, K)
    count: np.ndarray  # (n,) useful options per node
    hull: tuple[np.ndarray, ...]  # per node, positions (into the useful options) of the hull vertices

    @property
    def fastest(self) -> np.ndarray:
        """(n,) duration (s) of each node's fastest option."""
        return self.time_s[:, 0]

    @property
    def slowest(self) -> np.ndarray:
        """(n,) duration (s) of each node's slowest useful option (its lowest effective cost)."""
        return self.time_s[np.arange(len(self.count)), self.count - 1]


def lower_hull(t: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Positions of the lower convex hull vertices of points sorted by t ascending (Andrew's monotone chain)."""
    h: list[int] = []
    for k in range(t.size):
        while len(h) >= 2:
            a, b = h[-2], h[-1]
            # b lies on or above the segment a -> k: drop it.
            if (c[b] - c[a]) * (t[k] - t[a]) >= (c[k] - c[a]) * (t[b] - t[a]):
                h.pop()
            else:
                break
        h.append(k)
    return np.array(h, dtype=np.int64)


def prepare_options(times: list[np.ndarray], energies: list[np.ndarray], p_blocked_w: float) -> PreparedOptions:
    """Useful options and hull of every node from per-node option time (s) and energy (J, one GPU)."""
    n = len(times)
    kept = []
    cache: dict[int, np.ndarray] = {}  # by id of the time array: nodes often share their options
    for t, e in zip(times, energies):
        if id(t) not in cache:
            cache[id(t)] = pareto_indices(t, e - p_blocked_w * t)
        kept.append(cache[id(t)])
    width = max(k.size for k in kept)
    orig = np.full((n, width), -1, dtype=np.int64)
    tt = np.full((n, width), np.inf)
    cc = np.full((n, width), np.inf)
    ee = np.full((n, width), np.inf)
    count = np.empty(n, dtype=np.int64)
    hull = []
    hull_cache: dict[int, np.ndarray] = {}
    for i, (t, e, k) in enumerate(zip(times, energies, kept)):
        m = k.size
        orig[i, :m] = k
        tt[i, :m] = t[k]
        ee[i, :m] = e[k]
        cc[i, :m] = e[k] - p_blocked_w * t[k]
        count[i] = m
        if id(t) not in hull_cache:
            hull_cache[id(t)] = lower_hull(tt[i, :m], cc[i, :m])
        hull.append(hull_cache[id(t)])
    return PreparedOptions(orig, tt, cc, ee, count, tuple(hull))
