"""Clock client: the training side of the clock controller (see runtime/clock_controller.py).

The training thread only enqueues ("instruction begins/ends", "mark"). On a GPU a forwarder thread
waits for GPU progress (a CUDA event recorded at the instruction boundary) and passes on what has been
reached. On a CPU there is nothing to wait for (timestamps are the enqueue time, ``time.monotonic()``):
the training thread only appends records, and a sender thread writes what has gathered once per
*coalescing window* (KAREUS_CLOCK_COALESCE_MS; default ``CPU_COALESCE_S``, 250 ms) in one non-blocking
write to the controller's pipe (what the pipe cannot take yet stays queued). The sender and the reply
reader run in the time the trainers leave (``cpu_sched.idle_time_only``). Every message carries its
own time, and the simulated GPU accounts busy and idle power by those times, so the window only delays
when a clock change is made, by at most one window; it keeps the side channel to a few wake-ups a
second, which matters when the trainers already use every core. A *mark* is a measurement point: the
controller answers it with the GPU energy (J) at that point; on a CPU the controller holds the answers
until the client waits for one.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kareus_megatron.errors import ConfigError, DeviceUnavailableError, KareusError
from kareus_megatron.runtime import cpu_sched
from kareus_megatron.runtime.clock_wire import (
    CODE_BEGIN,
    CODE_END,
    CODE_MARK,
    KINDS,
    NO_TIME,
    encode_control,
    encode_records,
)

if TYPE_CHECKING:
    from kareus_megatron.runtime.clock_controller import ClockController

_KIND_CODE = {kind: k for k, kind in enumerate(KINDS)}
# A message before its time is known: a record without t (code, a, b, c, d) or a control dict.
Pending = tuple[float, ...] | dict[str, Any]


# Default CPU gathering window (s).
CPU_COALESCE_S = 0.25
MIN_WAKE_S = 0.005  # the CPU sender thread sleeps at least this long between looks


def coalesce_from_env(default_s: float) -> float:
    """The forwarder's gathering window (s) from KAREUS_CLOCK_COALESCE_MS, else `default_s`."""
    raw = os.environ.get("KAREUS_CLOCK_COALESCE_MS", "")
    if not raw:
        return default_s
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0 <= ms <= 1000:
        raise ConfigError(f"KAREUS_CLOCK_COALESCE_MS={raw!r} must be a number of milliseconds in 0..1000, e.g. 5")
    return ms / 1000.0


def _error_class(name: Any) -> type[KareusError]:
    import kareus_megatron.errors as errors

    cls = getattr(errors, str(name), None)
    return cls if isinstance(cls, type) and issubclass(cls, KareusError) else DeviceUnavailableError


class _Outgoing:
    """Bytes for the controller built up in order: runs of records, then control lines (GPU forwarder)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._recs = array("d")

    def __bool__(self) -> bool:
        return bool(self._parts or self._recs)

    def record(self, msg: tuple[float, ...], t: float) -> None:
        code, a, b, c, d = msg
        self._recs.extend((code, t, NO_TIME, a, b, c, d))

    def control(self, msg: dict[str, Any]) -> None:
        self._flush_records()
        self._parts.append(encode_control(msg))

    def _flush_records(self) -> None:
        if self._recs:
            self._parts.append(encode_records(self._recs))
            self._recs = array("d")

    def take(self) -> bytes:
        self._flush_records()
        data, self._parts = b"".join(self._parts), []
        return data


class MarkTicket:
    """The answer to one ``mark``: GPU-aligned time (time.monotonic(), s) and energy (J) at that point.

    Made at every iteration boundary, so it is small: waiting uses the client's shared condition."""

    __slots__ = ("seq", "_client", "done", "t", "energy_j")

    def __init__(self, seq: int, client: ClockClient | None = None) -> None:
        self.seq = seq
        self._client = client  # None: already answered (the controller is gone)
        self.done = False
        self.t: float | None = None
        self.energy_j: float | None = None

    def wait(self, timeout: float | None = 10.0) -> bool:
        """Wait for the answer; True once it has arrived."""
        if self.done or self._client is None:
            return self.done
        return self._client._wait_ticket(self, timeout)


