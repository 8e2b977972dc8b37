"""The GPU device contract shared by the NVML and simulated backends.

Terms: the *SM clock* is the graphics/SM clock in MHz; *locking* it pins min and max to one value;
*resetting* returns clock management to the driver's default. Energy is cumulative GPU energy in J
since the device was opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kareus_megatron.hardware.gpus import GPUSpec

BACKENDS = ("nvml", "simulated")


@runtime_checkable
class GPUDevice(Protocol):
    """One local GPU whose SM clock can be locked and whose energy can be read. Units: MHz, J."""

    spec: GPUSpec
    index: int

    def set_sm_clock_mhz(self, mhz: int) -> None:
        """Lock the SM clock to `mhz` (MHz); return once the driver has applied it."""
        ...

    def sm_clock_mhz(self) -> int:
        """Current SM clock (MHz)."""
        ...

    def reset_clocks(self) -> None:
        """Undo any lock: the driver manages the SM clock again."""
        ...

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """SM clocks (MHz) this GPU can be locked to, highest first."""
        ...

    def energy_j(self) -> float:
        """GPU energy (J) consumed since the device was opened."""
        ...

    def close(self) -> None:
        """Reset clocks and release the device; further calls are errors."""
        ...


def nearest_supported_mhz(mhz: int, supported: tuple[int, ...]) -> int:
    """The supported clock (MHz) closest to `mhz`; ties go to the higher clock."""
    if not supported:
        raise ValueError("no supported clocks")
    return min(supported, key=lambda c: (abs(c - mhz), -c))
