"""Device-level checks of the GPU validation kit (`kareus validate`): identity, clocks, clock-change latency.

Terms. *Identity*: NVML's device name and UUID against the CUDA device's (given by the caller, who
owns torch). *Lock/reset*: each clock of a grid is locked (``set_sm_clock_mhz``), read back while work
keeps the GPU busy, and the time from the call to the clock reading the new value is the *clock-change
latency* (s); the call's own duration is reported apart. ``ClockCallGuard`` wraps a device, counts every
set/reset and, in read-only mode, refuses them (a read-only run must change nothing on the GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kareus_megatron.errors import ClockControlError
from kareus_megatron.hardware.device.base import GPUDevice

APPLIED_TIMEOUT_S = 0.25  # longest wait (s) for a locked clock to show in the SM clock reading


class ClockCallGuard:
    """A GPUDevice proxy that counts clock calls; with read_only=True it refuses them instead."""

    def __init__(self, device: GPUDevice, read_only: bool) -> None:
        self._device = device
        self.read_only = read_only
        self.calls = {"set": 0, "reset": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    def _refuse(self, what: str) -> None:
        if self.read_only:
            raise ClockControlError(
                f"--no-clock-control: the validation tried to {what}; a read-only run changes "
                "nothing on the GPU (this is a bug in kareus validate)"
            )

    def set_sm_clock_mhz(self, mhz: int) -> None:
        """Lock the SM clock to `mhz` (MHz), counted; refused in read-only mode."""
        self._refuse(f"lock the SM clock to {mhz} MHz")
        self.calls["set"] += 1
        self._device.set_sm_clock_mhz(mhz)

    def reset_clocks(self) -> None:
        """Reset the clocks, counted; refused in read-only mode."""
        self._refuse("reset the clocks")
        self.calls["reset"] += 1
        self._device.reset_clocks()


def identity(device: GPUDevice, cuda: dict[str, Any] | None) -> dict[str, Any]:
    """NVML's name and UUID of `device` against the CUDA device's (`cuda`: {"name", "uuid"} or None)."""
    uuid = nvml_uuid(device)
    name = getattr(device, "device_name", None) or device.spec.name
    out: dict[str, Any] = {"index": device.index, "name": name, "preset": device.spec.name, "uuid": uuid, "cuda": cuda}
    if cuda and cuda.get("uuid") and uuid:
        a, b = (str(u).lower().removeprefix("gpu-") for u in (uuid, cuda["uuid"]))
        out["uuid_match"] = a == b
    else:
        out["uuid_match"] = None  # one side does not report a UUID (the simulated GPU, an old driver)
    return out


def supported_clocks(device: GPUDevice) -> dict[str, Any]:
    """The lockable SM clocks (MHz) and the clock the GPU runs at now."""
    clocks = list(device.supported_sm_clocks_mhz())
    return {
        "count": len(clocks),
        "max_mhz": clocks[0] if clocks else None,
        "min_mhz": clocks[-1] if clocks else None,
        "supported_mhz": clocks,
        "current_mhz": device.sm_clock_mhz(),
        "preset_range_mhz": [device.spec.min_sm_clock_mhz, device.spec.max_sm_clock_mhz],
    }


def lock_grid(supported: Sequence[int], at_most: int) -> list[int]:
    """At most `at_most` clocks (MHz, descending) spread evenly over `supported`, both ends included."""
    clocks = sorted(set(supported), reverse=True)
    if len(clocks) <= at_most:
        return clocks
    step = (len(clocks) - 1) / (at_most - 1)
    return sorted({clocks[round(i * step)] for i in range(at_most)}, reverse=True)


def lock_and_latency(
    device: GPUDevice, clocks: Sequence[int], busy: Callable[[], Any], sync: Callable[[], Any]
) -> dict[str, Any]:
    """Lock each clock in turn under load, read it back, time call and application (s); reset at the end."""
    rows: list[dict[str, Any]] = []
    for mhz in clocks:
        busy()  # queue work so that the SM clock is the locked one, not an idle one
        t0 = time.perf_counter()
        device.set_sm_clock_mhz(mhz)
        call_s = time.perf_counter() - t0
        read = device.sm_clock_mhz()
        while read != mhz and time.perf_counter() - t0 < APPLIED_TIMEOUT_S:
            read = device.sm_clock_mhz()
        applied_s = time.perf_counter() - t0 if read == mhz else None
        sync()
        rows.append({"mhz": mhz, "read_mhz": read, "call_s": call_s, "applied_s": applied_s})
    t0 = time.perf_counter()
    device.reset_clocks()
    reset_s = time.perf_counter() - t0
    applied = sorted(float(r["applied_s"]) for r in rows if r["applied_s"] is not None)
    calls = sorted(float(r["call_s"]) for r in rows)
    return {
        "clocks": rows,
        "locked_ok": sum(r["read_mhz"] == r["mhz"] for r in rows),
        "tried": len(rows),
        "call_s_median": calls[len(calls) // 2] if calls else None,
        "applied_s_median": applied[len(applied) // 2] if applied else None,
        "applied_s_max": applied[-1] if applied else None,
        "reset_s": reset_s,
        "after_reset_mhz": device.sm_clock_mhz(),
    }


def open_for_validation(index: int, backend: str | None, gpu: str | None, read_only: bool) -> GPUDevice:
    """Open the GPU that is CUDA device `index` (NVML by its UUID), read-only when asked."""
    from kareus_megatron.hardware.device import open_cuda_gpu

    return open_cuda_gpu(index, backend=backend, gpu=gpu, read_only=read_only)


def close_after_validation(device: GPUDevice, read_only: bool) -> None:
    """Close `device` (a read-only device, and any device, resets only clocks it locked itself)."""
    device.close()


def nvml_uuid(device: GPUDevice) -> str | None:
    """The UUID the driver reports for the GPU `device` drives (not the one it was asked for); None if unknown."""
    try:
        return device.nvml_uuid()
    except Exception:  # noqa: BLE001  (a driver that cannot say: the identity check reports it unknown)
        return None
