"""The GPU device contract shared by the NVML and simulated backends.

Terms: the *SM clock* is the graphics/SM clock in MHz; *locking* it pins min and max to one value;
*resetting* returns clock management to the driver's default. A device resets only what it locked
itself: ``reset_clocks()`` and ``close()`` are no-ops until a lock went through this object, so an
administrator's lock on a shared node survives a process that never locked. A *read-only* device
(``open_gpu(..., read_only=True)`` or KAREUS_GPU_READ_ONLY=1, which wins over any argument) reads everything
real (clocks, supported clocks, energy, temperature) but only records set/reset calls in ``recorded`` (the
latest RECORDED_MAX, with ``recorded_total`` counting all) and never applies them.
The board *power limit* (W, ``nvidia-smi -pl``) follows the same rule: ``reset_power_limit()`` and
``close()`` restore the limit found at open only if this object changed it; read-only, it is recorded.
Energy is cumulative GPU energy in J since the device was opened; temperature is in °C.
``SimulationHooks`` declares what only the simulated backend adds (busy and idle edges, clock calls
on a simulated time line, energy at a past time, its own event log); the runtime receives it
explicitly (``hardware.device.simulation_of``) and never probes a device for it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kareus_megatron.environment import KareusSettings, kareus_settings

if TYPE_CHECKING:
    from kareus_megatron.hardware.gpus import GPUSpec

BACKENDS = ("nvml", "simulated")
READ_ONLY_ENV = "KAREUS_GPU_READ_ONLY"  # 1: every device opened by open_gpu is read-only


def read_only_from_env(read_only: bool | None = None) -> bool:
    """Whether a device is read-only: `read_only` asks for it, or KAREUS_GPU_READ_ONLY is set to something other
    than 0/empty. The environment always wins: a process told to be read-only is, whatever a flag says."""
    return bool(read_only) or KareusSettings.flag(kareus_settings().gpu_read_only)


@runtime_checkable
class GPUDevice(Protocol):
    """One local GPU whose SM clock can be locked and whose energy can be read. Units: MHz, J."""

    spec: GPUSpec
    index: int
    recorded: deque[tuple[str, int | None]]  # read-only: the latest ("set", MHz) / ("reset", None) calls not applied
    recorded_total: dict[str, int]  # read-only: every call not applied, counted by kind ("set", "reset", ...)

    @property
    def read_only(self) -> bool:
        """Whether set/reset calls are only recorded (nothing on the GPU changes)."""
        ...

    def set_sm_clock_mhz(self, mhz: int) -> None:
        """Lock the SM clock to `mhz` (MHz); return once the driver has applied it."""
        ...

    def sm_clock_mhz(self) -> int:
        """Current SM clock (MHz)."""
        ...

    def reset_clocks(self) -> None:
        """Undo this object's lock: the driver manages the SM clock again (no-op if it locked nothing)."""
        ...

    def check_clock_permission(self) -> None:
        """Raise ClockControlError unless this process may lock SM clocks; change nothing where the answer
        is known without trying, else lock and reset only that lock (read-only: return at once)."""
        ...

    @property
    def locked(self) -> bool:
        """Whether a clock lock made through this object is in force (what ``reset_clocks`` would undo)."""
        ...

    def temperature_c(self) -> float:
        """GPU temperature (°C), the GPU core sensor."""
        ...

    def nvml_uuid(self) -> str:
        """The UUID of the GPU this object drives, as the driver reports it (``GPU-...``)."""
        ...

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """SM clocks (MHz) this GPU can be locked to, highest first."""
        ...

    def energy_j(self) -> float:
        """GPU energy (J) consumed since the device was opened."""
        ...

    def set_power_limit_w(self, watts: float) -> None:
        """Set the board power limit to `watts` (W), within ``power_limit_range_w``; read-only: record it."""
        ...

    def power_limit_w(self) -> float:
        """Board power limit (W) in force (read-only: the one the GPU has, whatever was recorded)."""
        ...

    def power_limit_range_w(self) -> tuple[float, float]:
        """(min, max) board power limit (W) the driver accepts."""
        ...

    def reset_power_limit(self) -> None:
        """Restore the power limit (W) found at open if this object changed it (no-op otherwise)."""
        ...

    def close(self) -> None:
        """Reset a clock this object locked and release the device; further calls are errors."""
        ...


RECORDED_MAX = 4096  # calls a read-only device keeps in ``recorded`` (a run records one per clock change)


