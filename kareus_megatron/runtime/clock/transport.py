"""What the clock client's two transports share: the flags the training thread reads, the link to the
controller (bytes out, reply lines in) and the answers to marks and requests.

A transport is chosen once, when the client is made (client.py): ``GpuTransport`` (transport_gpu.py: a
forwarder thread waits for each CUDA event, then passes the message on) or ``CpuTransport``
(transport_cpu.py: records gather on the training side and a sender thread writes them once per
coalescing window). Each implements the per-instruction path (``instruction_begins``,
``instruction_ends``, bound directly as the client's own methods), how a mark, a control request and
the end of the helper thread are sent, and the helper thread itself.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import ConfigError
from kareus_megatron.runtime.clock.wire import KINDS

KIND_CODE = {kind: k for k, kind in enumerate(KINDS)}  # instruction kind -> the d field of a begin record
_NAN = float("nan")


def coalesce_from_env(default_s: float) -> float:
    """The gathering window (s) from KAREUS_CLOCK_COALESCE_MS, else `default_s`."""
    raw = kareus_settings().clock_coalesce_ms
    if not raw:
        return default_s
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0 <= ms <= 1000:
        raise ConfigError(f"KAREUS_CLOCK_COALESCE_MS={raw!r} must be a number of milliseconds in 0..1000, e.g. 5")
    return ms / 1000.0


class MarkTicket:
    """The answer to one ``mark``: GPU-aligned time (time.monotonic(), s) and energy (J) at that point;
    ``info`` is the controller's whole answer (temperature_c °C, sm_clock_mhz MHz, stale and errors counts:
    decisions.py), None when there was none.

    Made at every iteration boundary, so it is small: waiting uses the transport's shared condition."""

    __slots__ = ("seq", "_transport", "done", "t", "energy_j", "info")

    def __init__(self, seq: int, transport: Transport | None = None) -> None:
        self.seq = seq
        self._transport = transport  # None: answered already (NaN: the controller is gone)
        self.done = transport is None
        self.t: float | None = None
        self.energy_j: float | None = None if transport is not None else _NAN
        self.info: Mapping[str, Any] | None = None  # the mark reply (wire.py MarkReply)

    def wait(self, timeout: float | None = 10.0) -> bool:
        """Wait for the answer; True once it has arrived."""
        if self.done or self._transport is None:
            return self.done
        return self._transport.wait_ticket(self, timeout)


