"""What NVML can tell about this machine without changing anything: `kareus env` and the permission check.

``nvml_report`` reads the driver, the GPU, its clocks, energy counter, power and the clock settings in force.
``clock_permission`` answers "may this process lock SM clocks?" from what it can read: root or
CAP_SYS_ADMIN (what NVML's lock needs), a clock setting already in force (NVML's clock event reason
"applications clocks setting", which locked and application clocks both raise; the application clocks
against their defaults), persistence mode and the application-clock API restriction. It never touches the
GPU unless asked with ``try_lock``, and even then leaves a setting in force alone: it locks the clock the
GPU runs at and resets only that lock, through the one choke point (nvml_access.change_setting), which
refuses in read-only mode.
"""

from __future__ import annotations

from typing import Any

from kareus_megatron.errors import DeviceUnavailableError
from kareus_megatron.hardware.device.nvml import supported_graphics_clocks_mhz
from kareus_megatron.hardware.device.nvml_access import (
    PERMISSION_FIX,
    change_setting,
    may_administer,
    nvml_module,
    translate_nvml_error,
)


def _read(pynvml: Any, fn: str, *args: Any) -> Any:
    """A getter's value, or None where this GPU or driver does not answer it."""
    f = getattr(pynvml, fn, None)
    if f is None:
        return None
    try:
        return f(*args)
    except pynvml.NVMLError:
        return None


def clock_settings(pynvml: Any, handle: Any) -> dict[str, Any]:
    """The clock settings in force, read only: whether a user clock setting (a lock or application clocks)
    limits the clocks now, the SM application clock against its default (MHz), persistence mode and whether
    changing application clocks is restricted to root. None: this GPU or driver does not say."""
    reasons = _read(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", handle)
    if reasons is None:
        reasons = _read(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    bit = getattr(
        pynvml,
        "nvmlClocksEventReasonApplicationsClocksSetting",
        getattr(pynvml, "nvmlClocksThrottleReasonApplicationsClocksSetting", 0x2),
    )
    app = _read(pynvml, "nvmlDeviceGetApplicationsClock", handle, pynvml.NVML_CLOCK_SM)
    app_default = _read(pynvml, "nvmlDeviceGetDefaultApplicationsClock", handle, pynvml.NVML_CLOCK_SM)
    persistence = _read(pynvml, "nvmlDeviceGetPersistenceMode", handle)
    restricted = _read(
        pynvml, "nvmlDeviceGetAPIRestriction", handle, getattr(pynvml, "NVML_RESTRICTED_API_SET_APPLICATION_CLOCKS", 0)
    )
    return {
        "user_clock_setting": None if reasons is None else bool(int(reasons) & int(bit)),
        "clock_event_reasons": None if reasons is None else int(reasons),
        "application_sm_clock_mhz": None if app is None else int(app),
        "default_application_sm_clock_mhz": None if app_default is None else int(app_default),
        "persistence_mode": None if persistence is None else bool(int(persistence)),
        "application_clocks_restricted": None if restricted is None else bool(int(restricted)),
    }


def setting_in_force(settings: dict[str, Any]) -> bool:
    """Whether `settings` (``clock_settings``) show a lock or application clocks someone set."""
    app, default = settings["application_sm_clock_mhz"], settings["default_application_sm_clock_mhz"]
    return bool(settings["user_clock_setting"]) or (app is not None and default is not None and app != default)


def clock_permission(
    pynvml: Any, handle: Any, sm_now_mhz: int, supported: list[int], *, try_lock: bool = False
) -> dict[str, Any]:
    """Whether this process may lock SM clocks, from what can be read (see module doc); with `try_lock`, and
    only when no clock setting is in force, lock the supported clock nearest `sm_now_mhz` (MHz) and reset that
    lock (the choke point refuses both in read-only mode)."""
    settings = clock_settings(pynvml, handle)
    out: dict[str, Any] = {"clock_settings": settings, "capability": may_administer()}
    if out["capability"] is False:
        return {
            **out,
            "clock_permission": False,
            "permission_method": "capability",
            "permission_error": f"not root and no CAP_SYS_ADMIN; {PERMISSION_FIX}",
        }
    if not try_lock:
        return {
            **out,
            "clock_permission": None,
            "permission_method": "capability",
            "permission_note": (
                "root or CAP_SYS_ADMIN: NVML should accept clock locks (not tried; --try-lock tries one and resets it)"
            )
            if out["capability"]
            else "whether this process holds CAP_SYS_ADMIN cannot be read here (not tried; --try-lock tries)",
        }
    if setting_in_force(settings):
        return {
            **out,
            "clock_permission": None,
            "permission_method": "none",
            "permission_note": "a clock setting is in force (locked or application clocks): not tried, since "
            "the reset would end it; left alone",
        }
    if not supported:
        return {
            **out,
            "clock_permission": False,
            "permission_method": "lock",
            "permission_error": "the GPU lists no lockable SM clocks",
        }
    mhz = min(supported, key=lambda c: (abs(c - sm_now_mhz), -c))
    try:
        change_setting(
            f"locking {mhz} MHz to test permission", "nvmlDeviceSetGpuLockedClocks", handle, mhz, mhz, read_only=False
        )
    except DeviceUnavailableError as e:
        return {**out, "clock_permission": False, "permission_method": "lock", "permission_error": str(e)}
    try:
        change_setting("resetting the lock just made", "nvmlDeviceResetGpuLockedClocks", handle, read_only=False)
    except DeviceUnavailableError as e:
        return {**out, "clock_permission": False, "permission_method": "lock", "permission_error": str(e)}
    return {**out, "clock_permission": True, "permission_method": "lock", "locked_mhz": mhz}


def nvml_report(index: int = 0, check_permission: bool = False, *, try_lock: bool = False) -> dict[str, Any]:
    """What NVML says about this machine and GPU `index` (driver, name, clocks, energy, power, permission)."""
    from kareus_megatron.hardware.gpus import gpu_spec_for_device_name

    out: dict[str, Any] = {"nvml": False}
    try:
        pynvml = nvml_module()
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
        out.update(
            index=index,
            name=name,
            preset=spec.name if spec else None,
            memory_clock_mhz=mem,
            supported_sm_clocks_mhz=clocks,
            sm_clock_mhz=sm_now,
        )
        try:
            out["uuid"] = str(pynvml.nvmlDeviceGetUUID(h))
            out["temperature_c"] = float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
        except pynvml.NVMLError:
            pass
        power_mw, limit_mw = (
            _read(pynvml, "nvmlDeviceGetPowerUsage", h),
            _read(pynvml, "nvmlDeviceGetPowerManagementLimit", h),
        )
        out["power_w"] = None if power_mw is None else int(power_mw) / 1000.0
        out["power_limit_w"] = None if limit_mw is None else int(limit_mw) / 1000.0
        try:
            out["energy_counter_mj"] = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        except pynvml.NVMLError as e:
            out["energy_counter_mj"] = None
            out["energy_error"] = str(translate_nvml_error(e, "reading the energy counter"))
        if check_permission or try_lock:
            out.update(clock_permission(pynvml, h, sm_now, clocks, try_lock=try_lock))
    except pynvml.NVMLError as e:
        out["error"] = str(translate_nvml_error(e, f"querying GPU {index}"))
    finally:
        pynvml.nvmlShutdown()
    return out
