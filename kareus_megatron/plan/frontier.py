"""The frontier file, ``kareus-frontier/1``, and the reductions reported against the baselines.

Reductions (fractions, 0.23 = 23%) of the Kareus evaluation (docs/sources.md#kareus-evaluation), with P the
Perseus frontier and each point's time = iteration time (s), energy = GPU energy of the job (J):

- iso_time_energy  = (E_P(fastest) - min{E : point of the method with T <= T_P(fastest)}) / E_P(fastest)
- iso_energy_time  = (T_P(min-energy) - min{T : point with E <= E_P(min-energy)}) / T_P(min-energy)
- max_throughput_time_vs_megatron   = (T_megatron(fastest) - T_method(fastest)) / T_megatron(fastest)
- max_throughput_energy_vs_megatron = (E_megatron(fastest) - E_method(fastest)) / E_megatron(fastest)

"Within" (<=) allows vocab.py's ISO_REL_TOL (0.1%): a plan 5 ms slower than Perseus's fastest 7 s plan is at
the same time for the model, whose resolution is coarser. E_P(fastest) is likewise Perseus's least energy within
that time, and T_P(min-energy) its least time within that energy, so Perseus's own reductions are 0. When a
method has no point within the reference's time (or energy), that reduction is ``None`` in memory and ``null``
in the file (`kareus plan` says why).

Bands (kareus plan, search/bands.py): each point's ``time_s_band`` / ``energy_j_band`` is the [5th, 95th]
percentile of its predicted time (s) / energy (J) over the parameter draws (cost/uncertainty.py), and each
reduction's ``<key>_band`` that of the reduction computed draw by draw with the same plans (paired: both sides
under the same parameters). A reduction whose band holds 0 is *not distinguishable* from no difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kareus_megatron.errors import PlanError
from kareus_megatron.plan.schema import FRONTIER_FORMAT
from kareus_megatron.vocab import BAND_PERCENTILES, ISO_REL_TOL, MEGATRON, METHODS, PERSEUS, REFERENCE_METHODS

Point = tuple[float, float]  # (time_s, energy_j)


def _fastest(points: Sequence[Point]) -> Point:
    return min(points, key=lambda p: (p[0], p[1]))


def _min_energy(points: Sequence[Point]) -> Point:
    return min(points, key=lambda p: (p[1], p[0]))


def reductions(frontiers: Mapping[str, Sequence[Point]]) -> dict[str, dict[str, float | None]]:
    """The four reductions of every method; needs 'perseus' and 'megatron' frontiers."""
    for ref in REFERENCE_METHODS:
        if not frontiers.get(ref):
            raise PlanError(f"reductions need a non-empty {ref!r} frontier")
    tp_fast, _ = _fastest(frontiers[PERSEUS])
    _, ep_minE = _min_energy(frontiers[PERSEUS])
    # Perseus's own plans at those references (within ISO_REL_TOL too), so Perseus against itself is 0
    ep_fast = min(e for t, e in frontiers[PERSEUS] if t <= tp_fast * (1 + ISO_REL_TOL))
    tp_minE = min(t for t, e in frontiers[PERSEUS] if e <= ep_minE * (1 + ISO_REL_TOL))
    tm, em = _fastest(frontiers[MEGATRON])
    out: dict[str, dict[str, float | None]] = {}
    for name, pts in frontiers.items():
        if not pts:
            continue
        within_t = [e for t, e in pts if t <= tp_fast * (1 + ISO_REL_TOL)]
        within_e = [t for t, e in pts if e <= ep_minE * (1 + ISO_REL_TOL)]
        t_fast, e_fast = _fastest(pts)
        out[name] = {
            "iso_time_energy": (ep_fast - min(within_t)) / ep_fast if within_t else None,
            "iso_energy_time": (tp_minE - min(within_e)) / tp_minE if within_e else None,
            "max_throughput_time_vs_megatron": (tm - t_fast) / tm,
            "max_throughput_energy_vs_megatron": (em - e_fast) / em,
        }
    return out


def frontier_document(config: Mapping[str, Any], methods: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Build the kareus-frontier/1 object; `methods[name]` is a list of {time_s, energy_j, plan?}."""
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise PlanError(f"unknown method(s) {sorted(unknown)}; known: {', '.join(METHODS)}")
    doc_methods = {}
    for name, pts in methods.items():
        pts_sorted = sorted(pts, key=lambda p: (p["time_s"], p["energy_j"]))
        for p in pts_sorted:
            if not (math.isfinite(p["time_s"]) and math.isfinite(p["energy_j"])):
                raise PlanError(f"method {name}: non-finite point {p}")
        doc_methods[name] = {"points": [dict(p) for p in pts_sorted]}
    red = reductions({n: [(p["time_s"], p["energy_j"]) for p in m["points"]] for n, m in doc_methods.items()})
    return {"format": FRONTIER_FORMAT, "config": dict(config), "methods": doc_methods, "reductions": red}


