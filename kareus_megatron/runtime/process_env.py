"""Which process and GPU this is: global rank and world size, local rank, the GPU's NVML index and UUID.

The one reader of torchrun's / Megatron launchers' RANK, WORLD_SIZE and LOCAL_RANK for the runtime (a bad value
is a one-line ConfigError), and of which NVML device a CUDA device index is (hardware/device/cuda_map.py); the
current CUDA device's UUID and name for the run log's header.
"""

from __future__ import annotations

import os
import sys

from kareus_megatron.errors import ConfigError


def global_rank_and_world() -> tuple[int, int]:
    """This process's global rank and the world size: torch.distributed's when initialised, else RANK, WORLD_SIZE."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - the runtime always has torch
        pass
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not integers"
        ) from None


def local_rank_from_env() -> int:
    """LOCAL_RANK (torchrun, Megatron launchers) or 0."""
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK={raw!r} is not an integer") from None


def gpu_target(local_index: int, backend: str) -> tuple[int, str | None]:
    """(NVML index, UUID or None) of CUDA device `local_index` (cuda_map.py); a simulated GPU: (index, None)."""
    if backend == "simulated":
        return local_index, None
    from kareus_megatron.hardware.device.cuda_map import cuda_nvml_target

    target = cuda_nvml_target(local_index)
    return target.index, target.uuid


def cuda_device_identity() -> dict[str, str]:
    """``gpu_uuid`` and ``gpu_name`` of this process's current CUDA device, or {} when CUDA is not initialised.

    Never initialises CUDA (that would make a context on device 0 of every rank); torch prints the UUID
    without NVML's ``GPU-`` prefix, which is added so the header matches ``nvidia-smi -L``.
    """
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return {}
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
    except Exception:  # a CPU build, a broken driver: the header just lacks them
        return {}
    out = {"gpu_name": str(props.name)}
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        out["gpu_uuid"] = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    return out
