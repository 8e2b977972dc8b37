"""--robust (issue 24 item 5): a bound is met by the band's high end, not by the point estimate."""

from __future__ import annotations

from pathlib import Path

import pytest

from kareus_megatron.plan.objective import FrontierPoint, ObjectiveError, parse_objective, select_point


def point(i, t, e, t_hi, e_hi):
    return FrontierPoint(
        method="kareus",
        index=i,
        plan_path=Path(f"plans/kareus-{i:02d}.json"),
        time_s=t,
        energy_j=e,
        time_s_band=(0.9 * t, t_hi),
        energy_j_band=(0.9 * e, e_hi),
    )


# 01 is the point estimate's pick for max-time=10 and energy=90, but its bands reach past both bounds
POINTS = [point(0, 8.0, 100.0, 9.0, 110.0), point(1, 9.9, 89.0, 11.0, 95.0), point(2, 12.0, 80.0, 13.0, 85.0)]


def test_robust_max_time_needs_the_time_band_within_the_bound():
    assert select_point(POINTS, parse_objective("max-time=10")).index == 1
    assert select_point(POINTS, parse_objective("max-time=10"), robust=True).index == 0


def test_robust_energy_needs_the_energy_band_within_the_bound():
    assert select_point(POINTS, parse_objective("energy=90")).index == 1
    assert select_point(POINTS, parse_objective("energy=90"), robust=True).index == 2


def test_robust_iso_time_compares_with_the_references_band_and_min_energy_with_the_high_end():
    assert select_point(POINTS, parse_objective("iso-time"), reference_time_s=10.0).index == 1
    assert select_point(POINTS, parse_objective("iso-time"), reference_time_s=10.0, robust=True).index == 0
    assert select_point(POINTS, parse_objective("min-energy"), robust=True).index == 2


def test_robust_without_bands_or_out_of_reach_is_one_clear_error():
    bare = [FrontierPoint(method="kareus", index=0, plan_path=Path("p.json"), time_s=1.0, energy_j=1.0)]
    with pytest.raises(ObjectiveError, match="--robust needs prediction bands"):
        select_point(bare, parse_objective("min-energy"), robust=True)
    with pytest.raises(ObjectiveError, match="fastest 95th-percentile time is 9"):
        select_point(POINTS, parse_objective("max-time=8.5"), robust=True)
