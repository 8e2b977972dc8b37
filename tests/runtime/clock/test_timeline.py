"""The controller's simulated time line: decisions and energy at the records' own times."""

from __future__ import annotations

import time

import pytest
from clock_util import decisions, records, sim

from kareus_megatron.hardware.device import simulation_of
from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.device.sim_model import DEFAULT_COMPUTE_ACTIVITY as ACT_C
from kareus_megatron.hardware.device.sim_model import DEFAULT_MEMORY_ACTIVITY as ACT_M
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.hardware.power import power_w
from kareus_megatron.runtime.clock.controller import ClockController
from kareus_megatron.runtime.clock.wire import CODE_MARK, begin_record, encode_control, encode_records


def test_simulated_time_line_decides_at_the_records_own_times(tmp_path):
    """Decisions follow the records' timestamps, however late and batched they arrive."""
    dev = sim(tmp_path, latency_s=0.010)
    ctl = ClockController(dev, lambda m: None, simulation=simulation_of(dev))
    ready = ctl.probe()
    assert ready["op"] == "ready" and ready["backend"] == "simulated" and ready["busy_events"]
    assert ready["latency_s"] == pytest.approx(0.010)
    t = time.monotonic() - 5.0  # the records arrive long after the fact
    begins = [(0.0, 1200), (0.001, 1005), (0.002, 990), (0.030, 990)]
    ctl.feed(
        encode_records(
            [
                x
                for k, (dt, m) in enumerate(begins)
                for x in begin_record(t + dt, 0, k, m, "forward" if k < 3 else "backward")
            ]
        )
    )
    assert ctl._inbox.empty()  # nothing for the wall-time loop
    # 1200 is called at once (busy until +10 ms); 1005 waits and is overtaken by 990, which is called
    # when the device is free (+10 ms, done +20 ms): 8 ms after its begin, more than half a latency: late;
    # at +30 ms 990 is already locked.
    log = tmp_path / "clocks.jsonl"
    assert decisions(log) == [
        ("set", 1200, None),
        ("skip", 1005, "stale"),
        ("set", 990, None),
        ("skip", 990, "unchanged"),
    ]
    sets = [r for r in records(log) if r["event"] == "set"]
    assert sets[0]["t_done"] == pytest.approx(t + 0.010) and sets[1]["t_issue"] == pytest.approx(t + 0.010)
    assert ctl.counts == {"applied": 2, "late": 1, "stale": 1, "unchanged": 1, "errors": 0}


def test_reset_overtakes_a_waiting_call(tmp_path):
    """A begin still waiting for the simulated device when a reset comes is skipped as stale."""
    dev = sim(tmp_path, latency_s=5.0)  # the first call keeps the device busy for 5 s
    replies = []
    ctl = ClockController(dev, replies.append, simulation=simulation_of(dev))
    ctl.probe()
    t = time.monotonic()
    ctl.feed(
        encode_records([*begin_record(t, 0, 0, 1200, "forward"), *begin_record(t + 0.001, 0, 1, 990, "forward")])
        + encode_control({"op": "reset", "seq": 1})
        + encode_control({"op": "close", "seq": 2})
    )
    assert ctl.run() == "closed"
    assert decisions(tmp_path / "clocks.jsonl") == [("set", 1200, None), ("skip", 990, "stale")]
    assert ctl.counts["stale"] == 1 and replies[0] == {"op": "ack", "seq": 1}


def test_marks_count_busy_time_at_their_own_time(tmp_path):
    """Busy/idle edges and a mark that arrive together are accounted at their timestamps."""
    spec = gpu_spec("a100-sxm4-40gb")
    dev = SimulatedGPU(spec, 0, log_path=None, latency_s=0.0)
    replies = []
    ctl = ClockController(dev, replies.append, simulation=simulation_of(dev))
    ctl.probe()
    t0 = time.monotonic()
    time.sleep(0.06)
    nan = float("nan")
    # mark 1 at t0; instruction 0 runs t0+10 ms .. t0+40 ms (its end rides along with mark 2)
    ctl.feed(
        encode_records(
            [
                CODE_MARK,
                t0,
                nan,
                1.0,
                0.0,
                0.0,
                0.0,
                0.0,
                *begin_record(t0 + 0.01, 0, 0, 1410, "forward"),
                CODE_MARK,
                t0 + 0.05,
                t0 + 0.04,
                2.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ]
        )
    )
    e1, e2 = (r["energy_j"] for r in replies)
    want = float(power_w(spec, 1410, ACT_C, ACT_M)) * 0.03 + spec.p_blocked_w * 0.02
    assert e2 - e1 == pytest.approx(want, rel=1e-6)


