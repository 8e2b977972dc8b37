"""Cost model: kernel time (s) and energy (J) per op and per pipeline instruction, and its calibration.

- params.py: free parameters of the kernel model, and the power fields a calibration may override.
- collectives.py: NCCL collective algorithms' bus bandwidth against CTAs and the SM clock.
- kernel.py: kernel time and energy, a roofline per op at an SM clock on a number of SMs.
- overlap.py, partition.py: a nanobatch partition (a compute segment beside a pending collective).
- predict.py: per-stage instruction predictions at each SM clock.
- energy.py: iteration energy of a pipeline (the one formula solver, simulator and report share).
- memory.py: GPU memory of each pipeline stage.
- waveform.py: the job's power waveform over one iteration and its grid metrics.
- profile.py: measured stage profiles in the Perseus CSV format.
- calibration.py: calibration files (``kareus-calibration/1``).
- calibrate.py: the fit to measurements; microbench.py: the microbenchmark kernels it can fit to.
- calibrate_log.py, calibrate_log_data.py: the fit to a training run's own log.
- gpu_validate.py: `kareus validate`'s run on one GPU and its report.

Names are loaded on first use, so ``kareus predict`` without a calibration does not import pydantic.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Calibration": "kareus_megatron.cost.calibration",
    "load_calibration": "kareus_megatron.cost.calibration",
    "save_calibration": "kareus_megatron.cost.calibration",
    "KernelModel": "kareus_megatron.cost.kernel",
    "OpProfile": "kareus_megatron.cost.kernel",
    "OverlapCost": "kareus_megatron.cost.overlap",
    "KernelParams": "kareus_megatron.cost.params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kareus_megatron.cost' has no attribute {name!r}")