REDUCTION_KEYS = (
    "iso_time_energy",
    "iso_energy_time",
    "max_throughput_time_vs_megatron",
    "max_throughput_energy_vs_megatron",
)
Draws = Callable[[str, int], tuple[np.ndarray, np.ndarray]]  # (method, frontier index) -> (time s, energy J) per draw


def band(values: np.ndarray, axis: int = 0) -> np.ndarray:
    """[5th, 95th] percentile (vocab.BAND_PERCENTILES) of `values` along `axis`, the draws: shape (2, ...)."""
    return np.percentile(np.asarray(values, dtype=float), BAND_PERCENTILES, axis=axis)


def iso_indices(
    time_s: np.ndarray, energy_j: np.ndarray, ref_time_s: float, ref_energy_j: float
) -> tuple[int | None, int | None]:
    """(least-energy point with T <= ref_time_s, fastest point with E <= ref_energy_j), within ISO_REL_TOL; None
    where there is none. The points reductions() reads, on a time-sorted frontier."""
    t, e = np.asarray(time_s, float), np.asarray(energy_j, float)
    ok_t = np.flatnonzero(t <= ref_time_s * (1 + ISO_REL_TOL))
    ok_e = np.flatnonzero(e <= ref_energy_j * (1 + ISO_REL_TOL))
    return (int(ok_t[np.argmin(e[ok_t])]) if ok_t.size else None, int(ok_e[np.argmin(t[ok_e])]) if ok_e.size else None)


def decision_indices(frontiers: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, set[int]]:
    """Per method, the frontier indices (time-sorted (time s, energy J) arrays) that decide its reductions."""
    tp, ep = frontiers[PERSEUS]
    ref_t, ref_e = float(tp[0]), float(np.min(ep))
    return {
        name: {0, *(i for i in iso_indices(t, e, ref_t, ref_e) if i is not None)} for name, (t, e) in frontiers.items()
    }


def reduction_bands(
    frontiers: Mapping[str, tuple[np.ndarray, np.ndarray]], draws: Draws
) -> dict[str, dict[str, list[float] | None]]:
    """Every reduction's [5th, 95th] percentile over the draws, the plans fixed at those reductions() picks.

    `frontiers[name]`: the whole time-sorted frontier (time s, energy J); `draws(name, index)` that plan's time
    and energy under every draw (the same draws for every method). None where the reduction is None.
    """
    tp, ep = frontiers[PERSEUS]
    ref_t, ref_e = float(tp[0]), float(np.min(ep))
    p_t, p_e = iso_indices(tp, ep, ref_t, ref_e)
    assert p_t is not None and p_e is not None  # Perseus meets its own references
    ep_fast = draws(PERSEUS, p_t)[1]
    tp_min_e = draws(PERSEUS, p_e)[0]
    tm, em = draws(MEGATRON, 0)
    out: dict[str, dict[str, list[float] | None]] = {}
    for name, (t, e) in frontiers.items():
        i_t, i_e = iso_indices(t, e, ref_t, ref_e)
        t_fast, e_fast = draws(name, 0)
        per_draw = {
            "iso_time_energy": None if i_t is None else (ep_fast - draws(name, i_t)[1]) / ep_fast,
            "iso_energy_time": None if i_e is None else (tp_min_e - draws(name, i_e)[0]) / tp_min_e,
            "max_throughput_time_vs_megatron": (tm - t_fast) / tm,
            "max_throughput_energy_vs_megatron": (em - e_fast) / em,
        }
        out[name] = {f"{k}_band": None if v is None else [float(x) for x in band(v)] for k, v in per_draw.items()}
    return out


def distinguishable(value_band: Sequence[float] | None) -> bool | None:
    """False when a reduction's band holds 0 (the advantage is inside the model's error); None without a band."""
    if value_band is None:
        return None
    lo, hi = value_band
    return not lo <= 0.0 <= hi
