"""Calibration files: fitted model parameters for one GPU, versioned JSON ("kareus-calibration/1").

A calibration holds parameter values that replace the defaults of cost/params.py (kernel model) and
the power-model fields of the GPU preset, the fit report (error per column), and where the data came
from. Load with ``load_calibration``; ``Calibration.sha256`` identifies it (plans record it).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kareus_megatron.cost.params import GPU_PARAM_NAMES, KERNEL_PARAM_NAMES, PARAM_NAMES, with_gpu_params
from kareus_megatron.errors import CalibrationError, describe_validation_error
from kareus_megatron.files import read_input_text
from kareus_megatron.hardware.gpus import GPUSpec

FORMAT: Final = "kareus-calibration/1"


class Calibration(BaseModel):
    """Fitted parameters for one GPU preset plus the fit report and the data source."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["kareus-calibration/1"] = FORMAT
    gpu: str = Field(min_length=1)
    params: dict[str, float]
    fit: dict[str, Any] = Field(default_factory=dict)
    source: str = ""
    workload: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _known_finite(cls, v: dict[str, float]) -> dict[str, float]:
        for key, value in v.items():
            if key not in PARAM_NAMES:
                raise ValueError(f"unknown parameter {key!r}; allowed: {', '.join(PARAM_NAMES)}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"parameter {key} = {value!r} must be finite and >= 0")
        return v

    @property
    def kernel_params(self) -> dict[str, float]:
        """Overrides of cost.params.KernelParams."""
        return {k: v for k, v in self.params.items() if k in KERNEL_PARAM_NAMES}

    @property
    def gpu_params(self) -> dict[str, float]:
        """Overrides of the GPU preset's power-model fields."""
        return {k: v for k, v in self.params.items() if k in GPU_PARAM_NAMES}

    def apply_to(self, gpu: GPUSpec) -> GPUSpec:
        """The preset with this calibration's power-model fields (for hardware/power.py and the simulator)."""
        if gpu.name != self.gpu:
            raise CalibrationError(
                f"calibration was fitted for {self.gpu!r}, not {gpu.name!r}; use --gpu {self.gpu} "
                f"or calibrate {gpu.name} with `kareus calibrate`."
            )
        return with_gpu_params(gpu, self.gpu_params)

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, 2-space indent, trailing newline)."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"

    @property
    def sha256(self) -> str:
        """SHA-256 (hex) of the canonical JSON text."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def calibration_from_dict(data: Any, what: str = "calibration") -> Calibration:
    """Validate a parsed calibration document; CalibrationError names the first problem."""
    if not isinstance(data, dict):
        raise CalibrationError(f"{what} must be a JSON object, not {type(data).__name__}.")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise CalibrationError(
            f"{what} has format {fmt!r}; this build reads {FORMAT!r}. Regenerate it with `kareus calibrate`."
        )
    try:
        return Calibration.model_validate(data)
    except ValidationError as e:
        raise CalibrationError(
            f"{what} is invalid ({describe_validation_error(e, limit=1)}); regenerate it with `kareus calibrate`."
        ) from e


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration JSON file; CalibrationError on a missing, unreadable or invalid file."""
    p = Path(path)
    text = read_input_text(
        p, CalibrationError, "calibration file", not_text_fix="give a calibration JSON file from `kareus calibrate`"
    )
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CalibrationError(f"calibration file {str(p)!r} is not JSON ({e}); regenerate it.") from e
    return calibration_from_dict(data, f"calibration file {str(p)!r}")


def save_calibration(cal: Calibration, path: str | Path) -> None:
    """Write the calibration atomically (temporary file, then rename)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_text(cal.to_json(), encoding="utf-8")
        tmp.replace(p)
    finally:
        tmp.unlink(missing_ok=True)  # gone already after the rename; never left behind on an error


def shipped_calibration_path(name: str) -> Path:
    """Path of a calibration file shipped in kareus_megatron/data (e.g. "a100-sxm4-80gb.perseus")."""
    from importlib import resources

    return Path(str(resources.files("kareus_megatron").joinpath("data", f"{name}.calib.json")))
