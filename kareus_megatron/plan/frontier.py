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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kareus_megatron.errors import PlanError
from kareus_megatron.plan.schema import FRONTIER_FORMAT
from kareus_megatron.vocab import ISO_REL_TOL, MEGATRON, METHODS, PERSEUS, REFERENCE_METHODS

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


def frontier_document(
    config: Mapping[str, Any], methods: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
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
