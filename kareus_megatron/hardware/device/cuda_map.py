"""Which NVML device a CUDA device is: the one mapping used by the runtime, calibrate --run and benchmarks.

NVML numbers GPUs by PCI bus id and ignores CUDA_VISIBLE_DEVICES; CUDA numbers them fastest-first unless
CUDA_DEVICE_ORDER=PCI_BUS_ID and only among the visible ones (NVML docs, "nvmlDeviceGetHandleByIndex";
CUDA C Programming Guide, "CUDA Environment Variables"). So ``cuda:N`` is found in NVML by its UUID:
the CUDA device's own UUID where torch reports one (``torch.cuda.get_device_properties(N).uuid``, no
``GPU-`` prefix), else the N-th CUDA_VISIBLE_DEVICES entry (an integer NVML index or a ``GPU-`` UUID,
possibly a prefix), else NVML index N. MIG instances are refused: SM clocks belong to the whole GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kareus_megatron.errors import ConfigError

_MIG_FIX = "MIG instances share the GPU's SM clock; run on a whole GPU (MIG mode off) to control clocks"


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmlTarget:
    """The NVML device of one CUDA device: `uuid` (``GPU-...``, maybe a prefix) when known, else `index`."""

    cuda_index: int
    index: int  # the NVML index to use when `uuid` is None (and what logs show)
    uuid: str | None = None


def _normalised_uuid(raw: str) -> str:
    u = raw.strip()
    if u.upper().startswith("MIG-"):
        raise ConfigError(f"CUDA device is a MIG instance ({u}); {_MIG_FIX}")
    return u if u.upper().startswith("GPU-") else f"GPU-{u}"


def nvml_target(cuda_index: int, *, cuda_uuid: str | None = None, visible: str | None = None) -> NvmlTarget:
    """The NVML device of CUDA device `cuda_index`: by `cuda_uuid` (torch's, with or without ``GPU-``)
    when given, else by `visible` (CUDA_VISIBLE_DEVICES when None), else NVML index `cuda_index`."""
    if cuda_index < 0:
        raise ConfigError(f"CUDA device index {cuda_index} is negative")
    raw = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if raw and "MIG-" in raw.upper():
        raise ConfigError(f"CUDA_VISIBLE_DEVICES={raw!r} selects MIG instances; {_MIG_FIX}")
    if cuda_uuid:
        return NvmlTarget(cuda_index=cuda_index, index=cuda_index, uuid=_normalised_uuid(cuda_uuid))
    if raw is None or not raw.strip():
        return NvmlTarget(cuda_index=cuda_index, index=cuda_index)
    entries = [e.strip() for e in raw.split(",")]
    # CUDA stops at the first entry it cannot parse: what comes after is not visible.
    usable = []
    for e in entries:
        if not e or e.startswith("-"):
            break
        usable.append(e)
    if cuda_index >= len(usable):
        raise ConfigError(
            f"CUDA device {cuda_index} is not among CUDA_VISIBLE_DEVICES={raw!r} "
            f"({len(usable)} visible); set LOCAL_RANK / the device index accordingly"
        )
    entry = usable[cuda_index]
    if entry.isdigit():
        return NvmlTarget(cuda_index=cuda_index, index=int(entry))
    return NvmlTarget(cuda_index=cuda_index, index=cuda_index, uuid=_normalised_uuid(entry))


def torch_cuda_uuid(cuda_index: int) -> str | None:
    """The UUID torch reports for ``cuda:<cuda_index>`` (no ``GPU-`` prefix), or None without torch/CUDA
    or on a torch too old to report it. Imports torch lazily: only runtime-side callers use it."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    except (RuntimeError, AssertionError, ValueError):
        return None
    return str(uuid) if uuid else None


def cuda_nvml_target(cuda_index: int) -> NvmlTarget:
    """``nvml_target`` for ``cuda:<cuda_index>`` of this process (torch's UUID when it reports one)."""
    return nvml_target(cuda_index, cuda_uuid=torch_cuda_uuid(cuda_index))
