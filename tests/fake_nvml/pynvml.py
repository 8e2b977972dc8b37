"""A stand-in for nvidia-ml-py's ``pynvml`` that records every call changing a GPU setting, across processes.

Put this directory first on PYTHONPATH (the tests' ``fake_nvml_env``) and every process of a command — the
CLI, its subprocesses, the clock controller's side process, torchrun's ranks — imports it instead of the
real module. The GPU is the preset named by KAREUS_FAKE_NVML_PRESET (default a40: its NVML name and
lockable clocks); there are KAREUS_FAKE_NVML_COUNT of them (default 8). Getters answer like a driver: the
SM clock is the locked one while locked, the energy counter (mJ) grows at 150 W of wall time, the power
limit is the preset's. Each changing call (any ``nvml*`` function that is not a getter, init, shutdown or
error string) is appended as one JSON line to KAREUS_FAKE_NVML_LOG (``{"call": name, "args": [...],
"pid": ...}``) and, for clock locks and power limits, applied to this process's state. A name this module
does not know raises AttributeError, so a path that needs a getter not modelled here fails loudly.
"""

from __future__ import annotations

import json
import os
import re
import time

from kareus_megatron.hardware.gpus import gpu_spec

NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_UNKNOWN = 999
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_RESTRICTED_API_SET_APPLICATION_CLOCKS = 0
nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonApplicationsClocksSetting = 0x2
nvmlClocksEventReasonSwPowerCap = 0x4

_SPEC = gpu_spec(os.environ.get("KAREUS_FAKE_NVML_PRESET", "a40"))
_COUNT = int(os.environ.get("KAREUS_FAKE_NVML_COUNT", "8"))
_MEM_MHZ = 7251
_T0 = time.monotonic()
_POWER_W = 150.0
_state: dict[str, int | None] = {"locked_mhz": None, "limit_mw": int(_SPEC.power_limit_w * 1000)}
_READ = re.compile(r"^nvml(Init\w*|Shutdown|ErrorString|\w*Get\w*)$")


class NVMLError(Exception):
    """As pynvml's: the NVML return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def _handle(index: int) -> str:
    if not 0 <= index < _COUNT:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return f"fake-handle-{index}"


def _log(name: str, args: tuple) -> None:
    path = os.environ.get("KAREUS_FAKE_NVML_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"call": name, "args": [str(a) for a in args], "pid": os.getpid()}) + "\n")


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlSystemGetDriverVersion() -> str:
    return "580.00.00-fake"


def nvmlDeviceGetCount() -> int:
    return _COUNT


def nvmlDeviceGetHandleByIndex(index: int) -> str:
    return _handle(int(index))


def nvmlDeviceGetHandleByUUID(uuid: str) -> str:
    for i in range(_COUNT):
        if nvmlDeviceGetUUID(_handle(i)) == uuid:
            return _handle(i)
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetName(handle: str) -> str:
    return _SPEC.device_names[0]


def nvmlDeviceGetUUID(handle: str) -> str:
    return f"GPU-fake0000-0000-0000-0000-{int(handle.rsplit('-', 1)[1]):012d}"


def nvmlDeviceGetMigMode(handle: str) -> list[int]:
    return [0, 0]


def nvmlDeviceGetSupportedMemoryClocks(handle: str) -> list[int]:
    return [_MEM_MHZ]


def nvmlDeviceGetSupportedGraphicsClocks(handle: str, mem_mhz: int) -> list[int]:
    return list(_SPEC.sm_clocks_mhz)


def nvmlDeviceGetClockInfo(handle: str, kind: int) -> int:
    if kind == NVML_CLOCK_MEM:
        return _MEM_MHZ
    return int(_state["locked_mhz"] or _SPEC.max_sm_clock_mhz)


def nvmlDeviceGetTotalEnergyConsumption(handle: str) -> int:
    return int((time.monotonic() - _T0) * _POWER_W * 1000.0) + 10_000_000


def nvmlDeviceGetPowerUsage(handle: str) -> int:
    return int(_POWER_W * 1000)


NVML_FI_DEV_POWER_INSTANT = 186


class _FieldValue:
    """As pynvml's c_nvmlFieldValue_t: fieldId, nvmlReturn and value (a union; uiVal here)."""

    def __init__(self, field: int, ret: int, value: int) -> None:
        self.fieldId, self.nvmlReturn = field, ret
        self.value = type("Value", (), {"uiVal": value, "siVal": value})()


def nvmlDeviceGetFieldValues(handle: str, fields: list[int]) -> list[_FieldValue]:
    """The instantaneous power field answers unless KAREUS_FAKE_NVML_NO_INSTANT is set (a board without it)."""
    instant = not os.environ.get("KAREUS_FAKE_NVML_NO_INSTANT")
    return [
        _FieldValue(f, NVML_SUCCESS, int(_POWER_W * 1000))
        if f == NVML_FI_DEV_POWER_INSTANT and instant
        else _FieldValue(f, NVML_ERROR_NOT_SUPPORTED, 0)
        for f in fields
    ]


def nvmlDeviceGetTemperature(handle: str, sensor: int) -> int:
    return 40


def nvmlDeviceGetPowerManagementLimit(handle: str) -> int:
    return int(_state["limit_mw"] or 0)


def nvmlDeviceGetEnforcedPowerLimit(handle: str) -> int:
    return int(_state["limit_mw"] or 0)


def nvmlDeviceGetPowerManagementLimitConstraints(handle: str) -> tuple[int, int]:
    return int(_SPEC.power_limit_w * 250), int(_SPEC.power_limit_w * 1000)


def nvmlDeviceGetCurrentClocksEventReasons(handle: str) -> int:
    return nvmlClocksEventReasonApplicationsClocksSetting if _state["locked_mhz"] else nvmlClocksEventReasonGpuIdle


def nvmlDeviceGetApplicationsClock(handle: str, kind: int) -> int:
    return int(_SPEC.max_sm_clock_mhz)


def nvmlDeviceGetDefaultApplicationsClock(handle: str, kind: int) -> int:
    return int(_SPEC.max_sm_clock_mhz)


def nvmlDeviceGetPersistenceMode(handle: str) -> int:
    return 1


def nvmlDeviceGetAPIRestriction(handle: str, api: int) -> int:
    return 1


def _changer(name: str):
    def call(*args):
        _log(name, args)
        if name == "nvmlDeviceSetGpuLockedClocks":
            _state["locked_mhz"] = int(args[1])
        elif name == "nvmlDeviceResetGpuLockedClocks":
            _state["locked_mhz"] = None
        elif name == "nvmlDeviceSetPowerManagementLimit":
            _state["limit_mw"] = int(args[1])

    return call


def __getattr__(name: str):
    if name.startswith("nvml") and not _READ.match(name):
        return _changer(name)
    raise AttributeError(f"the stand-in pynvml has no {name}")
