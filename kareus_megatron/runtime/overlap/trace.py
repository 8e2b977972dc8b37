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
  backward's leading all-gathers of the output gradient have no partition: exposed), its message size
  ``bytes`` (nccl-tests convention), the global ``ranks`` of its group, and ``whole`` (True when it carries
  every nanobatch half of the call at once: a 1-nanobatch instruction on a graph of halves). Collectives over
  a group of one rank move nothing and are not recorded.

``traced_collectives(events)`` turns a trace into the per-collective list that search/collective_list.py
gives for the plan (phase, layer, vocab collective kind, bytes, ranks, partner), the partner read from what
ran between the issue and the wait: the one partition of the ops there, ``"tail"`` when they have none (the
backward tails; cross-layer overlap's prefetched unit), ``"exposed"`` when no op ran.

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
        self._ranks: dict[Any, list[int]] = {}

    def ranks(self, group: Any) -> list[int]:
        """Global ranks of process group `group` (cached; [rank] without torch.distributed)."""
        if group not in self._ranks:
            import torch.distributed as dist

            init = dist.is_available() and dist.is_initialized()
            self._ranks[group] = [int(r) for r in dist.get_process_group_ranks(group)] if init else [self.rank]
        return self._ranks[group]

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


# trace ``collective`` → the planner's collective kind (kareus_megatron.vocab)
VOCAB_COLLECTIVE = {
    "all_reduce": "tp_all_reduce",
    "all_gather": "tp_all_gather",
    "reduce_scatter": "tp_reduce_scatter",
    "cp_all_gather": "cp_all_gather",
    "cp_reduce_scatter": "cp_reduce_scatter",
}
# ops the engine reports that the planner's op graph folds into others (the output bias-dropout-add: into the
# next layer's input_norm, workload/opgraph.py): no partner of their own
FOLDED_OPS = ("bda",)


def traced_collectives(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every traced collective in issue order as {instr, phase, layer, collective, bytes, ranks, partner} (see the
    module docstring); ``layer`` is the megatron layer number of the layer that produced it (from its name),
    ``instr`` the plan instruction's index (None outside a plan)."""
    open_: dict[tuple[str, Any], int] = {}  # (coll, call) -> index into out, while issued and not yet waited
    between: list[list[dict[str, Any]]] = []
    out: list[dict[str, Any]] = []
    for e in events:
        if e["kind"] == "issue":
            open_[(e["coll"], e.get("call"))] = len(out)
            between.append([])
            out.append(
                {
                    "instr": e.get("instr"),
                    "phase": e["phase"],
                    "layer": int(e["coll"].split(".", 1)[0].lstrip("L")),
                    "collective": VOCAB_COLLECTIVE[e["collective"]],
                    "bytes": e["bytes"],
                    "ranks": list(e["ranks"]),
                    "partner": "exposed",
                }
            )
        elif e["kind"] == "wait":
            open_.pop((e["coll"], e.get("call")), None)
        elif e["kind"] == "op" and e["op"] not in FOLDED_OPS:
            for k in open_.values():
                between[k].append(e)
    for rec, ran in zip(out, between):
        parts = sorted({o["partition"] for o in ran if o["partition"]})
        rec["partner"] = "+".join(parts) if parts else ("tail" if ran else "exposed")
    return out
