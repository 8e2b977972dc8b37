"""What an automatically chosen plan optimises (``--kareus-objective``), and the point of a frontier that meets it.

Objectives (time = predicted iteration time, s; energy = predicted iteration energy, J, the whole job):

- ``iso-time`` (default): the least energy at the max-clock plan's time (the ``megatron`` point of the same
  frontier, i.e. the same calibrated model; within vocab.py's ISO_REL_TOL, 0.1%), so training is no
  slower than without kareus;
- ``min-energy``: the least energy at any time;
- ``max-time=S``: the least energy with time <= S seconds;
- ``energy=J``: the fastest plan with energy <= J joules.

``frontier_choice`` is the one choice of a frontier point for an objective: ``kareus plan``'s suggestion
(cli/plan_output.py) and the runtime's ``--kareus-point iso-time|min-energy`` (plan/points.py) both call it.
It finds iso-time's reference (the fastest ``megatron`` point) and calls ``select_point``, which picks from one
method's ``FrontierPoint``s; an objective no point meets is an ObjectiveError naming the closest the frontier
gets. *Robust* (``kareus plan --robust``, ``--kareus-robust``): a bound is met across the band, i.e. by the
band's high end (the 95th percentile over the cost model's parameter draws, plan/frontier.py), not by the point
estimate; iso-time compares the point's time band high end with the reference plan's; min-energy minimises the
energy band's high end. A training job that meets one keeps running at its current plan
(runtime/closed_loop/auto.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kareus_megatron.errors import ConfigError
from kareus_megatron.vocab import ISO_REL_TOL

ISO_TIME, MIN_ENERGY, MAX_TIME, ENERGY = "iso-time", "min-energy", "max-time", "energy"
OBJECTIVES = (ISO_TIME, MIN_ENERGY, MAX_TIME, ENERGY)
SYNTAX = "iso-time, min-energy, max-time=S (seconds) or energy=J (joules)"
TIME_SLACK = 1e-9  # relative: a point at max-time=S (to rounding) meets it; iso-time allows ISO_REL_TOL


class ObjectiveError(ConfigError):
    """No point of the frontier meets the objective."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontierPoint:
    """One point of one method's frontier: its index, plan file and predicted time (s) and energy (J)."""

    method: str
    index: int
    plan_path: Path
    time_s: float
    energy_j: float
    time_s_band: tuple[float, float] | None = None  # [5th, 95th] percentile (s); None: a file without bands
    energy_j_band: tuple[float, float] | None = None  # (J)

    @property
    def run_name(self) -> str:
        """Directory name of a run of this point under a log directory: NAME-NN."""
        return f"{self.method}-{self.index:02d}"


@dataclass(frozen=True, slots=True)
class Objective:
    """A parsed objective: its kind and, for max-time / energy, the bound (s / J)."""

    kind: str
    bound: float | None = None

    def __str__(self) -> str:
        return self.kind if self.bound is None else f"{self.kind}={self.bound:g}"


def parse_objective(text: str, flag: str = "--kareus-objective") -> Objective:
    """Parse `text` (see the module doc); ConfigError naming `flag` otherwise."""
    raw = str(text).strip()
    kind, sep, value = raw.partition("=")
    kind = kind.strip()
    if kind in (ISO_TIME, MIN_ENERGY) and not sep:
        return Objective(kind)
    if kind in (MAX_TIME, ENERGY) and sep:
        try:
            bound = float(value)
        except ValueError:
            bound = math.nan
        if not (math.isfinite(bound) and bound > 0):
            unit = "seconds" if kind == MAX_TIME else "joules"
            raise ConfigError(f"{flag} {raw!r}: {kind} needs a positive number of {unit}, e.g. {kind}=1.5")
        return Objective(kind, bound)
    raise ConfigError(f"{flag} {raw!r} is not an objective; use {SYNTAX}")


