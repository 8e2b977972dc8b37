"""Clock client: the training side of the clock controller (see runtime/clock_controller.py).

The training thread only enqueues ("instruction begins/ends", "mark"); a forwarder thread waits for
GPU progress (a CUDA event recorded at the instruction boundary; on CPU the enqueue time,
``time.monotonic()``) and passes what has been reached to the controller, several messages per write.
A *mark* is a measurement point: the controller answers it with the GPU energy (J) at that point.
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

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self._done = threading.Event()
        self.t: float | None = None
        self.energy_j: float | None = None

    def _fill(self, t: float | None, energy_j: float) -> None:
        self.t, self.energy_j = t, energy_j
        self._done.set()

    def wait(self, timeout: float | None = 10.0) -> bool:
        """Wait for the answer; True once it has arrived."""
        return self._done.wait(timeout)


class ClockClient:
    """Training-side handle of one controller; every public method returns without device work."""

    def __init__(self, event_factory: Callable[[], Any] | None = None, coalesce_s: float | None = None) -> None:
        """`event_factory` makes a recorded CUDA event (GPU); None means CPU timing (time.monotonic).
        `coalesce_s`: how long the forwarder lets messages gather before one write (default:
        KAREUS_CLOCK_COALESCE_MS, else 5 ms on CPU, where timestamps are taken at enqueue and a
        simulated clock call takes 15 ms anyway, and 0 on GPU, where waiting on events paces it)."""
        self._event_factory = event_factory
        if coalesce_s is None:
            coalesce_s = coalesce_from_env(0.0 if event_factory is not None else 0.005)
        self._coalesce_s = coalesce_s
        # Messages for the forwarder. On CPU the training thread only appends (no lock, no wake-up);
        # the forwarder looks every `coalesce_s`. With CUDA events each append rings the doorbell.
        self._local: collections.deque[tuple[Any, dict[str, Any]] | None] = collections.deque()
        self._doorbell = threading.Event()
        self._parked = False  # the forwarder sleeps until rung (idle for a while)
        self._send: Callable[[list[dict[str, Any]]], None] | None = None
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
        self._forwarder = threading.Thread(target=self._forward, name="kareus-clock-forwarder", daemon=True)

    # -- starting ----------------------------------------------------------------------------
    def start_process(self, index: int, backend: str | None = None, gpu: str | None = None,
                      log_path: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        """Start the side process for local GPU `index`; return its ``ready`` message or raise."""
        cmd = [sys.executable, "-m", "kareus_megatron.runtime.clock_controller", "--index", str(index),
               "--backend", backend or "", "--gpu", gpu or "", "--log", log_path or ""]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        stdin = self._proc.stdin
        assert stdin is not None
        send_lock = threading.Lock()

        def send(batch: list[dict[str, Any]]) -> None:
            data = (json.dumps(batch, separators=(",", ":")) + "\n").encode()
            with send_lock:
                stdin.write(data)
                stdin.flush()

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
        event = self._event_factory() if self._event_factory is not None else None
        if event is None:
            msg["t"] = time.monotonic()
            if self._idle_from is not None:  # the previous instruction's end rides along
                msg["idle_from"], self._idle_from = self._idle_from, None
        self._put((event, msg))

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
            ticket = self._tickets[self._seq] = MarkTicket(self._seq)
        if self.closed or self.gone:
            with self._lock:
                self._tickets.pop(ticket.seq, None)
            ticket._fill(None, float("nan"))
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
        self._put((None, {"op": op, "seq": seq}), ring=True)
        return ev.wait(timeout_s)

    def reset(self, timeout_s: float = 5.0) -> bool:
        """Reset clocks after every queued instruction message; wait up to `timeout_s` for it."""
        if self.closed:
            return True
        return self._request("reset", timeout_s)

    # -- forwarder thread --------------------------------------------------------------------
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
