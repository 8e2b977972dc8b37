"""NVML backend: a real NVIDIA GPU through nvidia-ml-py (module ``pynvml``).

Driver units are converted here, once: the energy counter is read in mJ and reported in J; clocks are
MHz on both sides. NVML errors become our own errors (ClockControlError, DeviceUnavailableError) with
the fix in the message. Locking clocks needs root or CAP_SYS_ADMIN.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kareus_megatron.errors import ClockControlError, DeviceUnavailableError, UnknownPresetError

if TYPE_CHECKING:
    from kareus_megatron.hardware.gpus import GPUSpec

_NO_NVML_FIX = "To run without an NVIDIA GPU, set KAREUS_GPU_BACKEND=simulated."
_PERMISSION_FIX = (
    "locking SM clocks needs root or CAP_SYS_ADMIN: run the trainer as root, or let an admin run "
    "`sudo nvidia-smi -pm 1` and grant the capability; or pass --kareus-on-error warn to train at "
    "default clocks"
)


def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise DeviceUnavailableError(
            f"nvidia-ml-py is not installed (pip install nvidia-ml-py). {_NO_NVML_FIX}"
        ) from None
    return pynvml


def _error_code(e: Exception) -> int | None:
    return getattr(e, "value", None)


def translate_nvml_error(e: Exception, what: str) -> Exception:
    """Map a pynvml.NVMLError raised while doing `what` to a KareusError with the fix."""
    pynvml = _pynvml()
    code = _error_code(e)
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return ClockControlError(f"{what}: NVML refused (no permission); {_PERMISSION_FIX}")
    if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
        return ClockControlError(
            f"{what}: this GPU or driver does not support it (NVML_ERROR_NOT_SUPPORTED); "
            "locked clocks need a Volta or newer data-center GPU; use --kareus-on-error warn to train "
            "at default clocks"
        )
    if code == pynvml.NVML_ERROR_INVALID_ARGUMENT:
        return ClockControlError(f"{what}: NVML rejected the argument; check `kareus env` for supported clocks")
    if code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
        return DeviceUnavailableError(f"{what}: NVML could not be loaded ({e}). {_NO_NVML_FIX}")
    return DeviceUnavailableError(f"{what}: NVML error {code}: {e}")


@functools.lru_cache(maxsize=1)
def nvml_available() -> bool:
    """True when NVML initialises (driver and library present); cached for the process."""
    try:
        pynvml = _pynvml()
    except DeviceUnavailableError:
        return False
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


class NVMLGPU:
    """A local NVIDIA GPU controlled through NVML. Units: MHz, J."""

    def __init__(self, index: int, gpu: str | None = None) -> None:
        """Open GPU `index`; `gpu` names the preset to use instead of looking it up by device name."""
        from kareus_megatron.hardware.gpus import gpu_spec, gpu_spec_for_device_name

        self._nvml = pynvml = _pynvml()
        self.index = index
        self._open = False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise translate_nvml_error(e, "initialising NVML") from e
        self._open = True
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.device_name = str(pynvml.nvmlDeviceGetName(self._handle))
            spec = gpu_spec(gpu) if gpu else gpu_spec_for_device_name(self.device_name)
            if spec is None:
                raise UnknownPresetError(
                    f"GPU {index} is {self.device_name!r}, which no preset in hardware/gpus.toml lists; "
                    "add its name to a preset's device_names or name the preset with --gpu / KAREUS_GPU"
                )
            self.spec: GPUSpec = spec
            mem_mhz = int(pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_MEM))
            supported = pynvml.nvmlDeviceGetSupportedGraphicsClocks(self._handle, mem_mhz)
            self._supported = tuple(sorted({int(c) for c in supported}, reverse=True))
            self._energy0_mj = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except pynvml.NVMLError as e:
            self._shutdown()
            raise translate_nvml_error(e, f"opening GPU {index}") from e
        except BaseException:
            self._shutdown()
            raise

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        if not self._open:
            raise DeviceUnavailableError(f"GPU {self.index} is closed")
        try:
            return fn(self._handle, *args)
        except self._nvml.NVMLError as e:
            raise translate_nvml_error(e, what) from e

    def set_sm_clock_mhz(self, mhz: int) -> None:
        """Lock the SM clock to `mhz` (MHz) (min = max); return once NVML has applied it."""
        if mhz not in self._supported:
            raise ClockControlError(
                f"GPU {self.index} ({self.device_name}) cannot lock {mhz} MHz; supported: "
                f"{self._supported[-1]}..{self._supported[0]} MHz ({len(self._supported)} clocks)"
            )
        self._call(f"locking GPU {self.index} to {mhz} MHz", self._nvml.nvmlDeviceSetGpuLockedClocks, mhz, mhz)

    def sm_clock_mhz(self) -> int:
        """Current SM clock (MHz) as reported by NVML."""
        return int(self._call("reading the SM clock", self._nvml.nvmlDeviceGetClockInfo, self._nvml.NVML_CLOCK_SM))

    def reset_clocks(self) -> None:
        """Remove the SM clock lock (nvmlDeviceResetGpuLockedClocks)."""
        self._call(f"resetting GPU {self.index} clocks", self._nvml.nvmlDeviceResetGpuLockedClocks)

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """SM clocks (MHz) lockable at the current memory clock, highest first."""
        return self._supported

    def energy_j(self) -> float:
        """GPU energy (J) since open, from NVML's total-energy counter (mJ)."""
        mj = int(self._call("reading the energy counter", self._nvml.nvmlDeviceGetTotalEnergyConsumption))
        return (mj - self._energy0_mj) / 1000.0

    def _shutdown(self) -> None:
        if self._open:
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    def close(self) -> None:
        """Reset clocks (best effort) and shut NVML down for this handle."""
        if not self._open:
            return
        try:
            self.reset_clocks()
        except Exception:
            pass
        self._shutdown()