def _high(p: FrontierPoint, robust: bool, flag: str = "--robust") -> tuple[float, float]:
    """(time s, energy J) a bound is checked against: the point estimate, or with `robust` its bands' high ends."""
    if not robust:
        return p.time_s, p.energy_j
    if p.time_s_band is None or p.energy_j_band is None:
        raise ObjectiveError(
            f"{flag} needs prediction bands, but point {p.run_name} has none; plan again with "
            f"kareus plan (bands on: leave out --band-samples 0), or drop {flag}"
        )
    return p.time_s_band[1], p.energy_j_band[1]


def select_point(
    points: Sequence[FrontierPoint],
    objective: Objective,
    reference_time_s: float | None = None,
    robust: bool = False,
    flag: str = "--robust",
) -> FrontierPoint:
    """The point of `points` (one method's frontier) that meets `objective` best.

    `reference_time_s`: the max-clock plan's predicted time (s), needed by iso-time: with `robust`, the high end
    of its time band (s). `robust`: bounds are met by the bands' high ends (module doc); `flag` names it.
    """
    if not points:
        raise ObjectiveError("the frontier has no points")
    kind = objective.kind
    high = {id(p): _high(p, robust, flag) for p in points}
    if kind == MIN_ENERGY:
        return min(points, key=lambda p: (high[id(p)][1], p.energy_j, p.time_s))
    if kind in (ISO_TIME, MAX_TIME):
        if kind == ISO_TIME:
            if reference_time_s is None:
                raise ValueError("iso-time needs the max-clock plan's time")
            bound, slack = reference_time_s, ISO_REL_TOL
        else:
            assert objective.bound is not None
            bound, slack = objective.bound, TIME_SLACK
        ok = [p for p in points if high[id(p)][0] <= bound * (1 + slack)]
        if not ok:
            fastest = min(high[id(p)][0] for p in points)
            what = "the fastest 95th-percentile time is" if robust else "the fastest is"
            raise ObjectiveError(
                f"objective {objective}: no plan is as fast as {bound:.6g} s per iteration; {what} {fastest:.6g} s"
            )
        return min(ok, key=lambda p: (p.energy_j, p.time_s))
    assert kind == ENERGY and objective.bound is not None
    ok = [p for p in points if high[id(p)][1] <= objective.bound]
    if not ok:
        least = min(high[id(p)][1] for p in points)
        what = "the least 95th-percentile energy is" if robust else "the least is"
        raise ObjectiveError(
            f"objective {objective}: no plan uses as little as {objective.bound:.6g} J per "
            f"iteration; {what} {least:.6g} J"
        )
    return min(ok, key=lambda p: (p.time_s, p.energy_j))


def frontier_choice(
    points: Sequence[FrontierPoint],
    objective: Objective,
    *,
    reference: Sequence[FrontierPoint] = (),
    robust: bool = False,
    fastest_if_none: bool = False,
    flag: str = "--robust",
) -> FrontierPoint:
    """The point of `points` (one method's frontier) that `objective` picks, for kareus plan and --kareus-point.

    Iso-time's reference time (s) is that of the fastest of `reference` (the frontier's megatron, max-clock,
    points; empty: the fastest of `points`), with `robust` the high end of its time band (s): Megatron's plan
    moves with the cost model's parameters too. `fastest_if_none`: when no point meets iso-time at the point
    estimate, the fastest point (--kareus-point's default) rather than an ObjectiveError; never with `robust`,
    whose guarantee a fallback would break. `flag` names the robust option in errors.
    """
    if not points:
        raise ObjectiveError("the frontier has no points")
    ref_time_s = None
    if objective.kind == ISO_TIME:
        fastest_ref = min(reference or points, key=lambda p: (p.time_s, p.energy_j))
        ref_time_s = _high(fastest_ref, robust, flag)[0]
        if fastest_if_none and not robust and all(p.time_s > ref_time_s * (1 + ISO_REL_TOL) for p in points):
            return min(points, key=lambda p: (p.time_s, p.energy_j))
    return select_point(points, objective, reference_time_s=ref_time_s, robust=robust, flag=flag)