def test_simulated_energy_follows_the_scheduled_clock():
    """Busy power switches to the new clock at the call's end, even when the edges arrive afterwards."""
    spec = gpu_spec("a100-sxm4-40gb")
    gpu = SimulatedGPU(spec, 0, latency_s=0.010)
    t0 = time.monotonic()
    time.sleep(0.08)  # edges and the call lie in the past when they are given, as in batches
    gpu.busy_edges([t0, 1.0])
    base = gpu.energy_j_at(t0)
    done = gpu.schedule_sm_clock(1005, t0)  # locks 1005 MHz at t0 + 10 ms
    gpu.busy_edges([t0 + 0.05, 0.0])  # busy from t0 to t0 + 50 ms, then idle
    p_max = float(power_w(spec, spec.max_sm_clock_mhz, ACT_C, ACT_M))
    p_low = float(power_w(spec, 1005, ACT_C, ACT_M))
    want = p_max * (done - t0) + p_low * (t0 + 0.05 - done) + spec.p_blocked_w * 0.01
    assert gpu.energy_j_at(t0 + 0.06) - base == pytest.approx(want, rel=1e-9)
    assert p_low < p_max


def test_busy_edges_account_like_set_busy():
    """The controller's batched busy/idle edges give the energy set_busy gives edge by edge."""
    spec = gpu_spec("a100-sxm4-40gb")
    one, many = SimulatedGPU(spec, 0, latency_s=0.0), SimulatedGPU(spec, 0, latency_s=0.0)
    t0 = time.monotonic() + 0.02
    base = []
    for dev in (one, many):  # the same starting point on both
        dev.set_busy(False, t0 - 0.01)
        base.append(dev._energy_j)
    edges = [(t0 + k * 0.001 + (0.0004 if k % 2 else 0.0), k % 2 == 0) for k in range(40)]
    time.sleep(0.08)  # read the energy once every edge lies in the past
    for t, busy in edges:
        one.set_busy(busy, t)
    many.busy_edges([x for t, busy in edges for x in (t, 1.0 if busy else 0.0)])
    t_end = edges[-1][0]
    e_one, e_many = one.energy_j_at(t_end) - base[0], many.energy_j_at(t_end) - base[1]
    assert e_many == pytest.approx(e_one, rel=1e-9)
    assert e_many > spec.p_blocked_w * (t_end - t0 + 0.01) * 1.1  # busy power counted


def test_a_begin_asking_for_the_clock_already_asked_for_changes_nothing(tmp_path):
    """While a call is in flight or waiting, begins at the clock already asked for are unchanged, not stale, and
    the waiting call keeps the time of the begin that asked first (so its lateness is measured from there)."""
    dev = sim(tmp_path, latency_s=0.010)
    ctl = ClockController(dev, lambda m: None, simulation=simulation_of(dev))
    ctl.probe()
    t = time.monotonic() - 5.0
    begins = [(0.0, 1200), (0.003, 1200), (0.004, 990), (0.006, 990), (0.008, 990), (0.030, 990)]
    ctl.feed(encode_records([x for k, (dt, m) in enumerate(begins) for x in begin_record(t + dt, 0, k, m, "forward")]))
    # 1200 at once (busy to +10 ms); 1200 again: unchanged; 990 waits from +4 ms and is called at +10 ms: 6 ms
    # after its begin, more than half the 10 ms latency: late (measured from the +8 ms repeat it would not be);
    # its repeats at +6, +8 and +30 ms: unchanged
    assert ctl.counts == {"applied": 2, "late": 1, "stale": 0, "unchanged": 4, "errors": 0}
    sets = [r for r in records(tmp_path / "clocks.jsonl") if r["event"] == "set"]
    assert sets[1]["mhz"] == 990 and sets[1]["t_issue"] == pytest.approx(t + 0.010)