def nvml_report(index: int = 0, check_permission: bool = False) -> dict[str, Any]:
    """What NVML says about this machine and GPU `index` (driver, name, clocks, energy, permission)."""
    from kareus_megatron.hardware.gpus import gpu_spec_for_device_name

    out: dict[str, Any] = {"nvml": False}
    try:
        pynvml = _pynvml()
    except DeviceUnavailableError as e:
        out["error"] = str(e)
        return out
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        out["error"] = str(translate_nvml_error(e, "initialising NVML"))
        return out
    try:
        out["nvml"] = True
        out["driver_version"] = str(pynvml.nvmlSystemGetDriverVersion())
        out["device_count"] = int(pynvml.nvmlDeviceGetCount())
        if index >= out["device_count"]:
            out["error"] = f"GPU index {index} is out of range (0..{out['device_count'] - 1})"
            return out
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = str(pynvml.nvmlDeviceGetName(h))
        spec = gpu_spec_for_device_name(name)
        mem = int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM))
        clocks = sorted({int(c) for c in pynvml.nvmlDeviceGetSupportedGraphicsClocks(h, mem)}, reverse=True)
        out.update(index=index, name=name, preset=spec.name if spec else None, memory_clock_mhz=mem,
                   supported_sm_clocks_mhz=clocks,
                   sm_clock_mhz=int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)))
        try:
            out["energy_counter_mj"] = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        except pynvml.NVMLError as e:
            out["energy_counter_mj"] = None
            out["energy_error"] = str(translate_nvml_error(e, "reading the energy counter"))
        if check_permission:
            try:
                pynvml.nvmlDeviceResetGpuLockedClocks(h)
                out["clock_permission"] = True
            except pynvml.NVMLError as e:
                out["clock_permission"] = False
                out["permission_error"] = str(translate_nvml_error(e, "resetting locked clocks"))
    except pynvml.NVMLError as e:
        out["error"] = str(translate_nvml_error(e, f"querying GPU {index}"))
    finally:
        pynvml.nvmlShutdown()
    return out
