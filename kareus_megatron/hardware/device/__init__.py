"""GPU devices: one contract (``GPUDevice``), two backends chosen at run time.

``KAREUS_GPU_BACKEND=nvml|simulated`` picks the backend (default: nvml when NVML initialises). Asking
for nvml where it is missing is an error naming the fix; there is no silent fallback to the simulator.
The simulated GPU's preset comes from ``gpu=`` or ``KAREUS_GPU`` (default a100-sxm4-40gb). ``read_only=True``
or KAREUS_GPU_READ_ONLY=1 (which wins over any argument) opens a device that reads real values but never
changes a GPU setting (base.py; on NVML every change goes through nvml_access.change_setting, which refuses).
``open_cuda_gpu`` opens the NVML device of a CUDA device (cuda_map.py: by UUID). What only the
simulated GPU can do (``SimulationHooks``) is handed out by ``simulation_of``: the runtime passes that
object on explicitly and treats every device as a plain ``GPUDevice`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import ConfigError, DeviceUnavailableError
from kareus_megatron.hardware.device.base import (
    BACKENDS,
    READ_ONLY_ENV,
    GPUDevice,
    SimulationHooks,
    nearest_supported_mhz,
    read_only_from_env,
)

DEFAULT_SIMULATED_GPU = "a100-sxm4-40gb"

__all__ = [
    "BACKENDS",
    "READ_ONLY_ENV",
    "GPUDevice",
    "SimulationHooks",
    "backend_from_env",
    "dry_run_backend",
    "nearest_supported_mhz",
    "open_cuda_gpu",
    "open_gpu",
    "read_only_from_env",
    "simulation_of",
]


def backend_from_env(backend: str | None = None) -> str:
    """The backend to use: `backend`, else KAREUS_GPU_BACKEND, else nvml when available."""
    name = backend or kareus_settings().gpu_backend or ""
    if name:
        if name not in BACKENDS:
            raise ConfigError(f"KAREUS_GPU_BACKEND={name!r} is not a backend; use one of {', '.join(BACKENDS)}")
        return name
    from kareus_megatron.hardware.device.nvml import nvml_available

    if nvml_available():
        return "nvml"
    raise DeviceUnavailableError(
        "NVML could not be initialised (no NVIDIA driver or nvidia-ml-py). "
        "To run without a GPU, set KAREUS_GPU_BACKEND=simulated."
    )


def dry_run_backend() -> str:
    """The backend of a command's ``--dry-run`` (tiny CPU kernels): simulated, unless KAREUS_GPU_BACKEND=nvml
    asks for the real NVML device's reads beside CPU kernels (how the read-only tests drive the NVML paths)."""
    return "nvml" if kareus_settings().gpu_backend == "nvml" else "simulated"


def open_gpu(
    index: int,
    backend: str | None = None,
    gpu: str | None = None,
    read_only: bool | None = None,
    *,
    uuid: str | None = None,
) -> GPUDevice:
    """Open local GPU `index` (NVML's index; `uuid`, when given, picks the NVML device instead) on
    `backend` (see module doc); `gpu` names a preset in hardware/gpus; `read_only` None reads
    KAREUS_GPU_READ_ONLY."""
    name = backend_from_env(backend)
    ro = read_only_from_env(read_only)
    if name == "simulated":
        from kareus_megatron.hardware.device.sim import SimulatedGPU
        from kareus_megatron.hardware.gpus import gpu_spec

        return SimulatedGPU(gpu_spec(gpu or kareus_settings().gpu or DEFAULT_SIMULATED_GPU), index, read_only=ro)
    from kareus_megatron.hardware.device.nvml import NVMLGPU, nvml_available

    if not nvml_available():
        raise DeviceUnavailableError(
            "KAREUS_GPU_BACKEND=nvml but NVML could not be initialised (is the NVIDIA driver loaded?). "
            "To run without a GPU, set KAREUS_GPU_BACKEND=simulated."
        )
    return NVMLGPU(index, gpu=gpu or kareus_settings().gpu or None, uuid=uuid, read_only=ro)


def open_cuda_gpu(
    cuda_index: int, backend: str | None = None, gpu: str | None = None, read_only: bool | None = None
) -> GPUDevice:
    """Open the GPU that is ``cuda:<cuda_index>`` in this process (by its UUID on NVML; cuda_map.py)."""
    from kareus_megatron.hardware.device.cuda_map import cuda_nvml_target

    if backend_from_env(backend) == "simulated":
        return open_gpu(cuda_index, backend="simulated", gpu=gpu, read_only=read_only)
    target = cuda_nvml_target(cuda_index)
    return open_gpu(target.index, backend="nvml", gpu=gpu, read_only=read_only, uuid=target.uuid)


def simulation_of(device: GPUDevice) -> SimulationHooks | None:
    """The simulated capabilities of `device`: the device itself on the simulated backend, None on NVML."""
    from kareus_megatron.hardware.device.sim import SimulatedGPU

    return device if isinstance(device, SimulatedGPU) else None


def power_reader_of(device: GPUDevice) -> tuple[Callable[[], float], str] | None:
    """(read the board power W now, which reading it is: vocab.POWER_READING_*) of an NVML GPU; None for a
    simulated one (its power model is sampled on the clock controller's time line instead)."""
    from kareus_megatron.hardware.device.nvml import NVMLGPU

    return (device.power_w, device.power_reading) if isinstance(device, NVMLGPU) else None
