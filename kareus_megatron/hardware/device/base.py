"""The GPU device contract shared by the NVML and simulated backends.

Terms: the *SM clock* is the graphics/SM clock in MHz; *locking* it pins min and max to one value;
*resetting* returns clock management to the driver's default. Energy is cumulative GPU energy in J
since the device was opened. ``SimulationHooks`` declares what only the simulated backend adds (busy and
idle edges, clock calls on a simulated time line, energy at a past time, its own event log); the
runtime receives it explicitly (``hardware.device.simulation_of``) and never probes a device for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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


@runtime_checkable
class SimulationHooks(Protocol):
    """What a simulated GPU offers beyond ``GPUDevice``. Times are ``time.monotonic()`` seconds; power is
    the cost model's, busy while an instruction runs and the preset's blocked power otherwise."""

    latency_s: float  # duration (s) of one simulated NVML clock call

    @property
    def logging(self) -> bool:
        """Whether ``log_event`` writes anywhere (the simulated GPU's own JSONL log)."""
        ...

    def log_event(self, event: str, **fields: Any) -> None:
        """Append `event` with a timestamp and `fields` to the simulated GPU's log (it logs its own
        ``set`` and ``reset``; others, e.g. a controller's ``skip``, come through here)."""
        ...

    def set_busy(self, busy: bool, t: float | None = None, compute_activity: float = ...,
                 memory_activity: float = ...) -> None:
        """An instruction runs (busy) or none does from time `t` (s; now if None)."""
        ...

    def busy_edges(self, edges: list[float]) -> None:
        """``set_busy(busy, t)`` for each pair of the flat list (t0, busy0, t1, busy1, ...; busy 1.0/0.0)."""
        ...

    def schedule_sm_clock(self, mhz: int, t_issue: float) -> float:
        """A clock call issued at `t_issue` (s) locks `mhz` MHz one latency later, on the simulated time
        line (no waiting); return that time (s)."""
        ...

    def energy_j_at(self, t: float) -> float:
        """Energy (J) since open up to the past time `t` (s), counting edges given later with earlier times."""
        ...


def nearest_supported_mhz(mhz: int, supported: tuple[int, ...]) -> int:
    """The supported clock (MHz) closest to `mhz`; ties go to the higher clock."""
    if not supported:
        raise ValueError("no supported clocks")
    return min(supported, key=lambda c: (abs(c - mhz), -c))
