"""GPU transport: a forwarder thread passes each message on once the GPU has reached its point.

The training thread records a CUDA event at the instruction boundary (``event_factory``; no device
synchronisation) and queues it with the message. The forwarder thread waits on each event in order
(``event.synchronize()`` blocks that thread only), stamps the message with the time the GPU got there
(``time.monotonic()``) and writes what has been reached to the controller. With a gathering window
(KAREUS_CLOCK_COALESCE_MS; default 0 on a GPU, where waiting on events paces the forwarder) messages
gather for that long before the forwarder looks.
"""

from __future__ import annotations

import collections
from array import array
from collections.abc import Callable
from time import monotonic
from typing import Any

from kareus_megatron.runtime.clock.transport import KIND_CODE, Transport
from kareus_megatron.runtime.clock.wire import CODE_BEGIN, CODE_END, CODE_MARK, NO_TIME, encode_control, encode_records

# A queued message: (CUDA event or None, record without t (code, a, b, c, d) or a control dict);
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


class GpuTransport(Transport):
    """Messages queued with a CUDA event each; a forwarder thread passes them on as the GPU gets there."""

    HELPER = "forwarder"

    def __init__(self, event_factory: Callable[[], Any], coalesce_s: float) -> None:
        """`event_factory` returns a recorded CUDA event (anything with ``synchronize()``)."""
        super().__init__(coalesce_s)
        self._event_factory = event_factory
        self._local: collections.deque[Item] = collections.deque()
        self._ring_each = coalesce_s <= 0  # no gathering: every message wakes the forwarder

    # -- training thread ---------------------------------------------------------------------
    def instruction_begins(self, iteration: int, index: int, mhz: int, kind: str) -> None:
        """Queue "instruction `index` of `iteration` (`kind`) begins at `mhz` MHz" at a new event."""
        if self.sending:
            self._put((self._event_factory(), (CODE_BEGIN, iteration, index, mhz, KIND_CODE.get(kind, -1))))

    def instruction_ends(self) -> None:
        """Queue "the running instruction ends" at a new event (only a simulated GPU needs it)."""
        if self.sending_ends:
            self._put((self._event_factory(), (CODE_END, 0.0, 0.0, 0.0, 0.0)))

    def _send_mark(self, seq: int) -> None:
        self._put((self._event_factory(), (CODE_MARK, seq, 0.0, 0.0, 0.0)))  # answered at once

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
                    event.synchronize()  # blocks this thread only, until the GPU reaches the point
                if isinstance(msg, dict):
                    out.control(msg)
                else:
                    out.record(msg, monotonic())
            if out and not self._send_bytes(out.take()):
                return
            if stop:
                return
