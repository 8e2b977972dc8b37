"""Clock controller: applies each instruction's planned SM clock off the training thread.

Pieces:

- *controller* (``ClockController``): owns one local GPU (``hardware.device``), applies clock changes,
  answers energy readings. Runs in a side process per local GPU (``python -m
  kareus_megatron.runtime.clock_controller``; NVML calls take 10–20 ms) or, for tests, in a thread.
- *client* (``ClockClient``, runtime/clock_client.py): the training side. The training thread only
  enqueues ("instruction begins/ends", "mark"); a forwarder thread waits for GPU progress (a CUDA
  event recorded at the instruction boundary; on CPU the enqueue time, ``time.monotonic()``) and
  passes the messages on.

A change made stale by a later instruction that has already begun is skipped and logged (``skip``,
reason ``stale``); a change to the clock already locked is skipped with reason ``unchanged``. Clocks
are reset when the client closes or asks for it, when the controller gets SIGTERM/SIGINT, and when its
parent (the trainer) is gone: stdin closes, or the parent PID changes, checked every 0.2 s.

Messages to the controller travel in the wire format of runtime/clock_wire.py (records for begin, end
and mark; JSON lines for answer, reset, close): ``mark`` -> reply ``mark`` {seq, t, energy_j} (at once;
a lazy one is held until HOLD_MARKS are due or an ``answer`` asks for them), ``reset`` {seq} ->
``ack``, ``close`` {seq} -> ``ack`` {counts}. Replies are one JSON object per line on its stdout (the
marks of one batch in one write); on start it sends ``ready`` {gpu, backend, supported, busy_events,
latency_s, pid} or ``error`` {type, message}.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kareus_megatron.errors import ClockControlError, KareusError
from kareus_megatron.runtime import cpu_sched
from kareus_megatron.runtime.clock_wire import CODE_BEGIN, CODE_END, KINDS, FrameReader

_POLL_S = 0.2
HOLD_MARKS = 256  # answers to lazy marks sent together at most (the client asks when it publishes)
_RELEASE_OPS = ("answer", "reset", "close", "parent_gone")
Reply = Callable[[dict[str, Any]], None]


class ClockController:
    """Applies clock changes to one device in order, skipping stale ones; thread-safe `submit`."""

    def __init__(self, device: Any, reply: Reply, log_path: str | None = None,
                 reply_many: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        """Control `device` (a GPUDevice); `reply` sends messages back (`reply_many`, when given, several
        at once: the energy marks of one batch leave in one write); `log_path` gets decisions."""
        from kareus_megatron.hardware.device.sim import JsonlAppender

        self.device = device
        self._reply = reply
        self._reply_many = reply_many
        # Items for the control loop: begins as (mhz, iteration, index, kind) tuples, control dicts.
        self._inbox: queue.Queue[list[Any]] = queue.Queue()
        self._device_logs = hasattr(device, "log_event")  # the simulated backend keeps its own log
        self._log = JsonlAppender(log_path) if (log_path and not self._device_logs) else None
        # Whether decisions are written anywhere; without a log, skips only count (the common case).
        self._logging = bool(getattr(device, "logging", True)) if self._device_logs else self._log is not None
        self._locked_mhz: int | None = None
        self.clock_control = True
        self.counts = {"applied": 0, "stale": 0, "unchanged": 0, "errors": 0}
        self._held: list[dict[str, Any]] = []  # answers to lazy marks not sent yet
        self._frames = FrameReader()
        self._edges = getattr(device, "busy_edges", None)  # only a simulated GPU accounts busy power
        # Simulated time line (a simulated GPU with clock control): decisions at the records' own times.
        self._timeline = getattr(device, "schedule_sm_clock", None)
        self._virtual = False  # set by probe
        self._vlock = threading.Lock()
        self._free_at = float("-inf")  # when the simulated device finishes its last clock call (s)
        self._pending: tuple[int, int, int, int] | None = None  # a begin waiting for the device
        self._stop = threading.Event()

    # -- logging -----------------------------------------------------------------------------
    def _record(self, event: str, own_entry: bool, **fields: Any) -> None:
        """Log a decision; `own_entry` events (set/reset) are logged by a simulated device itself."""
        if self._device_logs:
            if not own_entry:
                self.device.log_event(event, **fields)
        elif self._log is not None:
            self._log.write({"t": time.monotonic(), "pid": os.getpid(), "gpu": self.device.index,
                             "event": event, **fields})

    # -- start -------------------------------------------------------------------------------
    def probe(self) -> dict[str, Any]:
        """Check clock permission by resetting clocks once; return the ``ready`` message."""
        try:
            self.device.reset_clocks()
            self._record("reset", True, mhz=self.device.spec.max_sm_clock_mhz, reason="start")
        except ClockControlError as e:
            self.clock_control = False
            return {"op": "error", "type": type(e).__name__, "message": str(e),
                    "busy_events": hasattr(self.device, "set_busy")}
        self._virtual = self._timeline is not None
        return {
            "op": "ready",
            "gpu": self.device.spec.name,
            "backend": "simulated" if self._device_logs else "nvml",
            "supported": list(self.device.supported_sm_clocks_mhz()),
            "busy_events": hasattr(self.device, "set_busy"),
            "latency_s": getattr(self.device, "latency_s", None),  # a simulated clock call's duration
            "pid": os.getpid(),
        }

    # -- input (any thread) ------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Accept bytes of the input stream (records and control lines, see the module docstring)."""
        items = self._frames.feed(data)
        if items:
            self._take(items)

    def submit(self, msg: dict[str, Any]) -> None:
        """Accept one control message (``reset``, ``close``, ``answer``, ``parent_gone``)."""
        self._take([msg])

    def _take(self, items: list[Any]) -> None:
        """Handle what arrived, in order. Busy/idle edges (a simulated GPU's power state) and energy
        marks are handled at once, in this thread, so a clock call in progress never delays them;
        clock changes, resets and close go to the control loop in order. Without a decision log only
        the last begin of a run of begins is passed on, with the number it overtook."""
        rest: list[Any] = []
        answers: list[dict[str, Any]] = []
        edges: list[float] = []  # t0, busy0, t1, busy1, ... (busy as 1.0 / 0.0)
        release = False
        each = self._logging and self.clock_control
        virtual = self._virtual
        if virtual:
            self._vlock.acquire()
        t = None
        for item in items:
            if isinstance(item, dict):
                op = item.get("op")
                release = release or op in _RELEASE_OPS
                if op != "answer":
                    rest.append(item)
                continue
            last = None
            overtaken = 0
            it = iter(item)
            for code, t, idle, a, b, c, d in zip(it, it, it, it, it, it, it):
                if idle == idle:  # not NaN: the previous instruction ended then
                    edges += (idle, 0.0)
                if code == CODE_BEGIN:
                    edges += (t, 1.0)
                    if virtual:
                        self._virtual_begin((int(c), int(a), int(b), int(d)), t)
                    elif each:
                        rest.append((int(c), int(a), int(b), int(d)))  # mhz, iteration, index, kind
                    else:
                        overtaken += last is not None
                        last = (c, a, b, d)
                elif code == CODE_END:
                    edges += (t, 0.0)
                else:  # a mark: its energy includes every edge before it
                    if virtual:
                        self._catch_up(t)
                    if edges:
                        self._busy_edges(edges)
                        edges = []
                    (self._held if b else answers).append(self._answer_mark(int(a), t))
            if last is not None:
                if overtaken:
                    rest.append(("stale", overtaken))
                rest.append((int(last[0]), int(last[1]), int(last[2]), int(last[3])))
        if virtual:
            if t is not None:
                self._catch_up(t)  # every record up to t has arrived: a call due by then is made
            if edges:
                self._busy_edges(edges)
            self._vlock.release()
        elif edges:
            self._busy_edges(edges)
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

    def _busy_edges(self, edges: list[float]) -> None:
        if self._edges is not None:
            self._edges(edges)

    def _answer_mark(self, seq: int, t: float) -> dict[str, Any]:
        at = getattr(self.device, "energy_j_at", None)  # a simulated GPU can read the past exactly
        try:
            energy = float(at(t) if at is not None else self.device.energy_j())
        except KareusError as e:
            energy = float("nan")
            self._record("error", False, message=str(e))
        return {"op": "mark", "seq": seq, "t": t, "energy_j": energy}

    # -- simulated time line (under _vlock) ----------------------------------------------------
    def _virtual_begin(self, begin: tuple[int, int, int, int], t: float) -> None:
        """A begin at time `t`: call at once if the simulated device is free then, else wait (a begin
        still waiting is overtaken: stale), as a controller that saw every message at its own time."""
        self._catch_up(t)
        if self._free_at <= t:
            self._apply(begin, at=t)
        else:
            if self._pending is not None:
                self._skip(self._pending, "stale")
            self._pending = begin

    def _catch_up(self, t: float) -> None:
        """Make the waiting call if the device became free by `t` (it starts when the device is free)."""
        if self._pending is not None and self._free_at <= t:
            begin, self._pending = self._pending, None
            self._apply(begin, at=self._free_at)

    def _drop_pending(self) -> None:
        """Before a reset or close: a call due by now is made; one still waiting is overtaken."""
        with self._vlock:
            self._catch_up(time.monotonic())
            if self._pending is not None:
                self._skip(self._pending, "stale")
                self._pending = None

    # -- control loop ------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (it resets clocks on the way out)."""
        self._stop.set()
        self._inbox.put([{"op": "_wake"}])

    def run(self, parent_alive: Callable[[], bool] = lambda: True) -> str:
        """Serve until close, stop or parent death; always reset clocks; return why it ended."""
        why = "stopped"
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
        pending: tuple[int, int, int, int] | None = None
        for item in batch:
            if isinstance(item, tuple):
                if item[0] == "stale":  # begins overtaken within one block (not logged one by one)
                    if self.clock_control:
                        self.counts["stale"] += item[1]
                    continue
                if pending is not None:  # a begin overtakes the pending one
                    self._skip(pending, "stale")
                pending = item
                continue
            op = item.get("op")
            if op in ("reset", "close", "parent_gone"):
                if pending is not None:
                    self._skip(pending, "stale")
                    pending = None
                if self._virtual:
                    self._drop_pending()
                if op == "reset":
                    self._reset("requested")
                    self._reply({"op": "ack", "seq": item.get("seq")})
                elif op == "close":
                    self._close_seq = item.get("seq")
                    return "closed"
                else:
                    return "parent-gone"
        if pending is not None:
            self._apply(pending)
        return None

    @staticmethod
    def _context(begin: tuple[int, int, int, int]) -> dict[str, Any]:
        _, iteration, index, kind = begin
        return {"iteration": iteration, "index": index, "kind": KINDS[kind] if 0 <= kind < len(KINDS) else kind}

    def _skip(self, begin: tuple[int, int, int, int], reason: str) -> None:
        if not self.clock_control:
            return  # begins arrive only for a simulated GPU's power accounting
        self.counts[reason] += 1
        if self._logging:
            self._record("skip", False, mhz=begin[0], reason=reason, **self._context(begin))

    def _apply(self, begin: tuple[int, int, int, int], at: float | None = None) -> None:
        """Lock `begin`'s clock: now, in wall time (blocking, as NVML), or on the simulated time line
        with the call issued at `at` (s)."""
        mhz = begin[0]
        if not self.clock_control:
            return
        if mhz == self._locked_mhz:
            self._skip(begin, "unchanged")
            return
        try:
            if at is None:
                self.device.set_sm_clock_mhz(mhz)
            else:
                assert self._timeline is not None
                self._free_at = float(self._timeline(mhz, at))
        except KareusError as e:
            self.counts["errors"] += 1
            self._record("error", False, mhz=mhz, message=str(e), **self._context(begin))
            return
        self._locked_mhz = mhz
        self.counts["applied"] += 1
        self._record("set", True, mhz=mhz, **self._context(begin))

    def _reset(self, reason: str) -> None:
        if not self.clock_control:
            return
        with self._vlock:
            try:
                self.device.reset_clocks()
            except KareusError as e:
                self._record("error", False, message=str(e), reason=reason)
                return
            self._locked_mhz = None
            self._pending = None
            self._free_at = time.monotonic()
        self._record("reset", True, mhz=self.device.spec.max_sm_clock_mhz, reason=reason)

    def _final_reset(self, why: str) -> None:
        self._reset(why)
        try:
            self.device.close()
        except KareusError:
            pass
        if self._log is not None:
            self._log.close()
        if why == "closed":
            self._reply({"op": "ack", "seq": getattr(self, "_close_seq", None), "counts": dict(self.counts)})


