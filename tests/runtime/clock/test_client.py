"""Clock client and its two transports, with the controller in a thread (side process: test_process.py)."""

from __future__ import annotations

import threading
import time

import pytest
from clock_util import decisions, records, sim, wait_for

from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.device import simulation_of
from kareus_megatron.runtime.clock.client import ClockClient
from kareus_megatron.runtime.clock.decisions import HOLD_MARKS
from kareus_megatron.runtime.clock.transport import coalesce_from_env
from kareus_megatron.runtime.clock.transport_cpu import CPU_COALESCE_S, CpuTransport
from kareus_megatron.runtime.clock.transport_gpu import GpuTransport


def _start(client, dev):
    return client.start_thread(dev, simulation=simulation_of(dev))


def test_transport_is_chosen_once_and_bound_directly():
    cpu, gpu = ClockClient(), ClockClient(event_factory=object)
    assert isinstance(cpu.transport, CpuTransport) and isinstance(gpu.transport, GpuTransport)
    for client in (cpu, gpu):  # the per-instruction path is the transport's own method
        assert client.instruction_begins == client.transport.instruction_begins
        assert client.instruction_ends == client.transport.instruction_ends


def test_thread_mode_applies_in_order_and_resets_on_close(tmp_path):
    client = ClockClient()
    ready = _start(client, sim(tmp_path, latency_s=0.002))
    assert ready["op"] == "ready" and ready["gpu"] == "a100-sxm4-40gb" and 1410 in ready["supported"]
    log = tmp_path / "clocks.jsonl"
    seq = [1200, 1005, 1005, 1410, 990]
    start = client.mark()
    for k, mhz in enumerate(seq):
        client.instruction_begins(0, k, mhz, "forward")
        # each change is handled before the next instruction begins: nothing goes stale
        assert wait_for(lambda k=k: len(decisions(log)) == k + 1, 5)
        time.sleep(0.01)
        client.instruction_ends()
    end = client.mark()
    assert start.wait() and end.wait()
    assert end.t - start.t >= 0.05 and end.energy_j > start.energy_j
    client.close()
    assert [(e, m) for e, m, _ in decisions(log)] == [("set", m) if k != 2 else ("skip", m) for k, m in enumerate(seq)]
    assert [r["event"] for r in records(log)][-2:] == ["reset", "close"]
    assert client.counts == {"applied": 4, "late": 0, "stale": 0, "unchanged": 1, "errors": 0}


def test_reset_request_waits_for_queued_changes(tmp_path):
    client = ClockClient()
    _start(client, sim(tmp_path, latency_s=0.001))
    client.instruction_begins(0, 0, 1200, "forward")
    assert client.reset(timeout_s=5.0)
    events = [(r["event"], r.get("mhz")) for r in records(tmp_path / "clocks.jsonl")]
    assert events[-2:] == [("set", 1200), ("reset", 1410)]
    client.close()


def test_no_permission_reported_at_start(tmp_path):
    client = ClockClient()
    ready = _start(client, sim(tmp_path, deny_clock_control=True))
    assert ready["op"] == "error" and ready["type"] == "ClockControlError"
    assert not client.clock_control
    client.instruction_begins(0, 0, 1200, "forward")  # ignored: training runs at default clocks
    ticket = client.mark()
    assert ticket.wait() and ticket.energy_j >= 0  # energy is still measured
    client.close()
    assert decisions(tmp_path / "clocks.jsonl") == []


def test_nvml_path_gets_no_instruction_ends(tmp_path):
    """Without simulation hooks (NVML) the controller asks for no ends: the client sends none."""
    client = ClockClient()
    ready = client.start_thread(sim(tmp_path), simulation=None, log_path=str(tmp_path / "decisions.jsonl"))
    assert ready["backend"] == "nvml" and not ready["busy_events"]
    assert client.transport.sending and not client.transport.sending_ends
    client.instruction_begins(0, 0, 1200, "forward")
    client.instruction_ends()
    assert wait_for(lambda: decisions(tmp_path / "decisions.jsonl") == [("set", 1200, None)], 5)
    assert client.transport._idle_from != client.transport._idle_from  # the end was not even noted (NaN)
    client.close()


