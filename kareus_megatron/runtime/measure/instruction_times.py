"""Per-instruction times for the run log: when each planned instruction of an iteration began and how long it ran.

The columns of one iteration line (runtime/measure/measurement.py), in the order the instructions ran::

    "instructions": {"index": [k..], "chunk": [..], "microbatch": [..], "kind": "FBFB..",
                     "sm_clock_mhz": [..], "t_start_s": [..], "time_s": [..]}

``index`` is the instruction's position in this rank's plan, ``kind`` one letter per instruction (F forward,
B backward), ``sm_clock_mhz`` the clock the plan asked for (MHz; what ran is the controller's business:
the iteration's ``sm_clock_mhz``/``clock_stale`` say whether it got there), ``t_start_s`` the start (s)
after the iteration's own start, ``time_s`` the duration (s); null where unknown (an instruction that
never ended, events the GPU had not reached).

Timing: a *stamp* is taken at every instruction's begin and end on the training thread, and nothing else:
one list append each (chunk, microbatch, kind and clock are looked up in the plan by the writer). On a
CPU a stamp is ``time.monotonic()``; on a GPU it is a CUDA timing event recorded on the current stream
(``TimingEvents``, a pool: events come back once read), read by the meter's writer thread with
``elapsed_time`` only after the iteration's end mark has resolved, i.e. after the GPU passed every
event of the iteration, so reading needs no device synchronisation (a stamp it had not passed reads
null rather than wait). The writer reads under the training thread's CUDA device (``torch.cuda.device``,
taken when the pool is made at validation): a thread that never set its device works on device 0, so on a
multi-GPU node every rank > 0 would otherwise make a CUDA context there (as ``CudaEvents.bind_thread`` does
for the clock client's forwarder). KAREUS_LOG_INSTRUCTIONS=0 turns the columns off (default 1).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import ConfigError

INSTRUCTIONS_ENV = "KAREUS_LOG_INSTRUCTIONS"
KIND_LETTER = {"forward": "F", "backward": "B"}
_DIGITS = 9  # times are written to the ns (s, 9 decimals)
Begins = Callable[[int, int, int, str], None]
Table = tuple[tuple[int, int, str, int], ...]  # per plan index: (chunk, microbatch, kind letter, MHz)


def instructions_from_env() -> bool:
    """Whether the per-instruction columns are logged: KAREUS_LOG_INSTRUCTIONS 1 (default) or 0."""
    raw = kareus_settings().log_instructions
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ConfigError(f"{INSTRUCTIONS_ENV}={raw!r} must be 1 (log each instruction's time, the default) or 0 (off)")


class TimingEvents:
    """CUDA timing events from a pool (training thread: take and record; writer thread: read and give back)."""

    def __init__(self, torch_module: Any) -> None:
        """`torch_module`: torch (or a stand-in); made on the training thread, whose current CUDA device the
        events are recorded on and read under."""
        self._cuda = torch_module.cuda
        self.device = int(self._cuda.current_device())
        self._free: deque[Any] = deque()

    @classmethod
    def available(cls) -> TimingEvents | None:
        """A pool when torch is loaded and sees a CUDA device, else None (CPU stamps)."""
        torch = sys.modules.get("torch")
        try:
            return cls(torch) if torch is not None and torch.cuda.is_available() else None
        except Exception:  # a broken CUDA install: time on the CPU
            return None

    def __call__(self) -> Any:
        """An event recorded on the current stream now (training thread)."""
        try:
            ev = self._free.pop()
        except IndexError:
            ev = self._cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, base: Any, stamps: list[Any]) -> list[float | None]:
        """Each stamp's time (s) after `base`, null where the GPU has not passed it (writer thread, under the
        training thread's device)."""
        out: list[float | None] = []
        with self._cuda.device(self.device):
            for ev in stamps:
                try:
                    out.append(base.elapsed_time(ev) / 1000.0 if ev.query() else None)
                except Exception:  # not recorded, or a device error: unknown
                    out.append(None)
        return out

    def give_back(self, events: list[Any]) -> None:
        self._free.extend(events)


