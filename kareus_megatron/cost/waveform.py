"""The job's power waveform over one iteration and the six metrics a power grid cares about.

Terms (docs/power.md):

- *waveform*: the power (W) of every GPU of the job summed, over one iteration of period T (s), sampled
  as bin averages on N equal bins of ``step_s = T / N`` (s, at most ``MAX_STEP_S``). It is periodic:
  iteration k+1 repeats iteration k, and DP replicas run in phase (they synchronise every iteration),
  so a stage's power is its one GPU's times ``gpus_per_stage``.
- a rank's power is its instruction's power (energy J / duration s, one GPU) while it computes and the
  *blocked* power (W) otherwise: pipeline bubbles, waiting for data, the DP gradient reduction at the
  iteration end. The job waveform is therefore ``A(t) + p_blocked_w * B(t)``, with A the instruction
  power and B the number of blocked GPUs (both bin averages), and its mean times T is cost/energy.py's
  iteration energy exactly. A *power floor* F (W) replaces p_blocked_w by F (search/plan_power.py).
- metrics (all job totals, W): ``peak_power_w``, ``min_power_w``, ``mean_power_w``, ``swing_w`` (peak −
  min), ``ramp_w_per_s`` (the largest rise or fall of the power over any ``RAMP_WINDOW_S`` window, divided
  by the window) and ``band_fraction`` (RMS of the waveform's Fourier components between ``BAND_HZ`` over
  its mean; dimensionless), as the power-stabilisation study (arXiv 2508.14318) frames them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Final

import numpy as np

from kareus_megatron.errors import ConfigError

MAX_STEP_S: Final = 0.005  # finest bin width needed: the issue asks for 10 ms or finer
MIN_BINS: Final = 512  # short iterations still get enough bins for a smooth spectrum
RAMP_WINDOW_S: Final = 0.1  # window (s) of the ramp rate
BAND_HZ: Final = (0.1, 20.0)  # oscillation band (Hz) utilities care about (arXiv 2508.14318)
METRIC_NAMES: Final = ("peak_power_w", "min_power_w", "mean_power_w", "swing_w", "ramp_w_per_s", "band_fraction")


@dataclass(frozen=True, kw_only=True, slots=True)
class PowerMetrics:
    """Grid-facing metrics of a job's power waveform: powers in W, ramp in W/s, band_fraction dimensionless."""

    peak_power_w: float
    min_power_w: float
    mean_power_w: float
    swing_w: float
    ramp_w_per_s: float
    band_fraction: float

    def as_dict(self) -> dict[str, float]:
        """The metrics by name (the keys of frontier.json points and plan files)."""
        return asdict(self)

    @property
    def swing_fraction(self) -> float:
        """Swing over peak (dimensionless; 0 for a flat or zero waveform)."""
        return self.swing_w / self.peak_power_w if self.peak_power_w > 0 else 0.0


def bin_count(period_s: float) -> int:
    """Bins of one iteration of `period_s` (s): at least MIN_BINS, each at most MAX_STEP_S wide."""
    if not (math.isfinite(period_s) and period_s > 0):
        raise ConfigError(f"iteration time {period_s!r} s must be finite and > 0 to draw its power waveform")
    return max(MIN_BINS, math.ceil(period_s / MAX_STEP_S))


def rank_bins(
    start_s: np.ndarray, end_s: np.ndarray, energy_j: np.ndarray, period_s: float, bins: int
) -> tuple[np.ndarray, np.ndarray]:
    """One GPU's (instruction power W, busy fraction) averaged over each of `bins` bins of [0, period_s].

    The intervals [start_s, end_s) must not overlap (one GPU runs one instruction at a time); each draws
    energy_j (J) evenly. Computed exactly from the cumulative energy and busy time at the bin edges.
    """
    order = np.argsort(start_s, kind="stable")
    s, e, en = (np.asarray(a, float)[order] for a in (start_s, end_s, energy_j))
    xp = np.empty(2 * s.size)
    xp[0::2], xp[1::2] = s, e
    cum_e = np.cumsum(en)
    cum_t = np.cumsum(e - s)
    fe = np.empty_like(xp)
    ft = np.empty_like(xp)
    fe[0::2], fe[1::2] = cum_e - en, cum_e
    ft[0::2], ft[1::2] = cum_t - (e - s), cum_t
    edges = np.linspace(0.0, period_s, bins + 1)
    step = period_s / bins
    if xp.size == 0:
        return np.zeros(bins), np.zeros(bins)
    ce = np.interp(edges, xp, fe, left=0.0, right=float(fe[-1]))
    ct = np.interp(edges, xp, ft, left=0.0, right=float(ft[-1]))
    return np.diff(ce) / step, np.clip(np.diff(ct) / step, 0.0, 1.0)


