"""NVML backend: a real NVIDIA GPU through nvidia-ml-py (module ``pynvml``).

Driver units are converted here, once: the energy counter is read in mJ and reported in J; clocks are
MHz on both sides. NVML errors become our own errors (ClockControlError, DeviceUnavailableError) with
the fix in the message. Locking clocks needs root or CAP_SYS_ADMIN. The device is opened by UUID when
the caller knows the CUDA device's (cuda_map.py), since NVML's index order is not CUDA's. Supported SM
clocks are asked at the highest supported memory clock: at the current one, a GDDR board idling in a
low memory P-state lists few clocks or none (NVML_ERROR_NOT_FOUND). ``reset_clocks`` resets only a lock
made through this object; a read-only device records set/reset and applies neither (base.py).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

from kareus_megatron.errors import ClockControlError, ConfigError, DeviceUnavailableError, UnknownPresetError
from kareus_megatron.hardware.device.base import OwnedLocks

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
    if code == pynvml.NVML_ERROR_NOT_FOUND:
        return DeviceUnavailableError(
            f"{what}: NVML found nothing (NVML_ERROR_NOT_FOUND): the GPU UUID or index is not on this node, "
            "or it lists no clocks at that memory clock; check `kareus env` and CUDA_VISIBLE_DEVICES"
        )
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


def supported_graphics_clocks_mhz(pynvml: Any, handle: Any) -> tuple[int, ...]:
    """SM clocks (MHz) lockable at the highest supported memory clock, highest first (falls back to the
    current memory clock when the memory clocks cannot be listed)."""
    try:
        mem_mhz = max(int(c) for c in pynvml.nvmlDeviceGetSupportedMemoryClocks(handle))
    except (pynvml.NVMLError, ValueError):  # ValueError: an empty list
        mem_mhz = int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM))
    return tuple(sorted({int(c) for c in pynvml.nvmlDeviceGetSupportedGraphicsClocks(handle, mem_mhz)}, reverse=True))


def _handle_by_uuid(pynvml: Any, uuid: str) -> Any:
    """The handle of the GPU whose UUID is `uuid` or, as CUDA_VISIBLE_DEVICES allows, starts with it."""
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError as e:
        if _error_code(e) != pynvml.NVML_ERROR_NOT_FOUND:
            raise
    matches = []
    for i in range(int(pynvml.nvmlDeviceGetCount())):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        if str(pynvml.nvmlDeviceGetUUID(h)).upper().startswith(uuid.upper()):
            matches.append(h)
    if len(matches) != 1:
        raise DeviceUnavailableError(f"NVML has {len(matches)} GPUs whose UUID starts with {uuid!r}; "
                                     "need exactly one (check CUDA_VISIBLE_DEVICES and `nvidia-smi -L`)")
    return matches[0]


def _refuse_mig(pynvml: Any, handle: Any, what: str) -> None:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError, AttributeError, TypeError):
        return  # pre-Ampere GPUs and old drivers: no MIG
    if int(current) == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1):
        raise ConfigError(f"{what} has MIG mode on; MIG instances share the GPU's SM clock, so clocks cannot be "
                          "planned per process; turn MIG off (`nvidia-smi -mig 0`) or use another GPU")


class NVMLGPU(OwnedLocks):
    """A local NVIDIA GPU controlled through NVML. Units: MHz, J, °C."""

    def __init__(self, index: int, gpu: str | None = None, *, uuid: str | None = None,
                 read_only: bool = False) -> None:
        """Open GPU `uuid` when given (``GPU-...``, or a prefix of one), else NVML index `index`; `gpu` names
        the preset to use instead of looking it up by device name; `read_only`: see base.py."""
        from kareus_megatron.hardware.gpus import gpu_spec, gpu_spec_for_device_name

        self._nvml = pynvml = _pynvml()
        self.index = index
        self.uuid = uuid
        self._read_only = bool(read_only)
        self._locked = False  # a lock went through this object and was not reset
        self.recorded: list[tuple[str, int | None]] = []
        self._would_lock = False  # read-only: a recorded set not followed by a recorded reset
        self._limit0_mw: int | None = None  # power limit (mW) before this object's first change (-1: recorded)
        self._open = False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise translate_nvml_error(e, "initialising NVML") from e
        self._open = True
        try:
            self._handle = _handle_by_uuid(pynvml, uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(index)
            _refuse_mig(pynvml, self._handle, f"GPU {uuid or index}")
            self.device_name = str(pynvml.nvmlDeviceGetName(self._handle))
            spec = gpu_spec(gpu) if gpu else gpu_spec_for_device_name(self.device_name)
            if spec is None:
                raise UnknownPresetError(
                    f"GPU {index} is {self.device_name!r}, which no preset in hardware/gpus.toml lists; "
                    "add its name to a preset's device_names or name the preset with --gpu / KAREUS_GPU"
                )
            self.spec: GPUSpec = spec
            self._supported = supported_graphics_clocks_mhz(pynvml, self._handle)
            if not self._supported:
                raise DeviceUnavailableError(f"GPU {uuid or index} ({self.device_name}) lists no lockable SM clocks")
            self._energy0_mj = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except pynvml.NVMLError as e:
            self._shutdown()
            raise translate_nvml_error(e, f"opening GPU {uuid or index}") from e
        except BaseException:
            self._shutdown()
            raise

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        self._check_open()
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
        if self._read_only:
            self._check_open()
            self.recorded.append(("set", int(mhz)))
            self._would_lock = True
            return
        self._call(f"locking GPU {self.index} to {mhz} MHz", self._nvml.nvmlDeviceSetGpuLockedClocks, mhz, mhz)
        self._locked = True

    def sm_clock_mhz(self) -> int:
        """Current SM clock (MHz) as reported by NVML."""
        return int(self._call("reading the SM clock", self._nvml.nvmlDeviceGetClockInfo, self._nvml.NVML_CLOCK_SM))

    def reset_clocks(self) -> None:
        """Remove this object's SM clock lock (nvmlDeviceResetGpuLockedClocks); no-op if it locked nothing."""
        if self._read_only:
            self._check_open()
            if self._would_lock:  # as a real reset: only a lock this object (would have) made
                self.recorded.append(("reset", None))
                self._would_lock = False
            return
        if not self._locked:
            return
        self._call(f"resetting GPU {self.index} clocks", self._nvml.nvmlDeviceResetGpuLockedClocks)
        self._locked = False

    def check_clock_permission(self) -> None:
        """Raise ClockControlError unless SM clocks may be locked: without root or CAP_SYS_ADMIN nothing is
        touched; otherwise the highest supported clock is locked and that lock reset (read-only: nothing)."""
        self._check_open()
        if self._read_only:
            return
        if may_administer() is False:
            raise ClockControlError(f"locking GPU {self.index} clocks: not root and no CAP_SYS_ADMIN; "
                                    f"{_PERMISSION_FIX}")
        self.set_sm_clock_mhz(self._supported[0])
        self.reset_clocks()

    def nvml_uuid(self) -> str:
        """The UUID NVML reports for the handle held (not the one asked for)."""
        return str(self._call("reading the UUID", self._nvml.nvmlDeviceGetUUID))

    def temperature_c(self) -> float:
        """GPU core temperature (°C) from NVML's GPU sensor."""
        return float(self._call("reading the temperature", self._nvml.nvmlDeviceGetTemperature,
                                self._nvml.NVML_TEMPERATURE_GPU))

    def _check_open(self) -> None:
        if not self._open:
            raise DeviceUnavailableError(f"GPU {self.index} is closed")

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """SM clocks (MHz) lockable at the highest supported memory clock, highest first."""
        return self._supported

    def energy_j(self) -> float:
        """GPU energy (J) since open, from NVML's total-energy counter (mJ)."""
        mj = int(self._call("reading the energy counter", self._nvml.nvmlDeviceGetTotalEnergyConsumption))
        return (mj - self._energy0_mj) / 1000.0

    # -- board power limit (NVML works in mW; W here) -----------------------------------------
    def power_limit_w(self) -> float:
        """Board power limit (W) in force (nvmlDeviceGetPowerManagementLimit, mW)."""
        return int(self._call("reading the power limit", self._nvml.nvmlDeviceGetPowerManagementLimit)) / 1000.0

    def power_limit_range_w(self) -> tuple[float, float]:
        """(min, max) power limit (W) the driver accepts (nvmlDeviceGetPowerManagementLimitConstraints, mW)."""
        lo, hi = self._call("reading the power limit range", self._nvml.nvmlDeviceGetPowerManagementLimitConstraints)
        return int(lo) / 1000.0, int(hi) / 1000.0

    def set_power_limit_w(self, watts: float) -> None:
        """Set the board power limit to `watts` (W) (nvmlDeviceSetPowerManagementLimit); read-only: record it.

        The limit in force before this object's first change is kept for ``reset_power_limit``."""
        lo, hi = self.power_limit_range_w()
        if not lo <= watts <= hi:
            raise ClockControlError(f"GPU {self.index} ({self.device_name}) cannot take a power limit of "
                                    f"{watts:g} W; allowed: {lo:g}..{hi:g} W (nvidia-smi -q -d POWER)")
        if self._read_only:
            self.recorded.append(("power_limit", int(round(watts))))
            self._limit0_mw = self._limit0_mw or -1  # a recorded change: its reset is recorded too
            return
        if self._limit0_mw is None:
            self._limit0_mw = int(self._call("reading the power limit", self._nvml.nvmlDeviceGetPowerManagementLimit))
        self._call(f"setting GPU {self.index}'s power limit to {watts:g} W",
                   self._nvml.nvmlDeviceSetPowerManagementLimit, int(round(watts * 1000)))

    def reset_power_limit(self) -> None:
        """Restore the power limit found before this object's first change; no-op if it changed nothing."""
        limit0 = self._limit0_mw
        if limit0 is None:
            return
        if self._read_only:
            self.recorded.append(("power_limit_reset", None))
        else:
            self._call(f"restoring GPU {self.index}'s power limit to {limit0 / 1000:g} W",
                       self._nvml.nvmlDeviceSetPowerManagementLimit, limit0)
        self._limit0_mw = None

    def _shutdown(self) -> None:
        if self._open:
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    def close(self) -> None:
        """Reset a clock lock and a power limit this object set (best effort) and shut NVML down."""
        if not self._open:
            return
        for restore in (self.reset_clocks, self.reset_power_limit):
            try:
                restore()
            except Exception:
                pass
        self._shutdown()


