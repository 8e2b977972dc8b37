"""Clock controller, wall-time (NVML) path: stale and unchanged skips, the decision log, the ready
message; the simulated time line is in test_timeline.py."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
from clock_util import decisions, records

from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.runtime.clock.controller import ClockController
from kareus_megatron.runtime.clock.wire import begin_record, encode_control, encode_records

ROOT = Path(__file__).resolve().parents[3]


def _plain_device():
    """A simulated GPU used as a plain GPUDevice: without its SimulationHooks the controller drives it
    exactly as it drives NVML (wall time, blocking clock calls, its own decision log)."""
    return SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0, log_path=None, latency_s=0.0)


def test_batch_applies_latest_and_skips_stale(tmp_path):
    """Of the begins that arrived during a clock call, the latest wins."""
    log = tmp_path / "clocks.jsonl"
    ctl = ClockController(_plain_device(), lambda m: None, simulation=None, log_path=str(log))
    ready = ctl.probe()
    assert ready["op"] == "ready" and ready["backend"] == "nvml" and not ready["busy_events"]
    assert ready["latency_s"] is None
    t = time.monotonic()
    # three instructions began while the controller was busy
    ctl.feed(encode_records([x for k, m in enumerate((1200, 1005, 990)) for x in begin_record(t, 0, k, m, "forward")]))
    ctl._handle(ctl._inbox.get_nowait())
    ctl.feed(encode_records(begin_record(t, 0, 3, 990, "backward")))
    ctl._handle(ctl._inbox.get_nowait())
    assert decisions(log) == [
        ("skip", 1200, "stale"),
        ("skip", 1005, "stale"),
        ("set", 990, None),
        ("skip", 990, "unchanged"),
    ]
    recs = records(log)
    assert (recs[0]["event"], recs[0]["reason"]) == ("reset", "start")  # the permission probe
    skip = next(r for r in recs if r["event"] == "skip")
    assert (skip["iteration"], skip["index"], skip["kind"]) == (0, 0, "forward")
    assert set(skip) == {"t", "pid", "gpu", "event", "mhz", "reason", "iteration", "index", "kind"}
    assert ctl.counts == {"applied": 1, "late": 0, "stale": 2, "unchanged": 1, "errors": 0}
    assert ctl.device.sm_clock_mhz() == 990


def test_unlogged_block_passes_on_only_its_last_begin():
    """Without a decision log, a block of begins reaches the control loop as (overtaken count, last)."""
    ctl = ClockController(_plain_device(), lambda m: None, simulation=None)
    assert ctl.probe()["op"] == "ready"
    t = time.monotonic()
    mhz = (1200, 1005, 990, 1410, 1095)
    ctl.feed(encode_records([x for k, m in enumerate(mhz) for x in begin_record(t + k * 1e-3, 0, k, m, "forward")]))
    batch = ctl._inbox.get_nowait()
    assert batch == [("stale", 4), (1095, 0, 4, 0, pytest.approx(t + 4e-3))]
    ctl._handle(batch)
    assert ctl.counts == {"applied": 1, "late": 0, "stale": 4, "unchanged": 0, "errors": 0}
    assert ctl.device.sm_clock_mhz() == 1095


def test_a_change_made_long_after_its_begin_counts_late(tmp_path):
    """Wall time: a call made more than half the preset's clock latency after its instruction began is late
    (counted, its set line carries late_s); the mark answers carry the applied and late counts."""
    log = tmp_path / "clocks.jsonl"
    ctl = ClockController(_plain_device(), lambda m: None, simulation=None, log_path=str(log))
    ctl.probe()
    assert ctl.decisions.late_after_s == pytest.approx(gpu_spec("a100-sxm4-40gb").clock_latency_s / 2)
    t = time.monotonic()
    ctl.feed(encode_records(begin_record(t - 0.5, 0, 0, 1200, "forward")))  # began 0.5 s before it arrives
    ctl._handle(ctl._inbox.get_nowait())
    ctl.feed(encode_records(begin_record(time.monotonic(), 0, 1, 990, "backward")))  # on time
    ctl._handle(ctl._inbox.get_nowait())
    assert ctl.counts == {"applied": 2, "late": 1, "stale": 0, "unchanged": 0, "errors": 0}
    sets = [r for r in records(log) if r["event"] == "set"]
    assert sets[0]["late_s"] >= 0.5 and "late_s" not in sets[1]
    mark = ctl.decisions.mark(1, t, lambda: 0.0)
    assert (mark["applied"], mark["late"], mark["stale"]) == (2, 1, 0)


def test_reset_and_close_settle_then_reset(tmp_path):
    """A reset first skips the begin queued before it, then resets; close acknowledges with the counts."""
    log = tmp_path / "clocks.jsonl"
    replies = []
    ctl = ClockController(_plain_device(), replies.append, simulation=None, log_path=str(log))
    ctl.probe()
    t = time.monotonic()
    ctl.feed(
        encode_records(begin_record(t, 0, 0, 1200, "forward"))
        + encode_control({"op": "reset", "seq": 4})
        + encode_control({"op": "close", "seq": 5})
    )
    assert ctl.run() == "closed"
    assert [(r["event"], r.get("reason")) for r in records(log)] == [
        ("reset", "start"),
        ("skip", "stale"),
        ("reset", "requested"),
        ("reset", "closed"),
    ]
    assert replies == [
        {"op": "ack", "seq": 4},
        {"op": "ack", "seq": 5, "counts": {"applied": 0, "late": 0, "stale": 1, "unchanged": 0, "errors": 0}},
    ]


def test_marks_read_the_energy_counter_and_lazy_ones_wait():
    replies = []
    ctl = ClockController(_plain_device(), replies.append, simulation=None)
    ctl.probe()
    t = time.monotonic()
    ctl.feed(
        encode_records([3.0, t, float("nan"), 1.0, 0.0, 0.0, 0.0, 0.0, 3.0, t, float("nan"), 2.0, 1.0, 0.0, 0.0, 0.0])
    )
    assert [r["seq"] for r in replies] == [1]  # the lazy mark (b = 1) is held
    ctl.feed(encode_control({"op": "answer"}))
    assert [r["seq"] for r in replies] == [1, 2] and all(r["energy_j"] >= 0 and r["t"] == t for r in replies)


def test_clock_path_never_probes_the_device():
    """The clock path and the session take a simulated GPU's hooks explicitly, never by hasattr/getattr."""
    files = sorted((ROOT / "kareus_megatron" / "runtime" / "clock").glob("*.py"))
    files.append(ROOT / "kareus_megatron" / "runtime" / "session.py")
    found = [
        f"{p.name}:{n.lineno}"
        for p in files
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr")
    ]
    assert not found, found
