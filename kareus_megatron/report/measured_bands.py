"""Measured bands of ``kareus compare``: the spread of each run's iterations and of the reductions between runs.

Terms (band = ``[low, high]``, the vocab.BAND_PERCENTILES [5th, 95th] percentile, as kareus plan's bands):

- a run's *point band*: the percentiles of its used iterations' times (s) and energies (J, all GPUs) after
  warm-up (summary.summarize's records) -- how much one iteration varies, not the error of the median;
- a reduction's *band*: a bootstrap over iterations. Each resample draws every run's used iterations with
  replacement (as many as it has), takes the same figures as the point (median time, mean energy), and the
  reductions are computed resample by resample by plan/frontier.reduction_bands, with the runs fixed at those
  the point estimate picks. A reduction whose band holds 0 is not distinguishable from no difference.

A run with fewer than MIN_BAND_ITERATIONS used iterations has no band, and neither has a reduction that reads
it (its resamples are NaN: there are too few iterations to say how they spread). The resamples are drawn from
one generator seeded with BOOTSTRAP_SEED, runs in name order, so the same logs give the same bands.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.plan.frontier import band, reduction_bands
from kareus_megatron.vocab import BAND_PERCENTILES

MIN_BAND_ITERATIONS = 5  # fewer used iterations: no band (5th/95th percentiles of 4 values are interpolation)
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class RunIterations:
    """One run's used iterations: name, time (s) and energy (J, all GPUs) of each."""

    name: str
    time_s: np.ndarray
    energy_j: np.ndarray

    @classmethod
    def of_records(cls, name: str, records: Sequence[Mapping[str, Any]]) -> RunIterations:
        """From summary.RunSummary.records (every record has time_s and energy_j)."""
        return cls(
            name=name,
            time_s=np.array([float(r["time_s"]) for r in records]),
            energy_j=np.array([float(r["energy_j"]) for r in records]),
        )

    @property
    def banded(self) -> bool:
        """Whether the run has enough iterations (MIN_BAND_ITERATIONS) for a band."""
        return len(self.time_s) >= MIN_BAND_ITERATIONS


def point_bands(run: RunIterations) -> dict[str, list[float]]:
    """{time_s_band (s), energy_j_band (J)}: percentiles over the run's iterations; {} under MIN_BAND_ITERATIONS."""
    if not run.banded:
        return {}
    return {"time_s_band": band(run.time_s).tolist(), "energy_j_band": band(run.energy_j).tolist()}


def bootstrap(
    runs: Sequence[RunIterations], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per run name, its median time (s) and mean energy (J) in each of `resamples` bootstrap resamples of its
    iterations; all NaN for a run under MIN_BAND_ITERATIONS. Seeded: the same runs give the same arrays."""
    rng = np.random.default_rng(seed)
    out = {}
    for run in sorted(runs, key=lambda r: r.name):
        n = len(run.time_s)
        if not run.banded:
            nan = np.full(resamples, np.nan)
            out[run.name] = (nan, nan.copy())
            continue
        idx = rng.integers(0, n, size=(resamples, n))
        out[run.name] = (np.median(run.time_s[idx], axis=1), run.energy_j[idx].mean(axis=1))
    return out


def measured_reduction_bands(
    doc: Mapping[str, Any],
    runs: Sequence[RunIterations],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, dict[str, list[float] | None]]:
    """Every reduction's band (``<key>_band``) of a measured frontier document (points name their ``run``);
    None where the reduction is None or reads a run without a band."""
    samples = bootstrap(runs, resamples, seed)
    points = {m: entry["points"] for m, entry in doc["methods"].items()}
    frontiers = {
        m: (np.array([p["time_s"] for p in pts]), np.array([p["energy_j"] for p in pts])) for m, pts in points.items()
    }
    with np.errstate(invalid="ignore"):
        out = reduction_bands(frontiers, lambda m, i: samples[points[m][i]["run"]])
    return {
        m: {k: b if b is not None and all(math.isfinite(x) for x in b) else None for k, b in r.items()}
        for m, r in out.items()
    }


def bands_record(resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """What a measured frontier document says of its bands (the planner's ``bands`` keys, draws = resamples)."""
    return {
        "source": "bootstrap",
        "draws": resamples,
        "seed": seed,
        "percentiles": list(BAND_PERCENTILES),
        "min_iterations": MIN_BAND_ITERATIONS,
    }


def add_bands(
    doc: dict[str, Any], runs: Sequence[RunIterations], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> None:
    """Give `doc` (a measured kareus-frontier/1 document) its point bands, reduction bands and ``bands`` record."""
    by_name = {r.name: r for r in runs}
    for entry in doc["methods"].values():
        for p in entry["points"]:
            p.update(point_bands(by_name[p["run"]]))
    for m, extra in measured_reduction_bands(doc, runs, resamples, seed).items():
        doc["reductions"][m].update(extra)
    doc["bands"] = bands_record(resamples, seed)