class OwnedLocks:
    """What both backends keep of their own changes: read-only mode, whether a lock is theirs, the calls
    a read-only device recorded instead of applying (set in each backend's ``__init__`` by ``_init_owned``):
    the latest RECORDED_MAX in ``recorded``, every one counted by kind in ``recorded_total``."""

    _read_only: bool
    _locked: bool  # a clock lock went through this object (scheduled ones count) and was not reset
    recorded: deque[tuple[str, int | None]]
    recorded_total: dict[str, int]

    def _init_owned(self, read_only: bool) -> None:
        self._read_only = read_only_from_env(read_only)  # KAREUS_GPU_READ_ONLY wins, however the device is made
        self._locked = False
        self.recorded = deque(maxlen=RECORDED_MAX)
        self.recorded_total = {}

    def _record(self, call: str, value: int | None) -> None:
        """Keep a call a read-only device did not apply (``recorded``, bounded) and count it."""
        self.recorded.append((call, value))
        self.recorded_total[call] = self.recorded_total.get(call, 0) + 1

    @property
    def read_only(self) -> bool:
        """Whether set/reset are only recorded (``recorded``), never applied."""
        return self._read_only

    @property
    def locked(self) -> bool:
        """Whether a clock lock made through this object is in force (what ``reset_clocks`` would undo)."""
        return self._locked


@runtime_checkable
class SimulationHooks(Protocol):
    """What a simulated GPU offers beyond ``GPUDevice``. Times are ``time.monotonic()`` seconds; power is
    the cost model's, busy while an instruction runs (or the power the caller gives for that interval: a
    simulated truth's, runtime/closed_loop/truth.py) and the preset's blocked power otherwise."""

    latency_s: float  # duration (s) of one simulated NVML clock call

    @property
    def logging(self) -> bool:
        """Whether ``log_event`` writes anywhere (the simulated GPU's own JSONL log)."""
        ...

    def log_event(self, event: str, **fields: Any) -> None:
        """Append `event` with a timestamp and `fields` to the simulated GPU's log (it logs its own
        ``set`` and ``reset``; others, e.g. a controller's ``skip``, come through here)."""
        ...

    def set_busy(
        self,
        busy: bool,
        t: float | None = None,
        compute_activity: float = ...,
        memory_activity: float = ...,
        power_w: float = ...,
    ) -> None:
        """An instruction runs (busy) or none does from time `t` (s; now if None); a busy one draws
        `power_w` W (NaN, the default: the power model's)."""
        ...

    def busy_edges(self, edges: list[float], power_w: list[float] | None = None) -> None:
        """``set_busy(busy, t)`` for each pair of the flat list (t0, busy0, t1, busy1, ...; busy 1.0/0.0);
        `power_w` (one per pair; NaN: the model's) is each busy edge's power (W)."""
        ...

    def use_power_model(self, spec: GPUSpec) -> None:
        """Model power (W) with `spec`'s power-model fields from now on (same GPU and clocks; blocked power
        included): how a simulated truth's power fields reach the device."""
        ...

    def schedule_sm_clock(self, mhz: int, t_issue: float) -> float:
        """A clock call issued at `t_issue` (s) locks `mhz` MHz one latency later, on the simulated time
        line (no waiting); return that time (s)."""
        ...

    def energy_j_at(self, t: float) -> float:
        """Energy (J) since open up to the past time `t` (s), counting edges given later with earlier times."""
        ...


# Lowest board power limit as a share of the board limit, for presets without NVML's own minimum
# (gpus.toml min_power_limit_w): NVML reports 100 W of 400 W on the A100-SXM4-40GB (nvidia-smi -q -d POWER,
# "Min Power Limit"). The simulated GPU accepts limits from here, and the powercap planner's grid starts no
# lower (search/powercap.py).
MIN_POWER_LIMIT_FRACTION = 0.25


def min_power_limit_w(spec: GPUSpec) -> float:
    """Lowest board power limit (W) of `spec`: its preset's min_power_limit_w, else MIN_POWER_LIMIT_FRACTION of
    its board limit."""
    if spec.min_power_limit_w is not None:
        return float(spec.min_power_limit_w)
    return round(float(spec.power_limit_w) * MIN_POWER_LIMIT_FRACTION, 3)


def nearest_supported_mhz(mhz: int, supported: tuple[int, ...]) -> int:
    """The supported clock (MHz) closest to `mhz`; ties go to the higher clock."""
    if not supported:
        raise ValueError("no supported clocks")
    return min(supported, key=lambda c: (abs(c - mhz), -c))
