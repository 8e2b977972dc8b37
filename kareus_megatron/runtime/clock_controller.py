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

Messages to the controller (between processes: one JSON array of messages per line on its stdin):
``begin`` {t, iteration, index, mhz, kind}, ``end`` {t} (only a simulated GPU needs it: busy vs
blocked power), ``mark`` {seq, t} -> reply ``mark`` {seq, t, energy_j}, ``reset`` {seq} -> ``ack``,
``close`` {seq} -> ``ack`` {counts}. Replies are one JSON object per line on its stdout; on start it
sends ``ready`` {gpu, backend, supported, busy_events, pid} or ``error`` {type, message}.
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

_POLL_S = 0.2
Reply = Callable[[dict[str, Any]], None]


class ClockController:
    """Applies clock changes to one device in order, skipping stale ones; thread-safe `submit`."""

    def __init__(self, device: Any, reply: Reply, log_path: str | None = None) -> None:
        """Control `device` (a GPUDevice); `reply` sends messages back; `log_path` gets decisions."""
        from kareus_megatron.hardware.device.sim import JsonlAppender

        self.device = device
        self._reply = reply
        self._inbox: queue.Queue[list[dict[str, Any]]] = queue.Queue()
        self._device_logs = hasattr(device, "log_event")  # the simulated backend keeps its own log
        self._log = JsonlAppender(log_path) if (log_path and not self._device_logs) else None
        self._locked_mhz: int | None = None
        self.clock_control = True
        self.counts = {"applied": 0, "stale": 0, "unchanged": 0, "errors": 0}
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
        return {
            "op": "ready",
            "gpu": self.device.spec.name,
            "backend": "simulated" if self._device_logs else "nvml",
            "supported": list(self.device.supported_sm_clocks_mhz()),
            "busy_events": hasattr(self.device, "set_busy"),
            "pid": os.getpid(),
        }

    # -- input (any thread) ------------------------------------------------------------------
    def submit(self, msg: dict[str, Any]) -> None:
        """Accept one message; energy marks are answered at once, the rest go to the control loop."""
        self.submit_batch([msg])

    def submit_batch(self, batch: list[dict[str, Any]]) -> None:
        """Accept several messages in order (one write from the client).

        Busy/idle changes (a simulated GPU's power state) and energy marks are handled at once, in
        this thread, so they are never delayed by a clock call in progress; clock changes, resets
        and close go to the control loop in order.
        """
        rest = []
        for msg in batch:
            op = msg.get("op")
            if "idle_from" in msg:  # the end of the previous instruction, sent along with this message
                self._set_busy(False, msg["idle_from"])
            if op == "mark":
                self._answer_mark(msg)
                continue
            if op in ("begin", "end"):
                self._set_busy(op == "begin", msg.get("t"))
                if op == "end":
                    continue
            rest.append(msg)
        if rest:
            self._inbox.put_nowait(rest)

    def _answer_mark(self, msg: dict[str, Any]) -> None:
        at = getattr(self.device, "energy_j_at", None)  # a simulated GPU can read the past exactly
        try:
            t = msg.get("t")
            energy = float(at(t) if (at is not None and t is not None) else self.device.energy_j())
        except KareusError as e:
            energy = float("nan")
            self._record("error", False, message=str(e))
        self._reply({"op": "mark", "seq": msg["seq"], "t": msg.get("t"), "energy_j": energy})

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

    def _handle(self, batch: list[dict[str, Any]]) -> str | None:
        pending: dict[str, Any] | None = None
        for msg in batch:
            op = msg.get("op")
            if op == "begin":
                if pending is not None:
                    self._skip(pending, "stale")
                pending = msg
            elif op in ("reset", "close", "parent_gone"):
                if pending is not None:
                    self._skip(pending, "stale")
                    pending = None
                if op == "reset":
                    self._reset("requested")
                    self._reply({"op": "ack", "seq": msg.get("seq")})
                elif op == "close":
                    self._close_seq = msg.get("seq")
                    return "closed"
                else:
                    return "parent-gone"
        if pending is not None:
            self._apply(pending)
        return None

    def _set_busy(self, busy: bool, t: float | None) -> None:
        set_busy = getattr(self.device, "set_busy", None)
        if set_busy is not None:
            set_busy(busy, t)

    def _context(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {k: msg[k] for k in ("iteration", "index", "kind") if k in msg}

    def _skip(self, msg: dict[str, Any], reason: str) -> None:
        if not self.clock_control:
            return  # begins arrive only for a simulated GPU's power accounting
        self.counts[reason] += 1
        self._record("skip", False, mhz=msg["mhz"], reason=reason, **self._context(msg))

    def _apply(self, msg: dict[str, Any]) -> None:
        mhz = int(msg["mhz"])
        if not self.clock_control:
            return
        if mhz == self._locked_mhz:
            self._skip(msg, "unchanged")
            return
        try:
            self.device.set_sm_clock_mhz(mhz)
        except KareusError as e:
            self.counts["errors"] += 1
            self._record("error", False, mhz=mhz, message=str(e), **self._context(msg))
            return
        self._locked_mhz = mhz
        self.counts["applied"] += 1
        self._record("set", True, mhz=mhz, **self._context(msg))

    def _reset(self, reason: str) -> None:
        if not self.clock_control:
            return
        try:
            self.device.reset_clocks()
        except KareusError as e:
            self._record("error", False, message=str(e), reason=reason)
            return
        self._locked_mhz = None
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
    out_lock = threading.Lock()
    out = sys.stdout.buffer

    def reply(msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
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
    controller = ClockController(device, reply, log_path=args.log or None)

    def on_signal(signum: int, frame: Any) -> None:
        controller.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    reply(controller.probe())

    def read_stdin() -> None:
        for line in sys.stdin.buffer:
            line = line.strip()
            if line:
                controller.submit_batch(json.loads(line))
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
