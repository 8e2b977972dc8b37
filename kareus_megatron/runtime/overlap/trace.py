"""Trace mode: the order in which a rank starts compute ops and issues and waits collectives.

One event per line of the JSON ``events`` list, in program order (``seq``), with ``t_s`` from
``time.perf_counter`` (s; host time of the call, not of the device kernel). Kinds:

- ``op``: a compute op of one nanobatch is about to start (``op`` is a vocab op name,
  ``partition`` the partition whose compute segment it belongs to, ``""`` for the backward tail and
  for segments with no overlap partner).
- ``issue`` / ``wait``: a collective (``coll``, e.g. ``L1.fwd.attn.nb0``) of nanobatch ``nb`` is issued
  (async) or waited for; ``partition`` names the partition it overlaps (``""`` for the layer's last
  collective, which has no partner segment); ``comm_sms`` is the requested SM count and
  ``sm_limit_requested`` whether the collective went to an SM-limited communicator (NCCL yes, unless NCCL's
  environment dropped that count; gloo no): NCCL may still run it on fewer CTAs; issue events also name the
  ``collective`` (``all_reduce``, or with sequence parallelism ``all_gather`` / ``reduce_scatter``; the
  backward's leading all-gathers of the output gradient have no partition: exposed).

Every event also carries ``phase`` (forward/backward/recompute), ``layer`` (megatron layer_number),
``mb`` and ``instr`` (the plan instruction's microbatch and index, None outside a plan).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

TRACE_FORMAT = "kareus-overlap-trace/1"


class Tracer:
    """Collects trace events in memory while enabled; ``dump`` writes them as one JSON file."""

    def __init__(self, enabled: bool = False, rank: int = 0, max_events: int = 1_000_000) -> None:
        self.enabled = enabled
        self.rank = rank
        self.max_events = max_events  # recording stops there (a long run would otherwise grow without bound)
        self.truncated = False
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        """Record one event (no-op when disabled or full)."""
        if not self.enabled:
            return
        if len(self.events) >= self.max_events:
            self.truncated = True
            return
        self.events.append({"seq": len(self.events), "t_s": time.perf_counter(), "kind": kind, **fields})

    def clear(self) -> None:
        """Drop the recorded events."""
        self.events.clear()

    def dump(self, path: str | Path, **meta: Any) -> Path:
        """Write the events (and `meta`) to `path` as JSON; return the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        doc = {"format": TRACE_FORMAT, "rank": self.rank, "truncated": self.truncated, **meta, "events": self.events}
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(p)
        return p


def overlap_violations(events: list[dict[str, Any]]) -> list[str]:
    """Check the overlap structure of a trace; return one message per collective that breaks it.

    For every collective with a partition: the next op event after its issue must be an op of the
    *other* nanobatch named by the planned launch slot (``slot`` field of the issue event), and at least
    one op of the other nanobatch must start between its issue and its wait.
    """
    bad: list[str] = []
    waits = {(e["coll"], e["phase"], e.get("call")): e["seq"] for e in events if e["kind"] == "wait"}
    ops = [e for e in events if e["kind"] == "op"]
    for e in events:
        if e["kind"] != "issue" or not e.get("partition"):
            continue
        key = (e["coll"], e["phase"], e.get("call"))
        if key not in waits:
            bad.append(f"{e['coll']} ({e['phase']}): issued, never waited")
            continue
        after = [o for o in ops if o["seq"] > e["seq"] and o.get("call") == e.get("call")]
        if not after or after[0]["nb"] == e["nb"] or after[0]["op"] != e["slot"]:
            nxt = f"{after[0]['op']} nb{after[0]['nb']}" if after else "nothing"
            bad.append(f"{e['coll']} ({e['phase']}): next op after issue is {nxt}, planned {e['slot']}")
            continue
        between = [o for o in after if o["seq"] < waits[key] and o["nb"] != e["nb"]]
        if not between:
            bad.append(f"{e['coll']} ({e['phase']}): no op of another nanobatch between issue and wait")
    return bad
