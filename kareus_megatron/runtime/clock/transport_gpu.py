"""GPU transport: a forwarder thread passes each message on once the GPU has reached its point.

The training thread records a CUDA event at the instruction boundary (``event_factory``; no device
synchronisation) and queues it with the message. The forwarder thread waits on each event in order
(``event.synchronize()`` blocks that thread only), stamps the message with the time the GPU got there
(``time.monotonic()``) and writes what has been reached to the controller. With a gathering window
(KAREUS_CLOCK_COALESCE_MS; default 0 on a GPU, where waiting on events paces the forwarder) messages
gather for that long before the forwarder looks.

``CudaEvents`` is the event factory of a CUDA run. Its events are *blocking* (``cudaEventBlockingSync``:
the forwarder sleeps in ``synchronize()`` instead of spinning a CPU core per rank), without timing
(cheaper to record), and pooled: the forwarder gives each event back once it has waited on it
(``give_back``), so the training thread records an event it already has instead of making one (a driver
call, ``cudaEventCreate``, at its first record) per instruction. Its ``bind_thread()`` makes the training
thread's CUDA device current in the forwarder before it first waits: a thread that never set its device
works on device 0, so on a multi-GPU node every rank > 0 would create a context there (~0.5 GB each;
pytorch#135273 is the same bug class). The device is the one current on the training thread when the
first event is made.
"""

from __future__ import annotations

import collections
from array import array
from collections.abc import Callable
from time import monotonic
from typing import Any

from kareus_megatron.runtime.clock.transport import KIND_CODE, Transport
from kareus_megatron.runtime.clock.wire import (
    CODE_BEGIN,
    CODE_END,
    CODE_MARK,
    NO_POWER,
    NO_TIME,
    encode_control,
    encode_records,
)

# A queued message: (CUDA event or None, record without t (code, a, b, c, d, e) or a control dict);
# None stops the forwarder.
Item = tuple[Any, tuple[float, ...] | dict[str, Any]] | None


class _Outgoing:
    """Bytes for the controller built up in order: runs of records, then control lines."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._recs = array("d")

    def __bool__(self) -> bool:
        return bool(self._parts or self._recs)

    def record(self, msg: tuple[float, ...], t: float) -> None:
        code, a, b, c, d, e = msg
        self._recs.extend((code, t, NO_TIME, a, b, c, d, e))

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


class CudaEvents:
    """Makes recorded, blocking CUDA events on the training thread; ``bind_thread`` sets the forwarder's
    device to the training thread's (torch imported lazily; ``available()`` says whether CUDA is there)."""

    def __init__(self, torch_module: Any, fallback_device: int | None = None) -> None:
        """`torch_module`: torch (or a stand-in); `fallback_device`: the device to bind when no event has
        been made yet (the session's local CUDA device)."""
        self._torch = torch_module
        self.device: int | None = None  # the training thread's device at the first event
        self._fallback = fallback_device
        self._free: collections.deque[Any] = collections.deque()  # waited on by the forwarder, ready to record

    @classmethod
    def available(cls, fallback_device: int | None = None) -> CudaEvents | None:
        """A factory when torch sees a CUDA device, else None (CPU timing)."""
        try:
            import torch
        except ImportError:  # pragma: no cover - the runtime always has torch
            return None
        return cls(torch, fallback_device) if torch.cuda.is_available() else None

    def __call__(self) -> Any:
        """A blocking CUDA event recorded on the current stream (training thread), from the pool if it has one."""
        try:
            ev = self._free.pop()
        except IndexError:
            cuda = self._torch.cuda
            if self.device is None:
                self.device = int(cuda.current_device())
            ev = cuda.Event(blocking=True)
        ev.record()
        return ev

    def give_back(self, event: Any) -> None:
        """`event` has been waited on (forwarder thread): record it again for a later message."""
        self._free.append(event)

    def bind_thread(self) -> None:
        """Make the training thread's CUDA device current in the calling thread (the forwarder)."""
        device = self.device if self.device is not None else self._fallback
        if device is not None:
            self._torch.cuda.set_device(device)


class GpuTransport(Transport):
    """Messages queued with a CUDA event each; a forwarder thread passes them on as the GPU gets there."""

    HELPER = "forwarder"

    def __init__(
        self,
        event_factory: Callable[[], Any],
        coalesce_s: float,
        bind_thread: Callable[[], None] | None = None,
        recycle: Callable[[Any], None] | None = None,
    ) -> None:
        """`event_factory` returns a recorded CUDA event (anything with ``synchronize()``); `bind_thread`
        (``CudaEvents.bind_thread``), when given, runs in the forwarder once before it first waits; `recycle`
        (``CudaEvents.give_back``), when given, gets each event back once the forwarder has waited on it."""
        super().__init__(coalesce_s)
        self._event_factory = event_factory
        self._bind = bind_thread
        self._recycle = recycle
        self._local: collections.deque[Item] = collections.deque()
        self._ring_each = coalesce_s <= 0  # no gathering: every message wakes the forwarder

    # -- training thread ---------------------------------------------------------------------
    def instruction_begins(self, iteration: int, index: int, mhz: int, kind: str, power_w: float = NO_POWER) -> None:
        """Queue "instruction `index` of `iteration` (`kind`) begins at `mhz` MHz" at a new event (`power_w`:
        a simulated truth's busy power, W)."""
        if self.sending:
            self._put((self._event_factory(), (CODE_BEGIN, iteration, index, mhz, KIND_CODE.get(kind, -1), power_w)))

    def instruction_ends(self) -> None:
        """Queue "the running instruction ends" at a new event (only a simulated GPU needs it)."""
        if self.sending_ends:
            self._put((self._event_factory(), (CODE_END, 0.0, 0.0, 0.0, 0.0, 0.0)))

    def _send_mark(self, seq: int) -> None:
        self._put((self._event_factory(), (CODE_MARK, seq, 0.0, 0.0, 0.0, 0.0)))  # answered at once

    def _send_control(self, msg: dict[str, Any]) -> None:
        self._put((None, msg), ring=True)

    def _stop_helper(self) -> None:
        self._put(None, ring=True)

    def _put(self, item: Item, ring: bool = False) -> None:
        self._local.append(item)
        if ring or self._ring_each or self._parked:
            self._doorbell.set()

    # -- forwarder thread --------------------------------------------------------------------
    def _take_all(self) -> list[Item]:
        items = []
        while True:
            try:
                items.append(self._local.popleft())
            except IndexError:
                return items

    def _run_helper(self) -> None:
        """Forwarder thread: wait for each message's GPU point, then pass on what has been reached."""
        idle_since = monotonic()
        while True:
            if not self._local:
                if self.coalesce_s > 0 and monotonic() - idle_since < 1.0:
                    self._doorbell.wait(self.coalesce_s)  # look again soon: messages gather meanwhile
                else:
                    self._parked = True  # idle (or no gathering): sleep until an append rings
                    if not self._local:
                        self._doorbell.wait()
                    self._parked = False
                self._doorbell.clear()
                continue
            items = self._take_all()
            idle_since = monotonic()
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
                    if self._bind is not None:  # first event: on the training thread's device
                        self._bind()
                        self._bind = None
                    event.synchronize()  # blocks this thread only, until the GPU reaches the point
                    if self._recycle is not None:  # nothing else holds it: the training thread may record it again
                        self._recycle(event)
                if isinstance(msg, dict):
                    out.control(msg)
                else:
                    out.record(msg, monotonic())
            if out and not self._send_bytes(out.take()):
                return
            if stop:
                return