def job_parts(
    ranks: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    period_s: float,
    gpus_per_stage: int,
    bins: int | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """(A, B, step_s): the job's instruction power A (W) and blocked GPU count B per bin, and the bin width (s).

    `ranks` holds each pipeline rank's (start_s, end_s, energy_j) arrays of one GPU; every GPU of a stage
    (`gpus_per_stage`: TP × CP × DP, replicas in phase) draws the same.
    """
    n = bin_count(period_s) if bins is None else bins
    a = np.zeros(n)
    b = np.zeros(n)
    for s, e, en in ranks:
        p, busy = rank_bins(s, e, en, period_s, n)
        a += gpus_per_stage * p
        b += gpus_per_stage * (1.0 - busy)
    return a, b, period_s / n


def metrics_arrays(power_w: np.ndarray, step_s: float) -> dict[str, np.ndarray]:
    """The six metrics of periodic waveforms `power_w` (..., N) W sampled every `step_s` s; arrays (...)."""
    p = np.asarray(power_w, float)
    n = p.shape[-1]
    peak, low, mean = p.max(axis=-1), p.min(axis=-1), p.mean(axis=-1)
    w = max(1, round(RAMP_WINDOW_S / step_s))
    idx = (np.arange(n) + w) % n
    ramp = np.abs(p[..., idx] - p).max(axis=-1) / (w * step_s)
    spec = np.fft.rfft(p, axis=-1) / n
    freq = np.fft.rfftfreq(n, d=step_s)
    band = (freq >= BAND_HZ[0]) & (freq <= BAND_HZ[1]) & (freq > 0)
    if n % 2 == 0:
        band[-1] = False  # Nyquist bin: not a pair of conjugate components
    rms = np.sqrt(2.0 * (np.abs(spec[..., band]) ** 2).sum(axis=-1))
    frac = np.divide(rms, mean, out=np.zeros_like(rms), where=mean > 0)
    return {
        "peak_power_w": peak,
        "min_power_w": low,
        "mean_power_w": mean,
        "swing_w": peak - low,
        "ramp_w_per_s": ramp,
        "band_fraction": frac,
    }


def power_metrics(power_w: np.ndarray, step_s: float) -> PowerMetrics:
    """The metrics of one periodic waveform `power_w` (N,) W sampled every `step_s` s."""
    if np.ndim(power_w) != 1 or len(power_w) < 2:
        raise ConfigError("a power waveform needs at least 2 samples")
    m = metrics_arrays(power_w, step_s)
    return PowerMetrics(**{k: float(v) for k, v in m.items()})


def resample_periodic(t_s: np.ndarray, power_w: np.ndarray, period_s: float, bins: int) -> np.ndarray:
    """Samples (t_s s from the iteration start, W) of one period folded onto `bins` bin averages (W).

    Bins without a sample take the previous bin's value (power holds between samples)."""
    t = np.mod(np.asarray(t_s, float), period_s)
    k = np.minimum((t / period_s * bins).astype(np.int64), bins - 1)
    tot = np.bincount(k, weights=np.asarray(power_w, float), minlength=bins)
    cnt = np.bincount(k, minlength=bins)
    out = np.full(bins, np.nan)
    out[cnt > 0] = tot[cnt > 0] / cnt[cnt > 0]
    if np.isnan(out).all():
        raise ConfigError("no power samples to fold onto an iteration")
    first = int(np.flatnonzero(~np.isnan(out))[0])
    out = np.roll(out, -first)
    for i in range(1, bins):
        if np.isnan(out[i]):
            out[i] = out[i - 1]
    return np.roll(out, first)
