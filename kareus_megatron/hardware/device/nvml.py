"""NVML backend: a real NVIDIA GPU through nvidia-ml-py (module ``pynvml``).

Driver units are converted here, once: the energy counter is read in mJ and reported in J; clocks are
MHz on both sides. NVML errors become our own errors (ClockControlError, DeviceUnavailableError) with
the fix in the message. Locking clocks needs root or CAP_SYS_ADMIN. The device is opened by UUID when
the caller knows the CUDA device's (cuda_map.py), since NVML's index order is not CUDA's. Supported SM
clocks are asked at the highest supported memory clock: at the current one, a GDDR board idling in a
low memory P-state lists few clocks or none (NVML_ERROR_NOT_FOUND). ``reset_clocks`` resets only a lock
made through this object; a read-only device records set/reset and applies neither (base.py). Board power
(``power_w``, W from mW) is NVML's instantaneous field (NVML_FI_DEV_POWER_INSTANT, field id 186) where the GPU
answers it, else ``nvmlDeviceGetPowerUsage``, a 1 s average on Ampere and later boards (docs/power.md).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kareus_megatron.errors import ClockControlError, ConfigError, DeviceUnavailableError, UnknownPresetError
from kareus_megatron.hardware.device.base import OwnedLocks
from kareus_megatron.hardware.device.nvml_access import (
    PERMISSION_FIX,
    change_setting,
    error_code,
    may_administer,
    nvml_module,
    translate_nvml_error,
)
from kareus_megatron.vocab import POWER_READING_AVERAGE_1S, POWER_READING_INSTANT

if TYPE_CHECKING:
    from kareus_megatron.hardware.gpus import GPUSpec

FI_DEV_POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT (nvml.h): instantaneous board power, mW


@functools.lru_cache(maxsize=1)
def nvml_available() -> bool:
    """True when NVML initialises (driver and library present); cached for the process."""
    try:
        pynvml = nvml_module()
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
        if error_code(e) != pynvml.NVML_ERROR_NOT_FOUND:
            raise
    matches = []
    for i in range(int(pynvml.nvmlDeviceGetCount())):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        if str(pynvml.nvmlDeviceGetUUID(h)).upper().startswith(uuid.upper()):
            matches.append(h)
    if len(matches) != 1:
        raise DeviceUnavailableError(
            f"NVML has {len(matches)} GPUs whose UUID starts with {uuid!r}; "
            "need exactly one (check CUDA_VISIBLE_DEVICES and `nvidia-smi -L`)"
        )
    return matches[0]


def _refuse_mig(pynvml: Any, handle: Any, what: str) -> None:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError, AttributeError, TypeError):
        return  # pre-Ampere GPUs and old drivers: no MIG
    if int(current) == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1):
        raise ConfigError(
            f"{what} has MIG mode on; MIG instances share the GPU's SM clock, so clocks cannot be "
            "planned per process; turn MIG off (`nvidia-smi -mig 0`) or use another GPU"
        )


class NVMLGPU(OwnedLocks):
    """A local NVIDIA GPU controlled through NVML. Units: MHz, J, °C."""

    def __init__(self, index: int, gpu: str | None = None, *, uuid: str | None = None, read_only: bool = False) -> None:
        """Open GPU `uuid` when given (``GPU-...``, or a prefix of one), else NVML index `index`; `gpu` names
        the preset to use instead of looking it up by device name; `read_only`: see base.py."""
        from kareus_megatron.hardware.gpus import gpu_spec, gpu_spec_for_device_name

        self._nvml = pynvml = nvml_module()
        self.index = index
        self.uuid = uuid
        self._init_owned(read_only)
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
            self.power_reading = POWER_READING_INSTANT if self._instant_mw() is not None else POWER_READING_AVERAGE_1S
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

    def _change(self, what: str, function: str, *args: Any) -> None:
        """Change a GPU setting through the one choke point (nvml_access.change_setting)."""
        self._check_open()
        change_setting(what, function, self._handle, *args, read_only=self._read_only)

    def set_sm_clock_mhz(self, mhz: int) -> None:
        """Lock the SM clock to `mhz` (MHz) (min = max); return once NVML has applied it."""
        if mhz not in self._supported:
            raise ClockControlError(
                f"GPU {self.index} ({self.device_name}) cannot lock {mhz} MHz; supported: "
                f"{self._supported[-1]}..{self._supported[0]} MHz ({len(self._supported)} clocks)"
            )
        if self._read_only:
            self._check_open()
            self._record("set", int(mhz))
            self._would_lock = True
            return
        self._change(f"locking GPU {self.index} to {mhz} MHz", "nvmlDeviceSetGpuLockedClocks", mhz, mhz)
        self._locked = True

    def sm_clock_mhz(self) -> int:
        """Current SM clock (MHz) as reported by NVML."""
        return int(self._call("reading the SM clock", self._nvml.nvmlDeviceGetClockInfo, self._nvml.NVML_CLOCK_SM))

    def reset_clocks(self) -> None:
        """Remove this object's SM clock lock (nvmlDeviceResetGpuLockedClocks); no-op if it locked nothing."""
        if self._read_only:
            self._check_open()
            if self._would_lock:  # as a real reset: only a lock this object (would have) made
                self._record("reset", None)
                self._would_lock = False
            return
        if not self._locked:
            return
        self._change(f"resetting GPU {self.index} clocks", "nvmlDeviceResetGpuLockedClocks")
        self._locked = False

    def check_clock_permission(self) -> None:
        """Raise ClockControlError unless SM clocks may be locked: without root or CAP_SYS_ADMIN nothing is
        touched; otherwise the highest supported clock is locked and that lock reset (read-only: nothing)."""
        self._check_open()
        if self._read_only:
            return
        if may_administer() is False:
            raise ClockControlError(f"locking GPU {self.index} clocks: not root and no CAP_SYS_ADMIN; {PERMISSION_FIX}")
        self.set_sm_clock_mhz(self._supported[0])
        self.reset_clocks()

    def nvml_uuid(self) -> str:
        """The UUID NVML reports for the handle held (not the one asked for)."""
        return str(self._call("reading the UUID", self._nvml.nvmlDeviceGetUUID))

    def temperature_c(self) -> float:
        """GPU core temperature (°C) from NVML's GPU sensor."""
        return float(
            self._call("reading the temperature", self._nvml.nvmlDeviceGetTemperature, self._nvml.NVML_TEMPERATURE_GPU)
        )

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

    def _instant_mw(self) -> int | None:
        """NVML's instantaneous board power (mW; NVML_FI_DEV_POWER_INSTANT), None where the GPU lacks it."""
        try:
            fv = self._nvml.nvmlDeviceGetFieldValues(self._handle, [FI_DEV_POWER_INSTANT])[0]
        except (AttributeError, self._nvml.NVMLError):  # older pynvml or driver: no field values
            return None
        return int(fv.value.uiVal) if fv.nvmlReturn == 0 else None

    def power_w(self) -> float:
        """Board power (W) now: the instantaneous field where the GPU has one, else nvmlDeviceGetPowerUsage
        (mW; a 1 s average on Ampere and later boards); ``power_reading`` says which."""
        if self.power_reading == POWER_READING_INSTANT:
            mw = self._instant_mw()
            if mw is not None:
                return mw / 1000.0
        return int(self._call("reading the board power", self._nvml.nvmlDeviceGetPowerUsage)) / 1000.0

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
            raise ClockControlError(
                f"GPU {self.index} ({self.device_name}) cannot take a power limit of "
                f"{watts:g} W; allowed: {lo:g}..{hi:g} W (nvidia-smi -q -d POWER)"
            )
        if self._read_only:
            self._record("power_limit", int(round(watts)))
            self._limit0_mw = self._limit0_mw or -1  # a recorded change: its reset is recorded too
            return
        if self._limit0_mw is None:
            self._limit0_mw = int(self._call("reading the power limit", self._nvml.nvmlDeviceGetPowerManagementLimit))
        self._change(
            f"setting GPU {self.index}'s power limit to {watts:g} W",
            "nvmlDeviceSetPowerManagementLimit",
            int(round(watts * 1000)),
        )

    def reset_power_limit(self) -> None:
        """Restore the power limit found before this object's first change; no-op if it changed nothing."""
        limit0 = self._limit0_mw
        if limit0 is None:
            return
        if self._read_only:
            self._record("power_limit_reset", None)
        else:
            self._change(
                f"restoring GPU {self.index}'s power limit to {limit0 / 1000:g} W",
                "nvmlDeviceSetPowerManagementLimit",
                limit0,
            )
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
