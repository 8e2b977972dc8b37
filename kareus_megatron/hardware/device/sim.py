"""Simulated backend: a GPU without hardware, for CPU machines and tests.

It keeps the NVML contract: clocks must be among the preset's supported clocks, each clock call
blocks for a simulated NVML latency (default 15 ms, ``KAREUS_SIMULATED_LATENCY_MS``), and every clock
change is appended with a timestamp to a JSONL log (``KAREUS_SIMULATED_LOG``). Energy (J) integrates
the cost model's power ``hardware.power.power_w(spec, clock, compute_activity, memory_activity)`` over
wall time while an instruction runs (*busy*; or the power the caller gives for that busy interval, a
simulated truth's, runtime/closed_loop/truth.py) and the preset's blocked power ``spec.p_blocked_w`` while none runs
(``use_power_model`` swaps the preset's power fields for a truth's). Timestamps are ``time.monotonic()``
seconds (one clock for every process on the machine). ``KAREUS_SIMULATED_NO_PERMISSION=1`` makes clock
calls fail as NVML does without root. A read-only simulated GPU (``read_only=True``, KAREUS_GPU_READ_ONLY=1)
records set/reset calls and keeps running at its default clock. Temperature (°C) follows the power drawn. The
latency, the default activity and the temperature model are hardware/device/sim_model.py's. Beyond the
``GPUDevice`` contract it implements ``SimulationHooks`` (hardware/device/base.py).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kareus_megatron.environment import KareusSettings, kareus_settings
from kareus_megatron.errors import ClockControlError, DeviceUnavailableError
from kareus_megatron.hardware.device.base import OwnedLocks, min_power_limit_w
from kareus_megatron.hardware.device.sim_model import (
    DEFAULT_COMPUTE_ACTIVITY,
    DEFAULT_MEMORY_ACTIVITY,
    lagged_temperature_c,
    latency_from_env,
    steady_temperature_c,
)
from kareus_megatron.hardware.power import power_w, sustained_clock_mhz
from kareus_megatron.jsonl import JsonlAppender

if TYPE_CHECKING:
    from kareus_megatron.hardware.gpus import GPUSpec

_MODEL = math.nan  # a busy power override that is none: the power model's


class SimulatedGPU(OwnedLocks):
    """A GPU simulated from its preset: clock log, NVML-like latency, modelled energy. Units: MHz, J, s."""

    def __init__(
        self,
        spec: GPUSpec,
        index: int = 0,
        *,
        log_path: str | os.PathLike[str] | None = None,
        latency_s: float | None = None,
        deny_clock_control: bool | None = None,
        read_only: bool = False,
    ) -> None:
        """Open simulated GPU `index`; unset options come from the KAREUS_SIMULATED_* variables."""
        self.spec = spec
        self.index = index
        self._init_owned(read_only)
        self._would_lock = False  # read-only: a recorded set not followed by a recorded reset
        self.latency_s = latency_from_env() if latency_s is None else float(latency_s)
        if deny_clock_control is None:
            deny_clock_control = KareusSettings.flag(kareus_settings().simulated_no_permission)
        self._deny = deny_clock_control
        if log_path is None:
            log_path = kareus_settings().simulated_log or None
        self._log = JsonlAppender(log_path) if log_path else None
        self._supported = tuple(sorted({int(c) for c in spec.sm_clocks_mhz}, reverse=True))
        self._default_mhz = int(spec.max_sm_clock_mhz)
        self._lock = threading.Lock()
        self._mhz = self._default_mhz
        self._busy = False
        self._busy_w = _MODEL  # the busy power (W) the caller gave; NaN: the power model's
        self._compute = DEFAULT_COMPUTE_ACTIVITY
        self._memory = DEFAULT_MEMORY_ACTIVITY
        self._t_last = time.monotonic()
        self._changes: list[tuple[float, int]] = []  # scheduled clock changes (time s, MHz), in order
        self._energy_j = 0.0
        self._power_cache: dict[tuple[int, float, float], float] = {}
        self._power_limit_w = float(spec.power_limit_w)  # in force (W); the board limit at open
        self._capped = spec  # the preset with the power limit in force (the power model's clamp)
        self._limit_set = False  # whether this object changed the power limit (what reset_power_limit undoes)
        self._temp_c = steady_temperature_c(float(spec.p_blocked_w), float(spec.power_limit_w))
        self._temp_at = (self._t_last, 0.0)  # (time s, energy J) of the last temperature update
        self._open = True
        self.log_event("open", mhz=self._mhz, read_only=self._read_only)

    # -- log ---------------------------------------------------------------------------------
    def log_event(self, event: str, **fields: Any) -> None:
        """Append `event` with a timestamp (time.monotonic(), s) and `fields` to the simulated log."""
        if self._log is not None:
            self._log.write({"t": time.monotonic(), "pid": os.getpid(), "gpu": self.index, "event": event, **fields})

    @property
    def logging(self) -> bool:
        """Whether events are written to a log (KAREUS_SIMULATED_LOG or `log_path`)."""
        return self._log is not None

    # -- energy model ------------------------------------------------------------------------
    def _power_w(self, mhz: int | None = None) -> float:
        """Power (W) of the present busy state at `mhz` MHz (default: the present clock)."""
        if not self._busy:
            return float(self.spec.p_blocked_w)
        if self._busy_w == self._busy_w:  # the caller's power for this busy interval
            return self._busy_w
        key = (self._mhz if mhz is None else mhz, self._compute, self._memory)
        p = self._power_cache.get(key)
        if p is None:  # the model is pure in its arguments: evaluate once per state
            mhz_now = float(key[0])
            if self._capped is not self.spec:  # under a lower cap the clock falls until power meets it
                mhz_now = float(sustained_clock_mhz(self._capped, mhz_now, self._compute, self._memory))
            p = self._power_cache[key] = float(power_w(self._capped, mhz_now, self._compute, self._memory))
        return p

    def _integrate(self, t: float) -> tuple[float, float, int, int]:
        """(energy J, time s, clock MHz, scheduled changes passed) at `t`, from the present state and the
        scheduled clock changes due by then; changes nothing."""
        energy, t_last, mhz, n = self._energy_j, self._t_last, self._mhz, 0
        for t_change, new_mhz in self._changes:
            if t_change > t:
                break
            if t_change > t_last:
                energy += self._power_w(mhz) * (t_change - t_last)
                t_last = t_change
            mhz, n = new_mhz, n + 1
        if t > t_last:
            energy += self._power_w(mhz) * (t - t_last)
            t_last = t
        return energy, t_last, mhz, n

    def _advance(self, t: float) -> None:
        """Integrate power up to `t`, applying the scheduled clock changes due by then in order."""
        self._energy_j, self._t_last, self._mhz, n = self._integrate(t)
        del self._changes[:n]

    def set_busy(
        self,
        busy: bool,
        t: float | None = None,
        compute_activity: float = DEFAULT_COMPUTE_ACTIVITY,
        memory_activity: float = DEFAULT_MEMORY_ACTIVITY,
        power_w: float = _MODEL,
    ) -> None:
        """Mark an instruction as running (busy) or not from time `t` (time.monotonic(), s; now if None); a
        busy one draws `power_w` W (NaN: the power model at the clock and activities)."""
        with self._lock:
            self._advance(time.monotonic() if t is None else t)
            self._busy, self._busy_w = busy, power_w if busy else _MODEL
            self._compute, self._memory = compute_activity, memory_activity

    def busy_edges(self, edges: list[float], power_w: list[float] | None = None) -> None:
        """`set_busy(busy, t)` for each pair (t, busy) of the flat list `edges` (t0, busy0, t1, ...; busy
        1.0 or 0.0), in time order, at the default activity (one lock; the clock's hot path). `power_w`, one
        entry per pair: a busy edge's power (W; NaN: the model's)."""
        powers = itertools.repeat(_MODEL) if power_w is None else power_w
        with self._lock:
            self._compute, self._memory = DEFAULT_COMPUTE_ACTIVITY, DEFAULT_MEMORY_ACTIVITY
            it = iter(edges)
            if self._changes:  # a scheduled clock change falls among them: the general path
                for t, b, pw in zip(it, it, powers):
                    self._advance(t)
                    self._busy, self._busy_w = bool(b), pw if b else _MODEL
                return
            p = self._power_w()  # the present state's, then each edge's power (W)
            busy: float = self._busy  # then each edge's busy value (1.0 or 0.0)
            busy_w = self._busy_w
            self._busy, self._busy_w = True, _MODEL
            p_model, p_idle = self._power_w(), float(self.spec.p_blocked_w)
            t_last, energy = self._t_last, self._energy_j
            for t, b, pw in zip(it, it, powers):
                if t > t_last:
                    energy += p * (t - t_last)
                    t_last = t
                busy, busy_w = b, pw if b else _MODEL
                p = (pw if pw == pw else p_model) if b else p_idle
            self._t_last, self._energy_j, self._busy, self._busy_w = t_last, energy, bool(busy), busy_w

    def schedule_sm_clock(self, mhz: int, t_issue: float) -> float:
        """Simulated time line (no waiting): a clock call issued at `t_issue` (time.monotonic(), s) locks
        `mhz` MHz one simulated latency later; returns that time. Busy/idle edges and energy readings
        that come later with earlier timestamps still see the clock in force at their own time. The
        clock controller uses this instead of the blocking call when the trainer's messages arrive in
        batches (CPU hosts), so the simulation does not depend on when the batches arrive."""
        self._check_open()
        mhz = int(mhz)
        self._check_lockable(mhz)
        self._check_permission(f"locking GPU {self.index} to {mhz} MHz")
        t_done = float(t_issue) + self.latency_s
        if self._read_only:
            self._record("set", mhz)
            self._would_lock = True
            self.log_event("recorded", call="set", mhz=mhz, t_issue=t_issue)
            return t_done
        with self._lock:
            if self._changes and t_done < self._changes[-1][0]:
                t_done = self._changes[-1][0]  # calls are serial: never before the previous one
            self._changes.append((t_done, mhz))
            self._locked = True
        self.log_event("set", mhz=mhz, t_issue=t_issue, t_done=t_done)
        return t_done

    # -- GPUDevice contract ------------------------------------------------------------------
    def _check_open(self) -> None:
        if not self._open:
            raise DeviceUnavailableError(f"simulated GPU {self.index} is closed")

    def _check_permission(self, what: str) -> None:
        if self._deny:
            raise ClockControlError(
                f"{what}: NVML refused (no permission; simulated by KAREUS_SIMULATED_NO_PERMISSION); "
                "run as root or pass --kareus-on-error warn to train at default clocks"
            )

    def _check_lockable(self, mhz: int) -> None:
        if mhz not in self._supported:
            raise ClockControlError(
                f"simulated {self.spec.name} cannot lock {mhz} MHz; supported: "
                f"{self._supported[-1]}..{self._supported[0]} MHz ({len(self._supported)} clocks)"
            )

    def set_sm_clock_mhz(self, mhz: int) -> None:
        """Lock the SM clock to `mhz` (MHz) after the simulated NVML latency."""
        self._check_open()
        mhz = int(mhz)
        self._check_lockable(mhz)
        self._check_permission(f"locking GPU {self.index} to {mhz} MHz")
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        if self._read_only:
            self._record("set", mhz)
            self._would_lock = True
            self.log_event("recorded", call="set", mhz=mhz)
            return
        with self._lock:
            self._advance(time.monotonic())
            self._mhz, self._locked = mhz, True
        self.log_event("set", mhz=mhz)

    def sm_clock_mhz(self) -> int:
        """Current SM clock (MHz), counting scheduled changes due by now."""
        self._check_open()
        now = time.monotonic()
        with self._lock:
            return self._integrate(now)[2]

    def reset_clocks(self) -> None:
        """Undo this object's lock: the default (maximum) SM clock after the simulated NVML latency; a
        no-op when it locked nothing (read-only: recorded)."""
        self._check_open()
        if self._read_only:
            if self._would_lock:  # as a real reset: only a lock this object (would have) made
                self._record("reset", None)
                self._would_lock = False
                self.log_event("recorded", call="reset")
            return
        if not self._locked:
            return
        self._check_permission(f"resetting GPU {self.index} clocks")
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        with self._lock:
            self._advance(time.monotonic())
            self._changes.clear()  # scheduled changes not reached yet are overtaken by the reset
            self._mhz, self._locked = self._default_mhz, False
        self.log_event("reset", mhz=self._mhz)

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """The preset's SM clocks (MHz), highest first."""
        return self._supported

    def check_clock_permission(self) -> None:
        """Raise as NVML would without permission (KAREUS_SIMULATED_NO_PERMISSION); change nothing."""
        self._check_open()
        if not self._read_only:
            self._check_permission(f"locking GPU {self.index} clocks")

    def nvml_uuid(self) -> str:
        """A UUID of NVML's form, fixed by the GPU index (``GPU-00000000-...-<index>``)."""
        return f"GPU-00000000-0000-0000-0000-{self.index:012d}"

    def temperature_c(self) -> float:
        """Simulated GPU temperature (°C): a first-order lag toward the temperature of the mean power drawn
        since the last reading (see module doc). Commits nothing: edges that arrive later with earlier times
        still count at their own times."""
        self._check_open()
        with self._lock:
            energy, t_now = self._integrate(time.monotonic())[:2]
            t0, e0 = self._temp_at
            dt = t_now - t0
            if dt > 0:
                p_w = (energy - e0) / dt
                target = steady_temperature_c(p_w, float(self.spec.power_limit_w))
                self._temp_c = lagged_temperature_c(self._temp_c, target, dt)
                self._temp_at = (t_now, energy)
            return self._temp_c

    def energy_j(self) -> float:
        """Modelled GPU energy (J) since open."""
        self._check_open()
        with self._lock:
            self._advance(time.monotonic())
            return self._energy_j

    def energy_j_at(self, t: float) -> float:
        """Modelled energy (J) since open up to time `t` (time.monotonic(), s): the busy/idle edges given
        so far, then the present state up to `t`. Nothing is committed, so edges that arrive later
        with timestamps before `t` still count. A `t` before the last edge is read back at the present
        power (an approximation for readings that arrive out of order). A `t` in the future reads now."""
        self._check_open()
        t = min(t, time.monotonic())
        with self._lock:
            if t < self._t_last:
                return max(0.0, self._energy_j - self._power_w() * (self._t_last - t))
            return self._integrate(t)[0]

    # -- power limit -------------------------------------------------------------------------
    def power_limit_range_w(self) -> tuple[float, float]:
        """(min, max) power limit (W): base.min_power_limit_w of the preset, and its board limit."""
        return min_power_limit_w(self.spec), float(self.spec.power_limit_w)

    def power_limit_w(self) -> float:
        """Power limit (W) in force (read-only: the board limit; recorded calls change nothing)."""
        self._check_open()
        return self._power_limit_w

    def use_power_model(self, spec: GPUSpec) -> None:
        """Model power (W) with `spec`'s power fields from now on (a simulated truth's; the same GPU, clocks)."""
        with self._lock:
            self._advance(time.monotonic())
            self.spec = spec
        self._apply_power_limit(self._power_limit_w if self._limit_set else float(spec.power_limit_w))

    def _apply_power_limit(self, watts: float) -> None:
        with self._lock:
            self._advance(time.monotonic())
            self._power_limit_w = watts
            self._capped = self.spec if watts >= self.spec.power_limit_w else replace(self.spec, power_limit_w=watts)
            self._power_cache.clear()

    def set_power_limit_w(self, watts: float) -> None:
        """Cap the modelled power at `watts` (W) after the simulated NVML latency (read-only: recorded)."""
        self._check_open()
        lo, hi = self.power_limit_range_w()
        if not lo <= watts <= hi:
            raise ClockControlError(
                f"simulated {self.spec.name} cannot set a power limit of {watts:g} W; allowed: {lo:g}..{hi:g} W"
            )
        if self._read_only:
            self._record("power_limit", int(round(watts)))
            self._limit_set = True  # as if applied: a later reset is recorded too
            self.log_event("recorded", call="power_limit", w=watts)
            return
        self._check_permission(f"setting GPU {self.index}'s power limit to {watts:g} W")
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        self._apply_power_limit(float(watts))
        self._limit_set = True
        self.log_event("power_limit", w=float(watts))

    def reset_power_limit(self) -> None:
        """Restore the board limit if this object changed it (no-op otherwise; read-only: recorded)."""
        self._check_open()
        if not self._limit_set:
            return
        if self._read_only:
            self._record("power_limit_reset", None)
            self._limit_set = False
            self.log_event("recorded", call="power_limit_reset")
            return
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        self._apply_power_limit(float(self.spec.power_limit_w))
        self._limit_set = False
        self.log_event("power_limit_reset", w=self._power_limit_w)

    def close(self) -> None:
        """Reset a locked clock and a power limit this object set, log the close and release the log file."""
        if not self._open:
            return
        if self._limit_set:
            self.reset_power_limit()
        if self._locked and not self._deny:
            self.reset_clocks()
        self.log_event("close", mhz=self._mhz)
        self._open = False
        if self._log is not None:
            self._log.close()
