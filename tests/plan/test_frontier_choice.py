"""plan/objective.py frontier_choice: the one choice of a frontier point for an objective, shared by kareus plan's
suggestion and the runtime's --kareus-point (--kareus-robust), and iso-time's reference (the megatron point)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kareus_megatron.plan.objective import FrontierPoint, Objective, ObjectiveError, frontier_choice


def point(method, i, t, e, t_hi=None, e_hi=None):
    """A point of `method`: time t (s), energy e (J); bands [0.95 t, t_hi], [0.95 e, e_hi] when given."""
    return FrontierPoint(
        method=method,
        index=i,
        plan_path=Path(f"plans/{method}-{i:02d}.json"),
        time_s=t,
        energy_j=e,
        time_s_band=None if t_hi is None else (0.95 * t, t_hi),
        energy_j_band=None if e_hi is None else (0.95 * e, e_hi),
    )


# Megatron's max-clock plan: 1.0 s, its 95th percentile 1.10 s. kareus-01 meets iso-time at the point estimate
# (1.0 s) but its 95th percentile (1.15 s) is past Megatron's; kareus-00 meets it across the band. kareus-02 has the
# least energy at the point estimate, but the widest energy band: kareus-01 has the least 95th-percentile energy.
MEGATRON = [point("megatron", 0, 1.0, 40.0, 1.10, 44.0)]
KAREUS = [
    point("kareus", 0, 0.98, 30.0, 1.05, 33.0),
    point("kareus", 1, 1.0, 20.0, 1.15, 22.0),
    point("kareus", 2, 1.3, 10.0, 1.40, 40.0),
]
ISO, MIN = Objective("iso-time"), Objective("min-energy")


def test_robust_iso_time_picks_a_faster_safer_point_than_the_point_estimate():
    assert frontier_choice(KAREUS, ISO, reference=MEGATRON).index == 1
    assert frontier_choice(KAREUS, ISO, reference=MEGATRON, robust=True).index == 0


def test_robust_iso_time_compares_with_the_references_time_band_high_end():
    """kareus-00's 95th percentile (1.05 s) is slower than Megatron's point estimate (1.0 s) but within its band's
    high end (1.10 s): it is chosen; with Megatron's band reaching 1.2 s, kareus-01 (1.15 s) is within it too."""
    assert frontier_choice(KAREUS, ISO, reference=MEGATRON, robust=True).index == 0
    wide = [point("megatron", 0, 1.0, 40.0, 1.2, 44.0)]
    assert frontier_choice(KAREUS, ISO, reference=wide, robust=True).index == 1
    narrow = [point("megatron", 0, 1.0, 40.0, 1.01, 44.0)]
    with pytest.raises(ObjectiveError, match=r"1\.01 s per iteration; the fastest 95th-percentile time is 1\.05"):
        frontier_choice(KAREUS, ISO, reference=narrow, robust=True)


def test_iso_time_reference_is_the_fastest_megatron_point_else_the_methods_own_fastest():
    slower = point("megatron", 1, 1.5, 30.0, 1.6, 33.0)
    assert frontier_choice(KAREUS, ISO, reference=[slower, *MEGATRON]).index == 1  # 1.0 s, not 1.5 s
    assert frontier_choice(KAREUS, ISO).index == 0  # no megatron point: kareus-00's own 0.98 s


def test_robust_min_energy_minimises_the_energy_band_high_end():
    assert frontier_choice(KAREUS, MIN).index == 2
    assert frontier_choice(KAREUS, MIN, robust=True).index == 1


def test_fastest_if_none_only_at_the_point_estimate():
    """--kareus-point's default falls back to the fastest point when none is as fast as Megatron; a robust choice
    does not (its guarantee would not hold), nor does an explicit objective."""
    quick = [point("megatron", 0, 0.5, 40.0, 0.6, 44.0)]
    assert frontier_choice(KAREUS, ISO, reference=quick, fastest_if_none=True).index == 0
    with pytest.raises(ObjectiveError, match="no plan is as fast as 0.5 s"):
        frontier_choice(KAREUS, ISO, reference=quick)
    with pytest.raises(ObjectiveError, match="no plan is as fast as 0.6 s"):
        frontier_choice(KAREUS, ISO, reference=quick, robust=True, fastest_if_none=True)


def test_robust_without_bands_names_the_flag_and_the_point():
    bare_ref = [point("megatron", 0, 1.0, 40.0)]
    with pytest.raises(ObjectiveError, match="--kareus-robust needs prediction bands, but point megatron-00 has none"):
        frontier_choice(KAREUS, ISO, reference=bare_ref, robust=True, flag="--kareus-robust")
    bare = [point("kareus", 0, 1.0, 10.0)]
    with pytest.raises(ObjectiveError, match="point kareus-00 has none.*or drop --robust$"):
        frontier_choice(bare, MIN, robust=True)
    assert frontier_choice(bare, MIN).index == 0  # without robust, bands are not needed
