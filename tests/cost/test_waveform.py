"""The job power waveform and its grid metrics (cost/waveform.py), against waveforms with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kareus_megatron.cost.waveform import (
    BAND_HZ,
    RAMP_WINDOW_S,
    bin_count,
    job_parts,
    power_metrics,
    rank_bins,
    resample_periodic,
)
from kareus_megatron.errors import ConfigError


def test_square_wave_metrics_match_their_fourier_series():
    period, n, lo, hi = 1.0, 1000, 1000.0, 3000.0
    p = np.where(np.arange(n) < n // 2, hi, lo)
    m = power_metrics(p, period / n)
    assert (m.peak_power_w, m.min_power_w, m.mean_power_w, m.swing_w) == (hi, lo, 2000.0, 2000.0)
    assert m.ramp_w_per_s == pytest.approx((hi - lo) / RAMP_WINDOW_S)  # one step inside a 100 ms window
    # odd harmonics k/T of amplitude 4a/(pi k), a = half the swing; only those within 0.1-20 Hz count
    a = (hi - lo) / 2
    ks = [k for k in range(1, n // 2, 2) if BAND_HZ[0] <= k / period <= BAND_HZ[1]]
    rms = math.sqrt(sum((4 * a / (math.pi * k)) ** 2 / 2 for k in ks))
    assert m.band_fraction == pytest.approx(rms / 2000.0, rel=2e-3)  # sampled, not ideal, square wave
    flat = power_metrics(np.full(n, 500.0), period / n)
    assert (flat.swing_w, flat.ramp_w_per_s, flat.band_fraction) == (0.0, 0.0, 0.0)


def test_slow_oscillation_outside_the_band_is_not_counted():
    period, n = 40.0, 8000  # 0.025 Hz: below the band's 0.1 Hz
    t = np.arange(n) * period / n
    m = power_metrics(1000 + 100 * np.sin(2 * np.pi * t / period), period / n)
    assert m.band_fraction == pytest.approx(0.0, abs=1e-9) and m.swing_w == pytest.approx(200, rel=1e-3)
    fast = power_metrics(1000 + 100 * np.sin(2 * np.pi * 8 * t / period), period / n)  # 0.2 Hz: inside
    assert fast.band_fraction == pytest.approx(100 / math.sqrt(2) / 1000, rel=1e-6)


def test_rank_bins_integrate_energy_exactly_and_job_parts_count_blocked_gpus():
    period = 1.0
    start, end, energy = np.array([0.1, 0.5]), np.array([0.3, 0.9]), np.array([60.0, 120.0])  # 300 W each
    n = bin_count(period)
    assert period / n <= 0.01
    p, busy = rank_bins(start, end, energy, period, n)
    step = period / n
    assert p.sum() * step == pytest.approx(180.0) and busy.sum() * step == pytest.approx(0.6)
    assert p.max() == pytest.approx(300.0) and p[0] == 0.0
    a, b, step = job_parts(
        [(start, end, energy), (np.array([0.0]), np.array([1.0]), np.array([200.0]))], period, gpus_per_stage=4
    )
    assert a.sum() * step == pytest.approx(4 * 380.0)
    assert b.sum() * step == pytest.approx(4 * 0.4)  # rank 0 blocked 0.4 s, rank 1 never
    with pytest.raises(ConfigError, match="iteration time"):
        bin_count(0.0)


def test_samples_fold_onto_one_iteration():
    period, bins = 2.0, 8
    t = np.arange(0, 6, 0.05)  # 20 Hz over three iterations
    p = np.where(np.mod(t, period) < 1.0, 100.0, 300.0)
    folded = resample_periodic(t, p, period, bins)
    assert folded.tolist() == [100.0] * 4 + [300.0] * 4
    sparse = resample_periodic(np.array([0.1, 1.1]), np.array([5.0, 7.0]), period, bins)
    assert sparse.tolist() == [5.0] * 4 + [7.0] * 4  # power holds between samples