def _cpu_seconds(base: Any, stamps: list[Any]) -> list[float | None]:
    return [s - base for s in stamps]


class InstructionTimes:
    """Stamps of the running iteration (training thread) and its columns (writer thread)."""

    def __init__(self, events: TimingEvents | None = None) -> None:
        """`events`: a GPU's timing events; None: CPU stamps (time.monotonic)."""
        self._events = events
        self._stamp: Callable[[], Any] = events if events is not None else time.monotonic
        self._seconds = events.seconds if events is not None else _cpu_seconds
        self._stamps: list[Any] = []  # (index, begin stamp) tuples and bare end stamps, in order
        self._base: Any = None
        self.table: Table = ()

    def set_plan(self, instructions: Sequence[Any]) -> None:
        """This rank's planned instructions (kind, chunk, microbatch, sm_clock_mhz), by plan index."""
        self.table = tuple(
            (int(i.chunk), int(i.microbatch), KIND_LETTER.get(i.kind, "?"), int(i.sm_clock_mhz)) for i in instructions
        )

    def wrap(self, begins: Begins, ends: Callable[[], None]) -> tuple[Begins, Callable[[], None]]:
        """`begins`/`ends` with a stamp first at a begin and last at an end (so whatever they do, e.g. a
        simulated stretch, counts as the instruction's time)."""
        append, stamp = self._stamps.append, self._stamp

        def timed_begins(iteration: int, index: int, mhz: int, kind: str) -> None:
            append((index, stamp()))
            begins(iteration, index, mhz, kind)

        def timed_ends() -> None:
            ends()
            append(stamp())

        return timed_begins, timed_ends

    def start(self) -> None:
        """The iteration begins (training thread, right after its start mark): a fresh base stamp."""
        dropped = self._stamps[:]  # stamps outside an iteration (e.g. announced and never ended)
        self._stamps.clear()
        if self._events is not None and dropped:
            self._events.give_back([s[1] if isinstance(s, tuple) else s for s in dropped])
        self._base = self._stamp()

    def take(self) -> tuple[Any, list[Any], Table] | None:
        """The iteration ends (training thread, right after its end mark): its stamps, for ``columns``."""
        if self._base is None:
            return None
        taken = (self._base, self._stamps[:], self.table)
        self._stamps.clear()
        self._base = None
        return taken

    def columns(self, taken: tuple[Any, list[Any], Table] | None) -> dict[str, Any] | None:
        """The ``instructions`` object of a taken iteration (writer thread, after its end mark resolved)."""
        if taken is None:
            return None
        base, stamps, table = taken
        rows: list[tuple[int, Any, Any]] = []  # (index, begin stamp, end stamp or None)
        for s in stamps:
            if isinstance(s, tuple):
                rows.append((s[0], s[1], None))
            elif rows and rows[-1][2] is None:
                rows[-1] = (rows[-1][0], rows[-1][1], s)  # an end closes the open begin (others: unplanned)
        flat = [x for _, b, e in rows for x in (b, e) if x is not None]
        secs = iter(self._seconds(base, flat))
        starts: list[float | None] = []
        times: list[float | None] = []
        for _, _, e in rows:
            t0 = next(secs)
            t1 = next(secs) if e is not None else None
            starts.append(None if t0 is None else round(t0, _DIGITS))
            times.append(None if t0 is None or t1 is None else round(t1 - t0, _DIGITS))
        if self._events is not None:
            self._events.give_back([base, *flat])
        keep = [n for n, (k, _, _) in enumerate(rows) if 0 <= k < len(table)]  # indices of this plan only
        known = [table[rows[n][0]] for n in keep]
        return {
            "index": [rows[n][0] for n in keep],
            "chunk": [c[0] for c in known],
            "microbatch": [c[1] for c in known],
            "kind": "".join(c[2] for c in known),
            "sm_clock_mhz": [c[3] for c in known],
            "t_start_s": [starts[n] for n in keep],
            "time_s": [times[n] for n in keep],
        }