# ---- side process -----------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    """Body of the side process: stdin carries requests, stdout replies."""
    from kareus_megatron.hardware.device import open_gpu

    parent = os.getppid()
    cpu_sched.yield_to_training()  # each message from a trainer wakes this process: do not preempt it
    out_lock = threading.Lock()
    out = sys.stdout.buffer

    def reply(msg: dict[str, Any]) -> None:
        reply_many([msg])

    def reply_many(msgs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(m, separators=(",", ":")) + "\n" for m in msgs).encode()
        with out_lock:
            try:
                out.write(data)
                out.flush()
            except (BrokenPipeError, ValueError):
                pass

    try:
        device = open_gpu(args.index, backend=args.backend or None, gpu=args.gpu or None)
    except KareusError as e:
        reply({"op": "error", "type": type(e).__name__, "message": str(e)})
        return 2
    if hasattr(device, "busy_edges"):  # a simulated GPU: the trainers are the device, take only idle time
        cpu_sched.idle_time_only()
    controller = ClockController(device, reply, log_path=args.log or None, reply_many=reply_many)

    def on_signal(signum: int, frame: Any) -> None:
        controller.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    reply(controller.probe())

    def read_stdin() -> None:
        fd = sys.stdin.fileno()
        while True:  # everything that has arrived, in one read per wake-up
            data = os.read(fd, 1 << 16)
            if not data:
                break
            controller.feed(data)
        controller.submit({"op": "parent_gone"})  # EOF: the trainer closed the pipe or died

    threading.Thread(target=read_stdin, name="kareus-clock-stdin", daemon=True).start()
    controller.run(parent_alive=lambda: os.getppid() == parent)
    sys.stdout.flush()
    os._exit(0)  # the stdin reader thread may be blocked in read(); do not wait for it


def main(argv: list[str] | None = None) -> int:
    """Entry point of the side process (started by ``ClockClient.start_process``)."""
    p = argparse.ArgumentParser(prog="kareus-clock-controller")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--backend", default="")
    p.add_argument("--gpu", default="")
    p.add_argument("--log", default="")
    return _serve(p.parse_args(argv))


# The training side lives in clock_client.py; re-exported here for callers of the first layout.
from kareus_megatron.runtime.clock_client import ClockClient, MarkTicket  # noqa: E402

__all__ = ["ClockClient", "ClockController", "MarkTicket", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