CAP_SYS_ADMIN = 21  # bit of CapEff in /proc/self/status (linux/capability.h)


def may_administer() -> bool | None:
    """Whether this process runs as root or holds CAP_SYS_ADMIN (what locking clocks needs); None when
    neither can be read (not Linux). Changes nothing."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_clock_permission(pynvml: Any, handle: Any, sm_now_mhz: int, supported: list[int]) -> dict[str, Any]:
    """Whether this user may lock SM clocks: without root or CAP_SYS_ADMIN the answer is no and nothing is
    touched (NVML has no query for it); otherwise lock the supported clock nearest the current one and
    reset that lock at once (the reset also ends a lock an administrator set: this is the one place that
    can, and only on request)."""
    if may_administer() is False:
        return {"clock_permission": False, "permission_method": "capability",
                "permission_error": f"not root and no CAP_SYS_ADMIN; {_PERMISSION_FIX}"}
    if not supported:
        return {"clock_permission": False, "permission_method": "lock",
                "permission_error": "the GPU lists no lockable SM clocks"}
    mhz = min(supported, key=lambda c: (abs(c - sm_now_mhz), -c))
    try:
        pynvml.nvmlDeviceSetGpuLockedClocks(handle, mhz, mhz)
    except pynvml.NVMLError as e:
        return {"clock_permission": False, "permission_method": "lock",
                "permission_error": str(translate_nvml_error(e, f"locking {mhz} MHz"))}
    try:
        pynvml.nvmlDeviceResetGpuLockedClocks(handle)
    except pynvml.NVMLError as e:
        return {"clock_permission": False, "permission_method": "lock",
                "permission_error": str(translate_nvml_error(e, "resetting the lock just made"))}
    return {"clock_permission": True, "permission_method": "lock"}


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
        clocks = list(supported_graphics_clocks_mhz(pynvml, h))
        sm_now = int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
        out.update(index=index, name=name, preset=spec.name if spec else None, memory_clock_mhz=mem,
                   supported_sm_clocks_mhz=clocks, sm_clock_mhz=sm_now)
        try:
            out["uuid"] = str(pynvml.nvmlDeviceGetUUID(h))
            out["temperature_c"] = float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
        except pynvml.NVMLError:
            pass
        try:
            out["energy_counter_mj"] = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        except pynvml.NVMLError as e:
            out["energy_counter_mj"] = None
            out["energy_error"] = str(translate_nvml_error(e, "reading the energy counter"))
        if check_permission:
            out.update(check_clock_permission(pynvml, h, sm_now, clocks))
    except pynvml.NVMLError as e:
        out["error"] = str(translate_nvml_error(e, f"querying GPU {index}"))
    finally:
        pynvml.nvmlShutdown()
    return out
