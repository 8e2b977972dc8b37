"""Wire format from the clock client's transports (training side) to the clock controller.

The frequent messages are fixed-size *records* of RECORD_FIELDS float64 (code, t, idle_from, a, b, c,
d, e), sent in blocks ``b"R <n>\\n"`` followed by n records (``encode_records``):

- *begin* (CODE_BEGIN): instruction a=iteration, b=index began at t at c=mhz MHz; d=kind (KINDS index);
  e=the power (W) a simulated GPU draws while it runs (NaN: the device's own model; set only by a
  simulated truth, runtime/closed_loop/truth.py);
- *end* (CODE_END): the running instruction ended at t (only a simulated GPU needs it: busy vs
  blocked power);
- *mark* (CODE_MARK): a measurement point at t, a=seq; b=1 when the answer may be held (lazy).

``idle_from`` (NaN: none) is the end of the previous instruction, sent along with the next record. Times
are ``time.monotonic()`` seconds. The rare messages (answer, reset, close, parent_gone) are one JSON
object per line (``encode_control``). Records keep the side channel cheap on a busy CPU: a trainer
appends 8 floats per instruction, the controller reads a block with one ``array.frombytes``.
"""

from __future__ import annotations

import json
import math
from array import array
from typing import Any, Literal, NotRequired, TypedDict

RECORD_FIELDS = 8  # code, t (s, time.monotonic()), idle_from (s; NaN: none), a, b, c, d, e
CODE_BEGIN, CODE_END, CODE_MARK = 1.0, 2.0, 3.0
KINDS = ("forward", "backward")  # instruction kinds a begin record can name (d = index)
NO_TIME = math.nan
NO_POWER = math.nan  # a begin's e field: the simulated GPU's own power model


# The controller's replies (JSON lines back to the client, transport.py ``on_reply``).
class ReadyReply(TypedDict):
    """The controller started and may lock clocks (``read_only``: it measures only)."""

    op: Literal["ready"]
    gpu: str  # the preset name (hardware/gpus.toml)
    backend: str  # "nvml" or "simulated"
    supported: list[int]  # the GPU's SM clocks (MHz)
    busy_events: bool  # whether instruction ends are wanted (a simulated GPU's busy power)
    latency_s: float | None  # a simulated clock call's duration (s); None on NVML
    pid: int
    power_limit_w: float | None  # the power cap the controller set (W), or None
    read_only: bool


class ErrorReply(TypedDict):
    """The controller cannot lock clocks (or its simulated truth is bad): `type` and `message` say why."""

    op: Literal["error"]
    type: str
    message: str
    busy_events: NotRequired[bool]


class MarkReply(TypedDict):
    """The answer to measurement point `seq` at `t` (s): energy so far (J, NaN on a failed read)."""

    op: Literal["mark"]
    seq: int
    t: float | None
    energy_j: float
    temperature_c: float | None
    sm_clock_mhz: int | None  # the locked clock (MHz), None while unlocked
    applied: int
    late: int
    stale: int
    errors: int
    power: NotRequired[dict[str, Any] | None]  # the power samples since the previous mark (compact)


class AckReply(TypedDict):
    """A reset or close is done; a close's ack carries the decision counts."""

    op: Literal["ack"]
    seq: int | None
    counts: NotRequired[dict[str, int]]


Reply = ReadyReply | ErrorReply | MarkReply | AckReply


def begin_record(
    t: float, iteration: int, index: int, mhz: int, kind: str, idle_from: float = NO_TIME, power_w: float = NO_POWER
) -> tuple[float, ...]:
    """The record of "instruction `index` of `iteration` (`kind`) begins at `t` at `mhz` MHz" (a simulated
    GPU draws `power_w` W while it runs; NaN: its own model)."""
    return (CODE_BEGIN, t, idle_from, iteration, index, mhz, KINDS.index(kind), power_w)


def encode_records(records: Any) -> bytes:
    """A block of records (a flat array('d') or sequence of floats, RECORD_FIELDS per record) as bytes."""
    arr = records if isinstance(records, array) else array("d", records)
    return b"R %d\n" % (len(arr) // RECORD_FIELDS) + arr.tobytes()


def encode_control(msg: dict[str, Any]) -> bytes:
    """A rare message (answer, reset, close, parent_gone) as one JSON line."""
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


class FrameReader:
    """Splits the controller's input stream into record blocks (array('d')) and control messages (dict)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[Any]:
        """Everything complete in what has arrived so far, in order; the rest waits for more bytes."""
        buf = self._buf + data if self._buf else data
        out: list[Any] = []
        pos = 0
        while pos < len(buf):
            nl = buf.find(b"\n", pos)
            if nl < 0:
                break
            if buf[pos : pos + 2] == b"R ":
                count = buf[pos + 2 : nl]
                if not count.isdigit():
                    raise ValueError(f"bad clock controller message header {buf[pos:nl][:40]!r}")
                end = nl + 1 + int(count) * RECORD_FIELDS * 8
                if end > len(buf):
                    break
                block = array("d")
                block.frombytes(buf[nl + 1 : end])
                out.append(block)
                pos = end
                continue
            line = buf[pos:nl].strip()
            pos = nl + 1
            if not line:
                continue
            if line[:1] != b"{":
                raise ValueError(f"unknown clock controller message {line[:40]!r}")
            out.append(json.loads(line))
        self._buf = buf[pos:]
        return out
