"""Clock controller: applies each instruction's planned SM clock to one GPU, off the training thread.

Input (wire.py), decision path, start probe, resets and replies: docs/clock_latency.md#the-clock-controller.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kareus_megatron.errors import ClockControlError, KareusError
from kareus_megatron.hardware.device.base import GPUDevice, SimulationHooks
from kareus_megatron.runtime.clock.decisions import HOLD_MARKS, Begin, Decisions, QueuedBegin, route_control
from kareus_megatron.runtime.clock.power_samples import WallSampler
from kareus_megatron.runtime.clock.timeline import SimulatedTimeLine
from kareus_megatron.runtime.clock.wire import (
    CODE_BEGIN,
    CODE_MARK,
    ErrorReply,
    FrameReader,
    MarkReply,
    ReadyReply,
    Reply,
)
from kareus_megatron.runtime.closed_loop.truth import apply_truth_power

_POLL_S = 0.2
TEMPERATURE_EVERY_S = 1.0  # a simulated GPU's sensor is read at most this often (s; its thermal lag is ~20 s)
ReplyFn = Callable[[Reply], None]


def _nothing() -> None:
    pass


class ClockController:
    """Applies clock changes to one device in order, skipping stale ones; `feed`/`submit` are thread-safe."""

    def __init__(
        self,
        device: GPUDevice,
        reply: ReplyFn,
        *,
        simulation: SimulationHooks | None = None,
        log_path: str | None = None,
        reply_many: Callable[[list[MarkReply]], None] | None = None,
        power_limit_w: float | None = None,
        power: tuple[Callable[[], float], str] | None = None,
    ) -> None:
        """Control `device`; `simulation`: its SimulationHooks when it is a simulated GPU (None: NVML);
        `power`: NVML's board power reader and its reading (hardware.device.power_reader_of), sampled on a thread.
        `reply` sends messages back (`reply_many`, when given, several at once: the energy marks of one
        batch leave in one write); `log_path` gets the decisions (a simulated GPU logs to its own log)."""
        self.device = device
        self.simulation = simulation
        self.power_limit_w = power_limit_w  # a powercap plan's board limit (W): set at start, restored at exit
        self._reply = reply
        self._reply_many = reply_many
        self.decisions = Decisions(device.index, simulation, log_path)
        # late: a call made more than half a clock latency (s) after its instruction began (decisions.py)
        self.decisions.late_after_s = 0.5 * (
            device.spec.clock_latency_s if simulation is None else simulation.latency_s
        )
        # Items for the control loop: begins as (mhz, iteration, index, kind, t), ("stale", n), control dicts.
        self._inbox: queue.Queue[list[Any]] = queue.Queue()
        self._held: list[MarkReply] = []  # answers to lazy marks not sent yet
        self._frames = FrameReader()
        self._stop = threading.Event()
        self._close_seq: Any = None
        self._power: WallSampler | None = None  # NVML: the power sampler thread
        # Chosen once: wall time (NVML), or the simulated time line.
        self._take_records: Callable[[list[Any], list[Any], list[MarkReply], list[MarkReply]], bool]
        if simulation is None:
            self._take_records, self._reset_clocks, self._settle = self._take_wall, device.reset_clocks, _nothing
            self.decisions.read_temperature_c = device.temperature_c  # at every mark, beside the energy
            self._power = None if power is None else WallSampler(*power)  # off this loop (power_samples.py)
        else:
            line = SimulatedTimeLine(device, simulation, self.decisions)
            self._take_records, self._reset_clocks, self._settle = line.take, line.reset_clocks, line.settle
        self._temperature: tuple[float, float | None] = (float("-inf"), None)  # simulated: (read at s, °C)

    @property
    def counts(self) -> dict[str, int]:
        """Decisions so far: applied, stale, unchanged, errors."""
        return self.decisions.counts

    @property
    def clock_control(self) -> bool:
        """False once ``probe`` found that clocks may not be locked (energy is still answered)."""
        return self.decisions.clock_control

    # -- start -------------------------------------------------------------------------------
    def probe(self) -> ReadyReply | ErrorReply:
        """Check clock permission (``device.check_clock_permission``); return the ``ready`` (or ``error``)
        message."""
        sim = self.simulation
        read_only = self.device.read_only
        try:
            if sim is not None:  # a simulated truth (KAREUS_SIMULATED_TRUTH): its power fields, blocked power too
                apply_truth_power(sim, self.device.spec)
        except KareusError as e:
            return {"op": "error", "type": type(e).__name__, "message": str(e), "busy_events": True}
        try:
            self.device.check_clock_permission()
            self.decisions.reset(self.device.spec.max_sm_clock_mhz, "start")
        except ClockControlError as e:
            self.decisions.clock_control = False
            return {"op": "error", "type": type(e).__name__, "message": str(e), "busy_events": sim is not None}
        if self.power_limit_w is not None:
            try:
                self.device.set_power_limit_w(self.power_limit_w)
            except ClockControlError as e:
                return {"op": "error", "type": type(e).__name__, "message": str(e), "busy_events": sim is not None}
            self.decisions.clock_control = False  # powercap locks no clock: the driver clocks under the cap
        return {
            "op": "ready",
            "gpu": self.device.spec.name,
            "backend": "nvml" if sim is None else "simulated",
            "supported": list(self.device.supported_sm_clocks_mhz()),
            "busy_events": sim is not None,  # only a simulated GPU needs instruction ends (busy power)
            "latency_s": None if sim is None else sim.latency_s,  # a simulated clock call's duration
            "pid": os.getpid(),
            "power_limit_w": self.power_limit_w,
            "read_only": read_only,
        }

    # -- input (any thread) ------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Accept bytes of the input stream (records and control lines, see wire.py)."""
        items = self._frames.feed(data)
        if items:
            self._take(items)

    def submit(self, msg: dict[str, Any]) -> None:
        """Accept one control message (``reset``, ``close``, ``answer``, ``parent_gone``)."""
        self._take([msg])

    def _take(self, items: list[Any]) -> None:
        """Handle what arrived, in order: marks are answered at once, in this thread, so a clock call in
        progress never delays them; clock changes, resets and close go to the control loop in order."""
        rest: list[Any] = []
        answers: list[MarkReply] = []
        n_held = len(self._held)
        release = self._take_records(items, rest, answers, self._held)
        if self.simulation is not None and (answers or len(self._held) > n_held):
            self._stamp_temperature(answers + self._held[n_held:])
        # Lazy marks (a CPU client reads them only when it publishes) leave in groups of HOLD_MARKS, or
        # when asked (``answer``), or before a reset/close is acknowledged.
        if self._held and (len(self._held) >= HOLD_MARKS or release):
            answers, self._held = self._held + answers, []
        if answers and self._reply_many is not None:
            self._reply_many(answers)
        else:
            for answer in answers:
                self._reply(answer)
        if rest:
            self._inbox.put_nowait(rest)

    def _stamp_temperature(self, answers: list[MarkReply]) -> None:
        """A simulated GPU: put its temperature (°C; read at most every TEMPERATURE_EVERY_S) on `answers`."""
        now = time.monotonic()
        at, value = self._temperature
        if now - at >= TEMPERATURE_EVERY_S:
            value = self.decisions.temperature_c(self.device.temperature_c)
            self._temperature = (now, value)
        for answer in answers:
            answer["temperature_c"] = value

    def _take_wall(self, items: list[Any], rest: list[Any], answers: list[MarkReply], held: list[MarkReply]) -> bool:
        """NVML: begins go to `rest` for the control loop (without a decision log only the last begin of
        a block, with the number it overtook); a mark is answered with the energy counter now (its
        record left the client when the GPU reached the point). Return whether held answers go out."""
        dec = self.decisions
        each = dec.logging and dec.clock_control
        read = self.device.energy_j
        release = False
        for item in items:
            if isinstance(item, dict):
                release = route_control(item, rest) or release
                continue
            last = None
            overtaken = same = 0
            it = iter(item)
            for code, t, _idle, a, b, c, d, _e in zip(it, it, it, it, it, it, it, it):
                if code == CODE_BEGIN:
                    if each:
                        rest.append((int(c), int(a), int(b), int(d), t))  # mhz, iteration, index, kind, t
                    elif last is not None and last[0] == c:  # the clock the begin before asked for: no change
                        same += 1
                    else:
                        overtaken += last is not None
                        last = (c, a, b, d, t)
                elif code == CODE_MARK:
                    answer = dec.mark(int(a), t, read)
                    if self._power is not None:  # the power samples since the previous mark
                        answer["power"] = self._power.take(t)
                    (held if b else answers).append(answer)
            if last is not None:
                if overtaken:
                    rest.append(("stale", overtaken))
                if same:
                    rest.append(("same", same))
                rest.append((int(last[0]), int(last[1]), int(last[2]), int(last[3]), last[4]))
        return release

    # -- control loop ------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (it resets clocks on the way out)."""
        self._stop.set()
        self._inbox.put([{"op": "_wake"}])

    def run(self, parent_alive: Callable[[], bool] = lambda: True) -> str:
        """Serve until close, stop or parent death; always reset clocks; return why it ended."""
        why = "stopped"
        if self._power is not None:
            self._power.start()
        try:
            while not self._stop.is_set():
                try:
                    first = self._inbox.get(timeout=_POLL_S)
                except queue.Empty:
                    if not parent_alive():
                        why = "parent-gone"
                        break
                    continue
                batch = list(first)
                while True:
                    try:
                        batch.extend(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                ended = self._handle(batch)
                if ended:
                    why = ended
                    break
                if not parent_alive():
                    why = "parent-gone"
                    break
        finally:
            self._final_reset(why)
        return why

    def _handle(self, batch: list[Any]) -> str | None:
        """One pass over what is queued: the latest begin wins and is applied at the end (a begin asking
        for the clock the pending one asks for changes nothing: unchanged, the pending one keeps its begin time);
        a reset or close first settles the begins before it."""
        dec = self.decisions
        pending: QueuedBegin | None = None
        for item in batch:
            if isinstance(item, tuple):
                if item[0] == "stale":  # begins overtaken within one block (not logged one by one)
                    dec.overtaken(item[1])
                    continue
                if item[0] == "same":  # begins of one block asking for the clock the one before asked for
                    dec.overtaken(item[1], "unchanged")
                    continue
                if pending is not None:
                    if item[0] == pending[0]:  # the clock the pending begin asks for: no new change
                        dec.skip(item, "unchanged")
                        continue
                    dec.skip(pending, "stale")  # a begin overtakes the pending one
                pending = item
                continue
            op = item.get("op")
            if op in ("reset", "close", "parent_gone"):
                if pending is not None:
                    dec.skip(pending, "stale")
                    pending = None
                self._settle()  # the simulated time line's waiting call (NVML: nothing)
                if op == "reset":
                    self._reset("requested")
                    self._reply({"op": "ack", "seq": item.get("seq")})
                elif op == "close":
                    self._close_seq = item.get("seq")
                    return "closed"
                else:
                    return "parent-gone"
        if pending is not None:
            self._apply((pending[0], pending[1], pending[2], pending[3]), float(pending[4]))
        return None

    def _apply(self, begin: Begin, t_begin: float) -> None:
        """Lock `begin`'s clock now, in wall time (blocks for the driver call); its instruction began at
        `t_begin` (s, time.monotonic())."""
        dec = self.decisions
        if not dec.wanted(begin):
            return
        t_call = time.monotonic()
        try:
            self.device.set_sm_clock_mhz(begin[0])
        except KareusError as e:
            dec.failed(begin, e)
            return
        dec.applied(begin, t_call - t_begin)

    def _reset(self, reason: str) -> None:
        if not self.decisions.clock_control:
            return
        try:
            self._reset_clocks()
        except KareusError as e:
            self.decisions.error(str(e), reason=reason)
            return
        self.decisions.reset(self.device.spec.max_sm_clock_mhz, reason)

    def _final_reset(self, why: str) -> None:
        if self._power is not None:
            self._power.stop()
        self._reset(why)
        if self.power_limit_w is not None:  # the limit this controller set (a device restores only its own)
            try:
                self.device.reset_power_limit()
            except KareusError as e:
                self.decisions.error(str(e), reason=why)
        try:
            self.device.close()
        except KareusError:
            pass
        self.decisions.close()
        if why == "closed":
            self._reply({"op": "ack", "seq": self._close_seq, "counts": dict(self.counts)})
