"""Clock client: the training side of the clock controller (see runtime/clock_controller.py).

The training thread only enqueues ("instruction begins/ends", "mark"). On a GPU a forwarder thread
waits for GPU progress (a CUDA event recorded at the instruction boundary) and passes on what has been
reached. On a CPU there is nothing to wait for (timestamps are the enqueue time, ``time.monotonic()``):
the training thread gathers messages for a *coalescing window* (KAREUS_CLOCK_COALESCE_MS; by default
one simulated clock call, 15 ms, as a change cannot take effect sooner) and then writes them itself,
in one non-blocking write to the controller's pipe (what the pipe cannot take yet stays queued); a
backstop thread sends what is left when the training thread goes quiet (it looks every
``BACKSTOP_S``). A *mark* is a measurement point: the controller answers it with the GPU energy (J)
at that point; on a CPU the controller may hold the answers until the client waits for one.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kareus_megatron.errors import ConfigError, DeviceUnavailableError, KareusError

if TYPE_CHECKING:
    from kareus_megatron.runtime.clock_controller import ClockController


# How often (s) the CPU backstop thread looks for messages left behind by a quiet training thread.
BACKSTOP_S = 0.05
# Upper bound (s) of the default CPU gathering window, which follows a simulated clock call's latency.
MAX_DEFAULT_COALESCE_S = 0.05


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


class MarkTicket:
    """The answer to one ``mark``: GPU-aligned time (time.monotonic(), s) and energy (J) at that point."""

    def __init__(self, seq: int, push: Callable[[], Any] | None = None) -> None:
        self.seq = seq
        self._push = push  # sends messages still gathering on the training side (CPU mode)
        self._done = threading.Event()
        self.t: float | None = None
        self.energy_j: float | None = None

    def _fill(self, t: float | None, energy_j: float) -> None:
        self.t, self.energy_j = t, energy_j
        self._done.set()

    def wait(self, timeout: float | None = 10.0) -> bool:
        """Wait for the answer; True once it has arrived."""
        if not self._done.is_set() and self._push is not None:
            self._push()  # the mark may still be gathering here, its answer held there: ask now
        return self._done.wait(timeout)


class ClockClient:
    """Training-side handle of one controller; every public method returns without device work."""

    def __init__(self, event_factory: Callable[[], Any] | None = None, coalesce_s: float | None = None) -> None:
        """`event_factory` makes a recorded CUDA event (GPU); None means CPU timing (time.monotonic).
        `coalesce_s`: how long messages gather before one write (default: KAREUS_CLOCK_COALESCE_MS,
        else on CPU, where timestamps are taken at enqueue, the controller's simulated clock call
        latency (at least 5 ms, at most MAX_DEFAULT_COALESCE_S), and 0 on GPU, where waiting on
        events paces the forwarder)."""
        self._event_factory = event_factory
        self._coalesce_given = coalesce_s is not None or bool(os.environ.get("KAREUS_CLOCK_COALESCE_MS"))
        if coalesce_s is None:
            coalesce_s = coalesce_from_env(0.0 if event_factory is not None else 0.005)
        self._coalesce_s = coalesce_s
        # GPU: messages for the forwarder; each append rings the doorbell unless it gathers messages.
        self._local: collections.deque[tuple[Any, dict[str, Any]] | None] = collections.deque()
        self._doorbell = threading.Event()
        self._parked = False  # the helper thread sleeps until rung (idle for a while)
        # CPU: messages gathering on the training side, sent by whichever thread finds them due.
        self._direct = event_factory is None
        self._out: collections.deque[dict[str, Any]] = collections.deque()  # appended without a lock
        self._out_since = 0.0  # enqueue time (s) of the oldest message in _out
        self._out_lock = threading.Lock()  # one sender at a time, so batches leave in order
        self._stopping = False
        self._send: Callable[[list[dict[str, Any]]], None] | None = None
        self._backlog: Callable[[], bool] = lambda: False  # bytes the pipe has not taken yet
        self._seq = 0
        self._tickets: dict[int, MarkTicket] = {}
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
        self._idle_from: float | None = None
        helper, name = (self._backstop, "backstop") if self._direct else (self._forward, "forwarder")
        self._forwarder = threading.Thread(target=helper, name=f"kareus-clock-{name}", daemon=True)

    # -- starting ----------------------------------------------------------------------------
    def start_process(self, index: int, backend: str | None = None, gpu: str | None = None,
                      log_path: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        """Start the side process for local GPU `index`; return its ``ready`` message or raise."""
        from kareus_megatron.runtime.clock_controller import encode_messages

        cmd = [sys.executable, "-m", "kareus_megatron.runtime.clock_controller", "--index", str(index),
               "--backend", backend or "", "--gpu", gpu or "", "--log", log_path or ""]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        stdin = self._proc.stdin
        assert stdin is not None
        fd = stdin.fileno()
        if self._direct:
            os.set_blocking(fd, False)  # the training thread writes: a full pipe must not block it
        send_lock = threading.Lock()
        unsent = bytearray()

        def send(batch: list[dict[str, Any]]) -> None:
            with send_lock:
                if batch:
                    unsent.extend(encode_messages(batch))
                while unsent:
                    try:
                        n = os.write(fd, unsent)
                    except BlockingIOError:
                        return  # the pipe is full: the rest goes with a later write (backstop)
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
        self._send = ctl.submit_batch
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
                self._forwarder.start()
                return ready  # the caller decides: fail, or warn and train at default clocks
            self._kill()
            raise _error_class(ready.get("type"))(str(ready.get("message")))
        self.clock_control = True
        self._want_ends = bool(ready.get("busy_events", True))  # only a simulated GPU needs them
        latency_s = ready.get("latency_s")
        if self._direct and not self._coalesce_given and isinstance(latency_s, (int, float)):
            # A change cannot take effect faster than one clock call: gather for that long (CPU).
            self._coalesce_s = min(max(self._coalesce_s, float(latency_s)), MAX_DEFAULT_COALESCE_S)
        self._forwarder.start()
        return ready

    def _read_process(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            line = line.strip()
            if line:
                self._on_reply(json.loads(line))
        self._controller_gone()

    def _controller_gone(self) -> None:
        """The controller ended (closed, killed): wake every waiter; later marks answer NaN at once."""
        self.gone = True
        self._ready_event.set()
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
            acks, self._acks = list(self._acks.values()), {}
        for ticket in tickets:
            ticket._fill(None, float("nan"))
        for ev in acks:
            ev.set()

    def _on_reply(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op in ("ready", "error") and self._ready is None:
            self._ready = msg
            self._ready_event.set()
        elif op == "mark":
            with self._lock:
                ticket = self._tickets.pop(msg["seq"], None)
            if ticket is not None:
                ticket._fill(msg.get("t"), float(msg["energy_j"]))
        elif op == "ack":
            if "counts" in msg:
                self.counts = msg["counts"]
            with self._lock:
                ev = self._acks.pop(msg.get("seq"), None)
            if ev is not None:
                ev.set()

    # -- training thread ---------------------------------------------------------------------
    def _enqueue(self, msg: dict[str, Any]) -> None:
        if self._direct:
            now = msg["t"] = time.monotonic()
            if self._idle_from is not None:  # the previous instruction's end rides along
                msg["idle_from"], self._idle_from = self._idle_from, None
            if not self._out:
                self._out_since = now
            self._out.append(msg)
            if now - self._out_since >= self._coalesce_s:
                self._push()
            elif self._parked:
                self._doorbell.set()
            return
        self._put((self._event_factory(), msg))

    def instruction_begins(self, iteration: int, index: int, mhz: int, kind: str) -> None:
        """Enqueue "instruction `index` of `iteration` begins at `mhz` MHz" (training thread)."""
        if (self.clock_control or self._want_ends) and not (self.closed or self.gone):
            self._enqueue({"op": "begin", "iteration": iteration, "index": index, "mhz": int(mhz), "kind": kind})

    def instruction_ends(self) -> None:
        """Note "the running instruction ends" (training thread); only a simulated GPU needs it."""
        if self._want_ends and not (self.closed or self.gone):
            if self._event_factory is None:
                self._idle_from = time.monotonic()  # sent with the next message: no queue operation
            else:
                self._enqueue({"op": "end"})

    def mark(self) -> MarkTicket:
        """Enqueue a measurement point; the ticket fills with its GPU-aligned time and energy."""
        with self._lock:
            self._seq += 1
            ticket = self._tickets[self._seq] = MarkTicket(self._seq, self._ask_answers if self._direct else None)
        if self.closed or self.gone:
            with self._lock:
                self._tickets.pop(ticket.seq, None)
            ticket._fill(None, float("nan"))
        elif self._direct:  # CPU: the answer is read when the meter publishes; the controller may hold it
            self._enqueue({"op": "mark", "seq": ticket.seq, "lazy": 1})
        else:
            self._enqueue({"op": "mark", "seq": ticket.seq})
        return ticket

    def _request(self, op: str, timeout_s: float) -> bool:
        if self.gone:
            return False
        with self._lock:
            self._seq += 1
            seq = self._seq
            ev = self._acks[seq] = threading.Event()
        if self._direct:
            self._out.append({"op": op, "seq": seq})
            self._push()
        else:
            self._put((None, {"op": op, "seq": seq}), ring=True)
        return ev.wait(timeout_s)

    def reset(self, timeout_s: float = 5.0) -> bool:
        """Reset clocks after every queued instruction message; wait up to `timeout_s` for it."""
        if self.closed:
            return True
        return self._request("reset", timeout_s)

    # -- CPU: direct sends -------------------------------------------------------------------
    def _push(self) -> bool:
        """Send every gathered message now (any thread); False once the controller is gone."""
        with self._out_lock:
            batch = []
            while True:
                try:
                    batch.append(self._out.popleft())
                except IndexError:
                    break
            if not batch and not self._backlog():
                return True
            return self._send_batch(batch)

    def _ask_answers(self) -> None:
        """Send what is gathering and ask the controller for the answers to marks it holds."""
        if not (self.closed or self.gone):
            self._out.append({"op": "answer"})
            self._push()

    def _backstop(self) -> None:
        """Helper thread (CPU): send what a quiet training thread left behind; park when idle."""
        idle_since = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if self._out or self._backlog():
                idle_since = now
                if now - self._out_since >= self._coalesce_s or self._backlog():
                    if not self._push():
                        return
            elif now - idle_since >= 1.0:
                self._parked = True  # idle: sleep until an enqueue rings
                if not (self._out or self._stopping):
                    self._doorbell.wait()
                self._parked = False
                self._doorbell.clear()
                idle_since = time.monotonic()
                continue
            self._doorbell.wait(max(BACKSTOP_S, self._coalesce_s))
            self._doorbell.clear()

    # -- GPU: forwarder thread ---------------------------------------------------------------
    def _put(self, item: tuple[Any, dict[str, Any]] | None, ring: bool = False) -> None:
        self._local.append(item)
        if ring or self._coalesce_s <= 0 or self._parked:
            self._doorbell.set()

    def _take_all(self) -> list[tuple[Any, dict[str, Any]] | None]:
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
            batch: list[dict[str, Any]] = []
            stop = False
            for item in items:
                if item is None:
                    stop = True
                    break
                event, msg = item
                if event is not None:
                    if batch:  # pass on what was reached before blocking on this event
                        if not self._send_batch(batch):
                            return
                        batch = []
                    event.synchronize()  # blocks this helper thread only, until the GPU reaches the point
                    msg["t"] = time.monotonic()
                batch.append(msg)
            if batch and not self._send_batch(batch):
                return
            if stop:
                return

    def _send_batch(self, batch: list[dict[str, Any]]) -> bool:
        try:
            assert self._send is not None
            self._send(batch)
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
