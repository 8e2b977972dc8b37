"""Which process and GPU this is: global rank and world size, local rank, the GPU's NVML index and UUID.

The one reader of torchrun's / Megatron launchers' RANK, WORLD_SIZE and LOCAL_RANK for the runtime (a bad value
is a one-line ConfigError), and of which NVML device a CUDA device index is (hardware/device/cuda_map.py).
"""

from __future__ import annotations

import os

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
