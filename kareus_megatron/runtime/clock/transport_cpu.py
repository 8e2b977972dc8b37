"""CPU transport: records gathered on the training side, written by a sender thread once per window.

On a CPU there is nothing to wait for: a message's time is when it is handed over
(``time.monotonic()``). The training thread only appends a record of ``wire.RECORD_FIELDS`` floats (no
lock, no write; an instruction's end is only noted and rides along with the next record), and the sender
thread writes what has gathered once per *coalescing window* (KAREUS_CLOCK_COALESCE_MS; default
``CPU_COALESCE_S``, 250 ms) in one non-blocking write to the controller's pipe (what the pipe cannot take
yet stays queued). The sender and the reply reader keep the trainer's scheduling (sched.py: threads of the trainer
share its GIL). Every message carries its own time, and the simulated GPU accounts busy and
idle power by those times, so the window only delays when a clock change is made, by at most one
window; it keeps the side channel to a few wake-ups a second, which matters when the trainers already
use every core. Marks are *lazy*: the controller holds their answers until the client waits for one.
"""

from __future__ import annotations

import os
import threading
from array import array
from collections.abc import Iterable
from time import monotonic
from typing import Any

from kareus_megatron.runtime.clock.transport import KIND_CODE, MarkTicket, Transport
from kareus_megatron.runtime.clock.wire import CODE_BEGIN, CODE_MARK, NO_POWER, NO_TIME, encode_control, encode_records

CPU_COALESCE_S = 0.25  # default gathering window (s)
MIN_WAKE_S = 0.005  # the sender thread sleeps at least this long between looks (s)


class CpuTransport(Transport):
    """Records appended on the training thread; a sender thread writes them per window."""

    HELPER = "sender"

    def __init__(self, coalesce_s: float) -> None:
        super().__init__(coalesce_s)
        self._recs = array("d")  # gathering records, sent by whichever thread finds them due
        self._out_since = 0.0  # hand-over time (s) of the oldest record in _recs
        self._out_lock = threading.Lock()  # one sender at a time, so batches leave in order
        self._stopping = False
        self._idle_from = NO_TIME  # end of the last instruction (s), sent with the next record

    def connect_pipe(self, fd: int) -> None:
        """As Transport.connect_pipe, non-blocking: the training thread writes (a request, a mark's
        wait), and a full pipe must not block it."""
        os.set_blocking(fd, False)
        super().connect_pipe(fd)

    def read_replies(self, lines: Iterable[bytes]) -> None:
        """As Transport.read_replies (replies are only waited for when the meter publishes)."""
        super().read_replies(lines)

    # -- training thread ---------------------------------------------------------------------
    def _append(self, code: float, a: float, b: float = 0.0, c: float = 0.0, d: float = 0.0, e: float = 0.0) -> None:
        now = monotonic()
        idle, self._idle_from = self._idle_from, NO_TIME  # the previous instruction's end rides along
        recs = self._recs
        if not recs:
            self._out_since = now
        recs.extend((code, now, idle, a, b, c, d, e))
        if self._parked:
            self._doorbell.set()

    def instruction_begins(self, iteration: int, index: int, mhz: int, kind: str, power_w: float = NO_POWER) -> None:
        """Append "instruction `index` of `iteration` (`kind`) begins now at `mhz` MHz" (training thread;
        `power_w`: a simulated truth's busy power, W). ``_append`` written out: this runs at every instruction."""
        if self.sending:
            now = monotonic()
            idle, self._idle_from = self._idle_from, NO_TIME  # the previous instruction's end rides along
            recs = self._recs
            if not recs:
                self._out_since = now
            recs.extend((CODE_BEGIN, now, idle, iteration, index, mhz, KIND_CODE.get(kind, -1), power_w))
            if self._parked:
                self._doorbell.set()

    def instruction_ends(self) -> None:
        """Note "the running instruction ends now" (training thread): no record, no queue operation."""
        if self.sending_ends:
            self._idle_from = monotonic()

    def _send_mark(self, seq: int) -> None:
        self._append(CODE_MARK, seq, 1.0)  # lazy: read when the meter publishes, held there until asked

    def wait_ticket(self, ticket: MarkTicket, timeout: float | None) -> bool:
        """As Transport.wait_ticket; first asks for the answer (the mark may still be gathering here,
        its answer held by the controller)."""
        if not ticket.done:
            self._ask_answers()
        return super().wait_ticket(ticket, timeout)

    def _send_control(self, msg: dict[str, Any]) -> None:
        self._push(msg)

    # -- sending (any thread) ----------------------------------------------------------------
    def _push(self, control: dict[str, Any] | None = None) -> bool:
        """Send every gathered record now, then `control`; False once the controller is gone."""
        with self._out_lock:
            recs = self._recs
            n = len(recs)  # the training thread may append meanwhile: those stay for the next push
            data = encode_records(recs[:n]) if n else b""
            del recs[:n]
            if control is not None:
                data += encode_control(control)
            if not data and not self._backlog():
                return True
            return self._send_bytes(data)

    def _ask_answers(self) -> None:
        """Send what is gathering and ask the controller for the answers to marks it holds."""
        if not (self.closed or self.gone):
            self._push({"op": "answer"})

    def _run_helper(self) -> None:
        """Sender thread: send the gathered records once per window; park when nothing comes for a while."""
        window = self.coalesce_s
        idle_since = monotonic()
        while not self._stopping:
            now = monotonic()
            if self._recs or self._backlog():
                idle_since = now
                if now - self._out_since >= window or self._backlog():
                    if not self._push():
                        return
            elif now - idle_since >= 1.0:
                self._parked = True  # idle: sleep until an append rings
                if not (self._recs or self._stopping):
                    self._doorbell.wait()
                self._parked = False
                self._doorbell.clear()
                idle_since = monotonic()
                continue
            self._doorbell.wait(max(MIN_WAKE_S, window - (monotonic() - self._out_since) if self._recs else window))
            self._doorbell.clear()

    def _stop_helper(self) -> None:
        self._stopping = True
        self._doorbell.set()
