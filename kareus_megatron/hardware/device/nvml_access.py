"""How the package reaches NVML: one accessor, one choke point for every change, errors with the fix.

``nvml_module()`` is the only place that imports ``pynvml`` (nvidia-ml-py). With KAREUS_GPU_READ_ONLY set it
hands out a guarded view of the module whose *changing* functions (anything but the getters, see
``is_read_call``) raise ``ReadOnlyViolation`` instead of reaching the driver: a tripwire for any path that
would bypass ``change_setting``. ``change_setting`` is the one function through which the package changes a
GPU setting (SM clock lock and reset, power limit; every call names what it does); it refuses in read-only
mode (the argument or the environment) before the driver is called. Callers that only *record* changes in
read-only mode (base.py) do so before they reach it, so in read-only mode it is never called on a correct
path: a ``ReadOnlyViolation`` is a bug, reported as one.
"""

from __future__ import annotations

import os
import re
from typing import Any

from kareus_megatron.errors import ClockControlError, DeviceUnavailableError
from kareus_megatron.hardware.device.base import read_only_from_env

NO_NVML_FIX = "To run without an NVIDIA GPU, set KAREUS_GPU_BACKEND=simulated."
PERMISSION_FIX = (
    "locking SM clocks needs root or CAP_SYS_ADMIN: run the trainer as root, or let an admin run "
    "`sudo nvidia-smi -pm 1` and grant the capability; or pass --kareus-on-error warn to train at "
    "default clocks"
)
# NVML functions that change nothing: initialisation, shutdown, error strings and the getters. Everything else
# named nvml* (Set*, Reset*, Clear*, power smoothing, workload profiles, MIG instances, ...) changes a setting.
_READ_CALL = re.compile(r"^nvml(Init\w*|Shutdown|ErrorString|\w*Get\w*|DeviceOnSameBoard|DeviceValidateInforom)$")


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


class ReadOnlyViolation(ClockControlError):
    """A GPU setting was about to change in read-only mode (a bug: read-only paths record, never apply)."""


def is_read_call(name: str) -> bool:
    """Whether NVML function `name` only reads (a getter, init, shutdown, error string)."""
    return bool(_READ_CALL.match(name))


class _ReadOnlyNVML:
    """``pynvml`` with every changing function replaced by one that raises ``ReadOnlyViolation``."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.refused: list[str] = []  # the changing calls refused so far (names), for reports and tests

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if name.startswith("nvml") and callable(attr) and not isinstance(attr, type) and not is_read_call(name):

            def refuse(*_args: Any, **_kwargs: Any) -> Any:
                self.refused.append(name)
                raise ReadOnlyViolation(
                    f"KAREUS_GPU_READ_ONLY is set: refused NVML call {name}; a read-only run "
                    "changes nothing on the GPU (this is a bug in kareus, please report it)"
                )

            return refuse
        return attr


_guarded: _ReadOnlyNVML | None = None


def nvml_module() -> Any:
    """The ``pynvml`` module, guarded (see module doc) while KAREUS_GPU_READ_ONLY is set."""
    try:
        import pynvml
    except ImportError:
        raise DeviceUnavailableError(
            f"nvidia-ml-py is not installed (pip install nvidia-ml-py). {NO_NVML_FIX}"
        ) from None
    if not read_only_from_env():
        return pynvml
    global _guarded
    if _guarded is None or _guarded._module is not pynvml:
        _guarded = _ReadOnlyNVML(pynvml)
    return _guarded


def error_code(e: Exception) -> int | None:
    """The NVML return code a ``pynvml.NVMLError`` carries (None for other exceptions)."""
    return getattr(e, "value", None)


def translate_nvml_error(e: Exception, what: str) -> Exception:
    """Map a pynvml.NVMLError raised while doing `what` to a KareusError with the fix."""
    pynvml = nvml_module()
    code = error_code(e)
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return ClockControlError(f"{what}: NVML refused (no permission); {PERMISSION_FIX}")
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
        return DeviceUnavailableError(f"{what}: NVML could not be loaded ({e}). {NO_NVML_FIX}")
    return DeviceUnavailableError(f"{what}: NVML error {code}: {e}")


def change_setting(what: str, function: str, handle: Any, *args: Any, read_only: bool) -> Any:
    """Call NVML's changing function `function` (e.g. ``nvmlDeviceSetGpuLockedClocks``) on `handle`: the one
    place the package changes a GPU setting. Refused (``ReadOnlyViolation``) when `read_only` or
    KAREUS_GPU_READ_ONLY; NVML errors become KareusErrors naming `what` and the fix."""
    if is_read_call(function):
        raise ValueError(f"{function} reads; change_setting is for the functions that change a GPU setting")
    if read_only_from_env(read_only):
        raise ReadOnlyViolation(
            f"{what}: refused, the device is read-only (--no-clock-control or "
            "KAREUS_GPU_READ_ONLY); a read-only run changes nothing on the GPU (this is a bug in "
            "kareus, please report it)"
        )
    pynvml = nvml_module()
    try:
        return getattr(pynvml, function)(handle, *args)
    except pynvml.NVMLError as e:
        raise translate_nvml_error(e, what) from e