class Transport:
    """The link to one controller; subclasses implement the per-instruction path and the helper thread."""

    HELPER = ""  # the helper thread is named kareus-clock-<HELPER>

    def __init__(self, coalesce_s: float) -> None:
        """`coalesce_s`: how long messages gather before one write (s)."""
        self.coalesce_s = coalesce_s
        # The per-instruction path reads only these two (recomputed by _refresh_sending).
        self.sending = False  # instruction messages go to the controller
        self.sending_ends = False  # ... and instruction ends too (a simulated GPU's busy power)
        self.clock_control = False
        self.want_ends = True
        self.closed = False
        self.gone = False
        self.counts: dict[str, int] | None = None  # the controller's decision counts, at close
        self._doorbell = threading.Event()  # wakes the helper thread
        self._parked = False  # the helper thread sleeps until rung (idle for a while)
        self._send: Callable[[bytes], None] | None = None
        self._backlog: Callable[[], bool] = lambda: False  # bytes the pipe has not taken yet
        self._seqs = itertools.count(1)  # next() is atomic: marks and requests from any thread
        self._tickets: dict[int, MarkTicket] = {}
        self._answered = threading.Condition(threading.Lock())  # tickets filled (reader thread)
        self._acks: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.ready: dict[str, Any] | None = None  # the controller's first message (ready or error)
        self._ready_event = threading.Event()
        self._helper = threading.Thread(target=self._run_helper, name=f"kareus-clock-{self.HELPER}", daemon=True)

    # -- connecting --------------------------------------------------------------------------
    def connect(self, send: Callable[[bytes], None]) -> None:
        """Write the byte stream with `send` (a controller in this process: its ``feed``)."""
        self._send = send

    def connect_pipe(self, fd: int) -> None:
        """Write the byte stream to the pipe `fd`; what a non-blocking pipe cannot take yet stays queued
        for a later write."""
        send_lock = threading.Lock()
        unsent = bytearray()

        def send(data: bytes) -> None:
            with send_lock:
                if data:
                    unsent.extend(data)
                while unsent:
                    try:
                        n = os.write(fd, unsent)
                    except BlockingIOError:
                        return  # the pipe is full: the rest goes with a later write
                    del unsent[:n]

        self._backlog = lambda: bool(unsent)
        self._send = send

    def read_replies(self, lines: Iterable[bytes]) -> None:
        """Reader thread (side process): handle each reply line until the controller's stdout closes."""
        for line in lines:
            line = line.strip()
            if line:
                self.on_reply(json.loads(line))
        self.controller_gone()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the controller's first message (or its end) has arrived."""
        return self._ready_event.wait(timeout_s)

    def begin(self, clock_control: bool, want_ends: bool) -> None:
        """The controller is ready: send what it needs (`want_ends`: instruction ends too), start helping."""
        self.clock_control = clock_control
        self.want_ends = want_ends
        self._refresh_sending()
        self._helper.start()

    def _refresh_sending(self) -> None:
        """Recompute the flags the per-instruction path reads (after any state they depend on changes)."""
        self.sending = (self.clock_control or self.want_ends) and not (self.closed or self.gone)
        self.sending_ends = self.sending and self.want_ends

    # -- replies -----------------------------------------------------------------------------
    def on_reply(self, msg: Mapping[str, Any]) -> None:
        """Handle one message from the controller (any thread)."""
        op = msg.get("op")
        if op in ("ready", "error") and self.ready is None:
            self.ready = dict(msg)
            self._ready_event.set()
        elif op == "mark":
            ticket = self._tickets.pop(msg["seq"], None)
            if ticket is not None:
                self._fill([ticket], [(msg.get("t"), float(msg["energy_j"]))], msg)
        elif op == "ack":
            if "counts" in msg:
                self.counts = msg["counts"]
            with self._lock:
                ev = self._acks.pop(msg.get("seq", 0), None)  # seqs start at 1
            if ev is not None:
                ev.set()

    def controller_gone(self) -> None:
        """The controller ended (closed, killed): wake every waiter; later marks answer NaN at once."""
        self.gone = True
        self._refresh_sending()
        self._ready_event.set()
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
            acks, self._acks = list(self._acks.values()), {}
        self._fill(tickets, [(None, _NAN)] * len(tickets))
        for ev in acks:
            ev.set()

    def _fill(
        self,
        tickets: list[MarkTicket],
        answers: list[tuple[float | None, float]],
        info: Mapping[str, Any] | None = None,
    ) -> None:
        with self._answered:
            for ticket, (t, energy_j) in zip(tickets, answers):
                ticket.t, ticket.energy_j, ticket.info, ticket.done = t, energy_j, info, True
            self._answered.notify_all()

    # -- marks and requests (any thread) -----------------------------------------------------
    def mark(self) -> MarkTicket:
        """Hand over a measurement point; the ticket fills with its GPU-aligned time and energy."""
        if self.closed or self.gone:
            return MarkTicket(0)  # answered: NaN
        seq = next(self._seqs)
        ticket = self._tickets[seq] = MarkTicket(seq, self)
        self._send_mark(seq)
        if self.gone and self._tickets.pop(seq, None) is not None:  # it went away meanwhile
            self._fill([ticket], [(None, _NAN)])
        return ticket

    def wait_ticket(self, ticket: MarkTicket, timeout: float | None) -> bool:
        """Wait up to `timeout` s for `ticket`'s answer; True once it has arrived."""
        with self._answered:
            return self._answered.wait_for(lambda: ticket.done, timeout)

    def request(self, op: str, timeout_s: float) -> bool:
        """Send control message `op` (``reset``, ``close``) after everything before it; wait for its ack."""
        if self.gone:
            return False
        seq = next(self._seqs)
        with self._lock:
            ev = self._acks[seq] = threading.Event()
        self._send_control({"op": op, "seq": seq})
        return ev.wait(timeout_s)

    def shut(self) -> None:
        """After ``close``: the per-instruction path stops sending and the helper thread ends."""
        self.closed = True
        self._refresh_sending()
        self._stop_helper()

    def _send_bytes(self, data: bytes) -> bool:
        """Write `data` to the controller; False (and every waiter woken) once it is gone."""
        try:
            assert self._send is not None
            self._send(data)
        except (BrokenPipeError, OSError, ValueError):
            self.controller_gone()  # it reset the clocks on its way out
            return False
        return True

    # -- per transport -----------------------------------------------------------------------
    def instruction_begins(self, iteration: int, index: int, mhz: int, kind: str, power_w: float = _NAN) -> None:
        """Training thread: instruction `index` of `iteration` (`kind`) begins at `mhz` MHz; a simulated GPU
        draws `power_w` W while it runs (NaN: its own power model; wire.py's begin record, field e)."""
        raise NotImplementedError

    def instruction_ends(self) -> None:
        """Training thread: the running instruction ends (only a simulated GPU needs it)."""
        raise NotImplementedError

    def _send_mark(self, seq: int) -> None:
        raise NotImplementedError

    def _send_control(self, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    def _run_helper(self) -> None:
        raise NotImplementedError

    def _stop_helper(self) -> None:
        raise NotImplementedError