class ClockClient:
    """Training-side handle of one controller; every public method returns without device work."""

    def __init__(self, event_factory: Callable[[], Any] | None = None, coalesce_s: float | None = None) -> None:
        """`event_factory` makes a recorded CUDA event (GPU); None means CPU timing (time.monotonic).
        `coalesce_s`: how long messages gather before one write (default: KAREUS_CLOCK_COALESCE_MS,
        else CPU_COALESCE_S on CPU, where timestamps are taken at enqueue, and 0 on GPU, where
        waiting on events paces the forwarder)."""
        self._event_factory = event_factory
        if coalesce_s is None:
            coalesce_s = coalesce_from_env(0.0 if event_factory is not None else CPU_COALESCE_S)
        self._coalesce_s = coalesce_s
        # GPU: messages for the forwarder; each append rings the doorbell unless it gathers messages.
        self._local: collections.deque[tuple[Any, Pending] | None] = collections.deque()
        self._doorbell = threading.Event()
        self._parked = False  # the helper thread sleeps until rung (idle for a while)
        # CPU: records gathering on the training side (appended without a lock, clock_wire.RECORD_FIELDS
        # floats each), sent by whichever thread finds them due.
        self._direct = event_factory is None
        self._recs = array("d")
        self._out_since = 0.0  # enqueue time (s) of the oldest record in _recs
        self._out_lock = threading.Lock()  # one sender at a time, so batches leave in order
        self._stopping = False
        self._send: Callable[[bytes], None] | None = None
        self._backlog: Callable[[], bool] = lambda: False  # bytes the pipe has not taken yet
        self._seqs = itertools.count(1)  # next() is atomic: marks and requests from any thread
        self._tickets: dict[int, MarkTicket] = {}
        self._answered = threading.Condition(threading.Lock())  # tickets filled (reader thread)
        self._acks: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._ready: dict[str, Any] | None = None
        self._ready_event = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread_controller: ClockController | None = None
        self._controller_thread: threading.Thread | None = None
        self.counts: dict[str, int] | None = None
        self.clock_control = False
        self.closed = False
        self.gone = False
        self._want_ends = True
        self._sending = False  # instruction messages go to the controller (see _refresh_sending)
        self._idle_from = NO_TIME  # CPU: end of the last instruction, sent with the next record
        helper, name = (self._sender, "sender") if self._direct else (self._forward, "forwarder")
        self._forwarder = threading.Thread(target=helper, name=f"kareus-clock-{name}", daemon=True)

    # -- starting ----------------------------------------------------------------------------
    def start_process(self, index: int, backend: str | None = None, gpu: str | None = None,
                      log_path: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        """Start the side process for local GPU `index`; return its ``ready`` message or raise."""
        cmd = [sys.executable, "-m", "kareus_megatron.runtime.clock_controller", "--index", str(index),
               "--backend", backend or "", "--gpu", gpu or "", "--log", log_path or ""]
        # One thread per library pool: a BLAS pool would spin on the trainers' cores for nothing.
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                      env=env)
        stdin = self._proc.stdin
        assert stdin is not None
        fd = stdin.fileno()
        if self._direct:
            os.set_blocking(fd, False)  # the training thread writes: a full pipe must not block it
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
                        return  # the pipe is full: the rest goes with a later write (sender)
                    del unsent[:n]

        self._backlog = lambda: bool(unsent)
        self._send = send
        threading.Thread(target=self._read_process, name="kareus-clock-reader", daemon=True).start()
        return self._await_ready(timeout_s)

    def start_thread(self, device: Any, log_path: str | None = None) -> dict[str, Any]:
        """Run the controller in a thread of this process around `device` (tests, single-process use)."""
        from kareus_megatron.runtime.clock_controller import ClockController

        ctl = ClockController(device, self._on_reply, log_path=log_path)
        self._thread_controller = ctl
        self._send = ctl.feed
        self._on_reply(ctl.probe())
        self._controller_thread = threading.Thread(target=ctl.run, name="kareus-clock-controller", daemon=True)
        self._controller_thread.start()
        return self._await_ready(5.0)

    def _await_ready(self, timeout_s: float) -> dict[str, Any]:
        if not self._ready_event.wait(timeout_s):
            self._kill()
            raise DeviceUnavailableError(f"the clock controller did not start within {timeout_s:.0f} s")
        ready = self._ready
        if ready is None:  # the process ended before saying anything
            self._kill()
            status = self._proc.poll() if self._proc is not None else None
            raise DeviceUnavailableError(f"the clock controller exited before it was ready (exit status {status}); "
                                         "run `kareus env` to check the GPU backend")
        if ready.get("op") == "error":
            if ready.get("type") == "ClockControlError":
                self.clock_control = False
                self._want_ends = bool(ready.get("busy_events", False))
                self._refresh_sending()
                self._forwarder.start()
                return ready  # the caller decides: fail, or warn and train at default clocks
            self._kill()
            raise _error_class(ready.get("type"))(str(ready.get("message")))
        self.clock_control = True
        self._want_ends = bool(ready.get("busy_events", True))  # only a simulated GPU needs them
        self._refresh_sending()
        self._forwarder.start()
        return ready

    def _read_process(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        if self._direct:
            cpu_sched.idle_time_only()  # replies are only waited for when the meter publishes
        for line in self._proc.stdout:
            line = line.strip()
            if line:
                self._on_reply(json.loads(line))
        self._controller_gone()

    def _controller_gone(self) -> None:
        """The controller ended (closed, killed): wake every waiter; later marks answer NaN at once."""
        self.gone = True
        self._refresh_sending()
        self._ready_event.set()
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
            acks, self._acks = list(self._acks.values()), {}
        self._fill(tickets, [(None, float("nan"))] * len(tickets))
        for ev in acks:
            ev.set()

    def _on_reply(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op in ("ready", "error") and self._ready is None:
            self._ready = msg
            self._ready_event.set()
        elif op == "mark":
            ticket = self._tickets.pop(msg["seq"], None)
            if ticket is not None:
                self._fill([ticket], [(msg.get("t"), float(msg["energy_j"]))])
        elif op == "ack":
            if "counts" in msg:
                self.counts = msg["counts"]
            with self._lock:
                ev = self._acks.pop(msg.get("seq"), None)
            if ev is not None:
                ev.set()

    # -- training thread ---------------------------------------------------------------------
    def _refresh_sending(self) -> None:
        """Recompute the one flag the per-instruction path reads (after any state it depends on changes)."""
        self._sending = (self.clock_control or self._want_ends) and not (self.closed or self.gone)

    def _enqueue(self, code: float, a: float, b: float = 0.0, c: float = 0.0, d: float = 0.0) -> None:
        if not self._direct:
            self._put((self._event_factory(), (code, a, b, c, d)))
            return
        now = time.monotonic()
        idle, self._idle_from = self._idle_from, NO_TIME  # the previous instruction's end rides along
        recs = self._recs
        if not recs:
            self._out_since = now
        recs.extend((code, now, idle, a, b, c, d))
        if self._parked:
            self._doorbell.set()

    def instruction_begins(self, iteration: int, index: int, mhz: int, kind: str) -> None:
        """Enqueue "instruction `index` of `iteration` begins at `mhz` MHz" (training thread)."""
        if self._sending:
            self._enqueue(CODE_BEGIN, iteration, index, mhz, _KIND_CODE.get(kind, -1))

    def instruction_ends(self) -> None:
        """Note "the running instruction ends" (training thread); only a simulated GPU needs it."""
        if self._sending and self._want_ends:
            if self._direct:
                self._idle_from = time.monotonic()  # sent with the next record: no queue operation
            else:
                self._enqueue(CODE_END, 0.0)

    def mark(self) -> MarkTicket:
        """Enqueue a measurement point; the ticket fills with its GPU-aligned time and energy."""
        if self.closed or self.gone:
            ticket = MarkTicket(0)
            ticket.t, ticket.energy_j, ticket.done = None, float("nan"), True
            return ticket
        seq = next(self._seqs)
        ticket = self._tickets[seq] = MarkTicket(seq, self)
        # CPU: lazy, the answer is read when the meter publishes; the controller holds it until asked
        self._enqueue(CODE_MARK, seq, 1.0 if self._direct else 0.0)
        if self.gone and self._tickets.pop(seq, None) is not None:  # it went away meanwhile
            self._fill([ticket], [(None, float("nan"))])
        return ticket

    def _fill(self, tickets: list[MarkTicket], answers: list[tuple[float | None, float]]) -> None:
        with self._answered:
            for ticket, (t, energy_j) in zip(tickets, answers):
                ticket.t, ticket.energy_j, ticket.done = t, energy_j, True
            self._answered.notify_all()

    def _wait_ticket(self, ticket: MarkTicket, timeout: float | None) -> bool:
        if self._direct and not ticket.done:
            self._ask_answers()  # the mark may still be gathering here, its answer held there: ask now
        with self._answered:
            return self._answered.wait_for(lambda: ticket.done, timeout)

    def _request(self, op: str, timeout_s: float) -> bool:
        if self.gone:
            return False
        seq = next(self._seqs)
        with self._lock:
            ev = self._acks[seq] = threading.Event()
        if self._direct:
            self._push({"op": op, "seq": seq})
        else:
            self._put((None, {"op": op, "seq": seq}), ring=True)
        return ev.wait(timeout_s)

    def reset(self, timeout_s: float = 5.0) -> bool:
        """Reset clocks after every queued instruction message; wait up to `timeout_s` for it."""
        if self.closed:
            return True
        return self._request("reset", timeout_s)

    # -- CPU: direct sends -------------------------------------------------------------------
    def _push(self, control: dict[str, Any] | None = None) -> bool:
        """Send every gathered record now, then `control` (any thread); False once the controller is gone."""
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

    def _sender(self) -> None:
        """Helper thread (CPU): send the gathered records once per window, in the trainers' idle time;
        park when nothing comes for a while."""
        cpu_sched.idle_time_only()
        idle_since = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if self._recs or self._backlog():
                idle_since = now
                if now - self._out_since >= self._coalesce_s or self._backlog():
                    if not self._push():
                        return
            elif now - idle_since >= 1.0:
                self._parked = True  # idle: sleep until an enqueue rings
                if not (self._recs or self._stopping):
                    self._doorbell.wait()
                self._parked = False
                self._doorbell.clear()
                idle_since = time.monotonic()
                continue
            self._doorbell.wait(max(MIN_WAKE_S, self._coalesce_s - (time.monotonic() - self._out_since)
                                    if self._recs else self._coalesce_s))
            self._doorbell.clear()

    # -- GPU: forwarder thread ---------------------------------------------------------------
    def _put(self, item: tuple[Any, Pending] | None, ring: bool = False) -> None:
        self._local.append(item)
        if ring or self._coalesce_s <= 0 or self._parked:
            self._doorbell.set()

    def _take_all(self) -> list[tuple[Any, Pending] | None]:
        items = []
        while True:
            try:
                items.append(self._local.popleft())
            except IndexError:
                return items

    def _forward(self) -> None:
        """Helper thread: wait for each message's GPU point, then pass on what has been reached."""
        idle_since = time.monotonic()
        while True:
            if not self._local:
                if self._coalesce_s > 0 and time.monotonic() - idle_since < 1.0:
                    self._doorbell.wait(self._coalesce_s)  # look again soon: messages gather meanwhile
                else:
                    self._parked = True  # idle (or GPU mode): sleep until an append rings
                    if not self._local:
                        self._doorbell.wait()
                    self._parked = False
                self._doorbell.clear()
                continue
            items = self._take_all()
            idle_since = time.monotonic()
            out = _Outgoing()
            stop = False
            for item in items:
                if item is None:
                    stop = True
                    break
                event, msg = item
                if event is not None:
                    if out and not self._send_bytes(out.take()):  # pass on what was reached first
                        return
                    event.synchronize()  # blocks this helper thread only, until the GPU reaches the point
                if isinstance(msg, dict):
                    out.control(msg)
                else:
                    out.record(msg, time.monotonic())
            if out and not self._send_bytes(out.take()):
                return
            if stop:
                return

    def _send_bytes(self, data: bytes) -> bool:
        try:
            assert self._send is not None
            self._send(data)
        except (BrokenPipeError, OSError, ValueError):
            self._controller_gone()  # it reset the clocks on its way out
            return False
        return True

    # -- closing -----------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Reset clocks, stop the controller and wait for it (at most about `timeout_s`)."""
        if self.closed:
            return
        self._request("close", timeout_s)
        self.closed = True
        self._refresh_sending()
        if self._direct:
            self._stopping = True
            self._doorbell.set()
        else:
            self._put(None, ring=True)
        if self._controller_thread is not None:
            self._controller_thread.join(timeout_s)
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._kill()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()  # SIGTERM: the controller resets clocks, then exits
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    @property
    def controller_pid(self) -> int | None:
        """PID of the side process (None in thread mode)."""
        return self._proc.pid if self._proc is not None else None