class _GpuPoint:
    """Stands in for a recorded CUDA event: synchronize() returns once the test says the GPU got there."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.released_at: float | None = None

    def synchronize(self) -> None:
        self.reached.wait(10)

    def release(self) -> None:
        self.released_at = time.monotonic()
        self.reached.set()


def test_changes_wait_for_gpu_progress(tmp_path):
    points: list[_GpuPoint] = []

    def factory():
        points.append(_GpuPoint())
        return points[-1]

    client = ClockClient(event_factory=factory)
    _start(client, sim(tmp_path, latency_s=0.0))
    log = tmp_path / "clocks.jsonl"
    client.instruction_begins(0, 0, 1200, "forward")  # the CPU runs ahead: both are queued at once
    client.instruction_begins(0, 1, 990, "backward")
    time.sleep(0.1)
    assert decisions(log) == []  # the GPU has reached neither boundary
    points[0].release()
    assert wait_for(lambda: len(decisions(log)) == 1, 5)
    assert decisions(log) == [("set", 1200, None)]
    time.sleep(0.05)
    points[1].release()
    assert wait_for(lambda: len(decisions(log)) == 2, 5)
    sets = [r for r in records(log) if r["event"] == "set"]
    assert sets[1]["mhz"] == 990 and sets[1]["t"] >= points[1].released_at
    client.close()


def test_coalescing_window_from_env(monkeypatch):
    monkeypatch.delenv("KAREUS_CLOCK_COALESCE_MS", raising=False)
    assert ClockClient().coalesce_s == CPU_COALESCE_S and ClockClient(event_factory=object).coalesce_s == 0.0
    monkeypatch.setenv("KAREUS_CLOCK_COALESCE_MS", "20")
    assert ClockClient().coalesce_s == pytest.approx(0.02)
    for bad in ("x", "-1", "5000"):
        monkeypatch.setenv("KAREUS_CLOCK_COALESCE_MS", bad)
        with pytest.raises(ConfigError, match="KAREUS_CLOCK_COALESCE_MS"):
            coalesce_from_env(0.0)


def test_cpu_client_sends_per_window_and_holds_mark_answers(tmp_path, monkeypatch):
    """CPU: no forwarder; the sender thread writes what gathered per window; lazy mark answers wait
    until asked for."""
    monkeypatch.delenv("KAREUS_CLOCK_COALESCE_MS", raising=False)
    client = ClockClient(coalesce_s=0.012)
    _start(client, sim(tmp_path, latency_s=0.012))
    log = tmp_path / "clocks.jsonl"
    names = {t.name for t in threading.enumerate()}
    assert "kareus-clock-sender" in names and "kareus-clock-forwarder" not in names
    tickets = [client.mark() for _ in range(HOLD_MARKS - 1)]
    client.instruction_begins(0, 0, 1200, "forward")
    time.sleep(0.02)
    client.instruction_begins(0, 1, 990, "backward")  # in this window or the next, in order
    assert wait_for(lambda: len(decisions(log)) == 2, 5)
    assert [m for _, m, _ in decisions(log)] == [1200, 990]
    assert not any(t.done for t in tickets)  # held by the controller: no reply wake-ups yet
    assert tickets[0].wait(5) and all(t.wait(0) for t in tickets)  # waiting asks for them
    assert all(t.energy_j >= 0 for t in tickets)
    client.instruction_begins(0, 2, 1005, "forward")  # left behind by a quiet training thread
    assert wait_for(lambda: len(decisions(log)) == 3, 5)  # the sender sends it
    client.close()


def test_closed_client_answers_marks_at_once(tmp_path):
    client = ClockClient()
    _start(client, sim(tmp_path))
    client.close()
    ticket = client.mark()
    assert ticket.done and ticket.wait(0) and ticket.energy_j != ticket.energy_j  # NaN
    assert client.reset() and client.closed
