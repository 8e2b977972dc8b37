"""Cost model: kernel time (s) and energy (J) per op and per pipeline instruction, and its calibration.

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
