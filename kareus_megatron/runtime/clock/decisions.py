"""The clock controller's bookkeeping: which clock is locked, decision counts and the decision log.

A *begin* is ``(mhz, iteration, index, kind)`` (kind: index into ``wire.KINDS``). Decisions are
``set`` (the clock was locked; *late* when the call was made more than ``late_after_s`` after its
instruction began: half the device's clock latency, so the plan's lag model is off by more than that),
``skip`` with reason ``stale`` (a later instruction had begun before the
call could be made) or ``unchanged`` (that clock is locked already), ``reset`` (with a reason) and
``error``. The answer to a *mark* (a measurement point) carries, besides its time (s) and energy (J),
what the run log records per iteration: the GPU temperature (°C; ``temperature_c``, null when unknown),
the clock locked then (``sm_clock_mhz``, MHz; null when none is locked) and the running ``applied``,
``late``, ``stale`` and ``errors`` counts (the meter takes their differences between an iteration's two marks).
Log lines are ``{"t", "pid", "gpu", "event", "mhz", "reason"?, "iteration", "index", "kind"}``
(t: ``time.monotonic()`` s). With NVML the controller writes them to its own log (``--log``); a
simulated GPU keeps one log for everything and writes its own ``set``/``reset`` lines (with
``t_issue``/``t_done`` on its time line), so only ``skip`` and ``error`` come from here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from kareus_megatron.errors import KareusError
from kareus_megatron.hardware.device.base import SimulationHooks
from kareus_megatron.jsonl import JsonlAppender
from kareus_megatron.runtime.clock.wire import KINDS, MarkReply

HOLD_MARKS = 256  # answers to lazy marks sent together at most (the client asks when it publishes)
RELEASE_OPS = ("answer", "reset", "close", "parent_gone")  # control messages that release held answers


def route_control(msg: dict[str, Any], rest: list[Any]) -> bool:
    """Queue control message `msg` for the control loop (``answer`` needs none); True if it releases
    the held mark answers."""
    op = msg.get("op")
    if op != "answer":
        rest.append(msg)
    return op in RELEASE_OPS


Begin = tuple[int, int, int, int]  # mhz, iteration, index, kind
QueuedBegin = tuple[int, int, int, int, float]  # a Begin and its begin time (s, time.monotonic())
Writer = Callable[..., None]  # (event, **fields)


class Decisions:
    """Counts and logs the controller's decisions for GPU `gpu_index`; remembers the locked clock (MHz)."""

    def __init__(self, gpu_index: int, simulation: SimulationHooks | None, log_path: str | None) -> None:
        """Log to `simulation`'s own log when given, else to `log_path` (None: count only)."""
        self._gpu = gpu_index
        self._file: JsonlAppender | None = None
        self._own: Writer | None  # set/reset lines (a simulated GPU writes its own)
        self._note: Writer | None  # skip/error lines
        if simulation is not None:
            self._own, self._note = None, simulation.log_event
            self.logging = simulation.logging
        elif log_path:
            self._file = JsonlAppender(log_path)
            self._own = self._note = self._write
            self.logging = True
        else:
            self._own = self._note = None
            self.logging = False  # without a log, skips only count (the common case)
        self.locked_mhz: int | None = None
        self.clock_control = True  # False once the start probe found no permission
        self.counts = {"applied": 0, "late": 0, "stale": 0, "unchanged": 0, "errors": 0}
        self.late_after_s = 0.0  # a call made more than this (s) after its begin is late (the controller sets it)
        # Read at every mark (NVML: device.temperature_c); None: not read there (a simulated GPU's time
        # line stamps its answers itself, timeline.py) or no sensor (after a failed reading).
        self.read_temperature_c: Callable[[], float] | None = None

    def _write(self, event: str, **fields: Any) -> None:
        assert self._file is not None
        self._file.write({"t": time.monotonic(), "pid": os.getpid(), "gpu": self._gpu, "event": event, **fields})

    @staticmethod
    def context(begin: Begin | QueuedBegin) -> dict[str, Any]:
        """The log fields naming `begin`'s instruction."""
        iteration, index, kind = begin[1], begin[2], begin[3]
        return {"iteration": iteration, "index": index, "kind": KINDS[kind] if 0 <= kind < len(KINDS) else kind}

    def wanted(self, begin: Begin) -> bool:
        """Whether `begin`'s clock is to be locked: clock control works and another clock is locked
        (a clock already locked is skipped here, reason ``unchanged``)."""
        if not self.clock_control:
            return False  # begins arrive only for a simulated GPU's power accounting
        if begin[0] == self.locked_mhz:
            self.skip(begin, "unchanged")
            return False
        return True

    def skip(self, begin: Begin | QueuedBegin, reason: str) -> None:
        """`begin` was not applied, for `reason` (``stale`` or ``unchanged``)."""
        if not self.clock_control:
            return
        self.counts[reason] += 1
        if self.logging and self._note is not None:
            self._note("skip", mhz=begin[0], reason=reason, **self.context(begin))

    def overtaken(self, n: int, reason: str = "stale") -> None:
        """`n` begins of one block were overtaken before reaching the control loop (counted, not logged);
        reason ``unchanged``: they asked for the clock the begin before them asked for."""
        if self.clock_control:
            self.counts[reason] += n

    def applied(self, begin: Begin, delay_s: float = 0.0) -> None:
        """`begin`'s clock is locked, by a call made `delay_s` (s) after its instruction began."""
        self.locked_mhz = begin[0]
        self.counts["applied"] += 1
        late = delay_s > self.late_after_s
        self.counts["late"] += late
        if self._own is not None:
            self._own("set", mhz=begin[0], **self.context(begin), **({"late_s": delay_s} if late else {}))

    def failed(self, begin: Begin, error: KareusError) -> None:
        """Locking `begin`'s clock raised `error`; the locked clock is unchanged."""
        self.counts["errors"] += 1
        if self._note is not None:
            self._note("error", mhz=begin[0], message=str(error), **self.context(begin))

    def error(self, message: str, **fields: Any) -> None:
        """Log an error that is not a clock change (a reset or an energy reading that failed)."""
        if self._note is not None:
            self._note("error", message=message, **fields)

    def reset(self, mhz: int, reason: str) -> None:
        """Clocks were reset (the driver runs at `mhz` MHz again), for `reason`."""
        self.locked_mhz = None
        if self._own is not None:
            self._own("reset", mhz=mhz, reason=reason)

    def temperature_c(self, read: Callable[[], float] | None) -> float | None:
        """`read()` (GPU temperature, °C), or None when `read` is None or fails (then logged once and no
        longer read at marks)."""
        if read is None:
            return None
        try:
            return float(read())
        except KareusError as e:
            self.read_temperature_c = None  # a sensor that fails once is not asked at every mark
            self.error(f"reading the temperature: {e}")
            return None

    def mark(self, seq: int, t: float, read_energy_j: Callable[..., float], *args: float) -> MarkReply:
        """The ``mark`` reply for measurement point `seq` at `t` (s): energy (J) ``read_energy_j(*args)``,
        NaN (and an error line) when the reading fails; temperature (°C), locked clock (MHz) and the
        stale/errors counts so far (see the module doc)."""
        try:
            energy = float(read_energy_j(*args))
        except KareusError as e:
            energy = float("nan")
            self.error(str(e))
        counts = self.counts
        return {
            "op": "mark",
            "seq": seq,
            "t": t,
            "energy_j": energy,
            "temperature_c": self.temperature_c(self.read_temperature_c),
            "sm_clock_mhz": self.locked_mhz,
            "applied": counts["applied"],
            "late": counts["late"],
            "stale": counts["stale"],
            "errors": counts["errors"],
        }

    def close(self) -> None:
        """Close the controller's own log file (a simulated GPU closes its log itself)."""
        if self._file is not None:
            self._file.close()
