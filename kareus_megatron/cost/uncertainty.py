"""Parameter uncertainty of the cost model: seeded draws of its parameters, for the planner's error bars.

Each uncertain parameter is drawn lognormally around the model's value (its median), with a sd of log:

- presets (no calibration, or one without a posterior): the stated prior of its class, PRESET_LOG_SD
  (docs/sources.md#prediction-bands);
- a run-log calibration (`kareus calibrate --from-log`): the fit's posterior sd of that parameter, sd / value
  (the delta method), its correlations where the fit recorded them (``fit.correlation``); parameters the fit
  did not free keep their class's prior.

Efficiencies stay at or below 1 (a draw above is clipped). Draws are reproducible: one seed, one order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.params import GPU_PARAM_NAMES, with_gpu_params
from kareus_megatron.errors import ConfigError
from kareus_megatron.vocab import BAND_DRAWS, BAND_PERCENTILES

DEFAULT_DRAWS: Final = BAND_DRAWS  # parameter draws per planning run (kareus plan --band-samples)
DEFAULT_SEED: Final = 0

# sd of log(value) of every parameter of a class, presets only (docs/sources.md#prediction-bands)
PRESET_LOG_SD: Final[Mapping[str, float]] = {
    "compute efficiency": 0.08,
    "memory": 0.08,
    "links": 0.10,
    "latency": 0.30,
    "time level": 0.05,
    "power": 0.20,
    "activity": 0.15,
    "blocked power": 0.20,
}
PARAM_CLASS: Final[Mapping[str, str]] = {
    "gemm_efficiency": "compute efficiency",
    "attention_efficiency": "compute efficiency",
    "attention_bwd_efficiency": "compute efficiency",
    "memory_efficiency": "memory",
    "sm_load_bytes_per_cycle": "memory",
    "nvlink_efficiency": "links",
    "network_efficiency": "links",
    "comm_sm_bytes_per_cycle": "links",
    "launch_overhead_s": "latency",
    "nvlink_latency_s": "latency",
    "network_latency_s": "latency",
    "time_scale": "time level",
    "static_power_w": "power",
    "idle_dynamic_w": "power",
    "compute_dynamic_w": "power",
    "memory_dynamic_w": "power",
    "comm_compute_activity": "activity",
    "attention_activity": "activity",
    "memory_op_compute_activity": "activity",
    "p_blocked_w": "blocked power",
}
_CAPPED_AT_ONE: Final = (
    "gemm_efficiency",
    "attention_efficiency",
    "attention_bwd_efficiency",
    "memory_efficiency",
    "nvlink_efficiency",
    "network_efficiency",
    "memory_op_compute_activity",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamPrior:
    """The sd of log of each uncertain parameter, their correlation, and where each sd came from."""

    names: tuple[str, ...]
    log_sd: np.ndarray  # (k,)
    correlation: np.ndarray  # (k, k)
    source: tuple[str, ...]  # per parameter: "prior: <class>" or "posterior"

    @property
    def calibrated(self) -> bool:
        """True when at least one sd is a calibration's posterior."""
        return any(s == "posterior" for s in self.source)


def _value(kernel: KernelModel, name: str) -> float:
    return float(getattr(kernel.gpu, name) if name in GPU_PARAM_NAMES else getattr(kernel.params, name))


def parameter_prior(kernel: KernelModel) -> ParamPrior:
    """The uncertainty of `kernel`'s parameters: its calibration's posterior where it has one, else the presets'."""
    names = tuple(PARAM_CLASS)
    log_sd = np.array([PRESET_LOG_SD[PARAM_CLASS[n]] for n in names])
    source = [f"prior: {PARAM_CLASS[n]}" for n in names]
    corr = np.eye(len(names))
    fit: Mapping[str, Any] = kernel.calibration.fit if kernel.calibration is not None else {}
    post: Mapping[str, Any] = fit["parameters"] if isinstance(fit.get("parameters"), Mapping) else {}
    for name, entry in post.items():
        if name not in names or not isinstance(entry, Mapping) or not isinstance(entry.get("sd"), (int, float)):
            continue
        value = _value(kernel, name)
        sd = float(entry["sd"])
        if value > 0 and np.isfinite(sd) and sd >= 0:
            i = names.index(name)
            log_sd[i], source[i] = sd / value, "posterior"
    rec = fit.get("correlation")
    if isinstance(rec, Mapping) and isinstance(rec.get("names"), list):
        m = np.asarray(rec.get("matrix"), dtype=float)
        for a, na in enumerate(rec["names"]):
            for b, nb in enumerate(rec["names"]):
                if na in names and nb in names and na != nb and np.isfinite(m[a, b]):
                    corr[names.index(na), names.index(nb)] = m[a, b]
    return ParamPrior(names=names, log_sd=log_sd, correlation=corr, source=tuple(source))


def draw_log_factors(prior: ParamPrior, n: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """(n, k) draws of log(parameter / value), correlated as `prior` says; seeded, reproducible."""
    if n < 2:
        raise ConfigError(f"--band-samples {n}: need at least 2 parameter draws (or 0 for no bands).")
    cov = prior.correlation * np.outer(prior.log_sd, prior.log_sd)
    w, v = np.linalg.eigh(cov)  # a factor of the covariance that tolerates a rank-deficient posterior
    root = v * np.sqrt(np.clip(w, 0.0, None))
    z = np.random.default_rng(seed).standard_normal((n, len(prior.names)))
    return z @ root.T


def kernel_draw(kernel: KernelModel, names: Sequence[str], log_factor: np.ndarray) -> KernelModel:
    """`kernel` with each parameter of `names` multiplied by exp(log_factor) (efficiencies at most 1)."""
    gpu_vals: dict[str, float] = {}
    kern_vals: dict[str, Any] = {}
    for name, lf in zip(names, log_factor):
        v = _value(kernel, name) * float(np.exp(lf))
        if name in _CAPPED_AT_ONE:
            v = min(v, 1.0)
        (gpu_vals if name in GPU_PARAM_NAMES else kern_vals)[name] = v
    gpu = with_gpu_params(kernel.gpu, gpu_vals)
    return KernelModel.from_params(gpu, dataclasses.replace(kernel.params, **kern_vals))


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelDraws:
    """Cost models with drawn parameters, the uncertainty they were drawn from and the seed."""

    kernels: tuple[KernelModel, ...]
    prior: ParamPrior
    seed: int

    def record(self) -> dict[str, Any]:
        """What a frontier document says of its bands: draws, seed, percentiles, each parameter's sd of log."""
        return {
            "draws": len(self.kernels),
            "seed": self.seed,
            "percentiles": list(BAND_PERCENTILES),
            "parameters": {
                n: {"log_sd": float(sd), "source": src}
                for n, sd, src in zip(self.prior.names, self.prior.log_sd, self.prior.source)
            },
        }


def kernel_draws(kernel: KernelModel, n: int = DEFAULT_DRAWS, seed: int = DEFAULT_SEED) -> KernelDraws:
    """`n` cost models with parameters drawn from `kernel`'s uncertainty (parameter_prior); seeded."""
    prior = parameter_prior(kernel)
    kernels = tuple(kernel_draw(kernel, prior.names, row) for row in draw_log_factors(prior, n, seed))
    return KernelDraws(kernels=kernels, prior=prior, seed=seed)
