"""Clock controller: stale skips, resets on every way out, parent death, permission handling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import ClockControlError
from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.runtime.clock_controller import ClockClient, ClockController
from kareus_megatron.runtime.clock_wire import (
    CODE_MARK,
    NO_TIME,
    FrameReader,
    begin_record,
    encode_control,
    encode_records,
)


def _records(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _decisions(path):
    return [(r["event"], r["mhz"], r.get("reason")) for r in _records(path) if r["event"] in ("set", "skip")]


def _sim(tmp_path, latency_s=0.0, **kw):
    return SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0, log_path=tmp_path / "clocks.jsonl", latency_s=latency_s, **kw)


class _WallClockSim(SimulatedGPU):
    """A simulated GPU without the simulated time line: the controller drives it in wall time, as NVML."""

    schedule_sm_clock = None


def test_batch_applies_latest_and_skips_stale(tmp_path):
    """Wall-time controller (NVML): of the begins that arrived during a clock call, the latest wins."""
    replies = []
    ctl = ClockController(_WallClockSim(gpu_spec("a100-sxm4-40gb"), 0, log_path=tmp_path / "clocks.jsonl",
                                        latency_s=0.0), replies.append)
    assert ctl.probe()["op"] == "ready"
    t = time.monotonic()
    # three instructions began while the controller was busy
    ctl.feed(encode_records([x for k, m in enumerate((1200, 1005, 990)) for x in begin_record(t, 0, k, m, "forward")]))
    ctl._handle(ctl._inbox.get_nowait())
    ctl.feed(encode_records(begin_record(t, 0, 3, 990, "backward")))
    ctl._handle(ctl._inbox.get_nowait())
    assert _decisions(tmp_path / "clocks.jsonl") == [
        ("skip", 1200, "stale"), ("skip", 1005, "stale"), ("set", 990, None), ("skip", 990, "unchanged")
    ]
    skip = next(r for r in _records(tmp_path / "clocks.jsonl") if r["event"] == "skip")
    assert (skip["iteration"], skip["index"], skip["kind"]) == (0, 0, "forward")
    assert ctl.counts == {"applied": 1, "stale": 2, "unchanged": 1, "errors": 0}


def test_simulated_time_line_decides_at_the_records_own_times(tmp_path):
    """Simulated GPU: decisions follow the records' timestamps, however late and batched they arrive."""
    ctl = ClockController(_sim(tmp_path, latency_s=0.010), lambda m: None)
    assert ctl.probe()["op"] == "ready"
    t = time.monotonic() - 5.0  # the records arrive long after the fact
    begins = [(0.0, 1200), (0.001, 1005), (0.002, 990), (0.030, 990)]
    ctl.feed(encode_records([x for k, (dt, m) in enumerate(begins)
                             for x in begin_record(t + dt, 0, k, m, "forward" if k < 3 else "backward")]))
    assert ctl._inbox.empty()  # nothing for the wall-time loop
    # 1200 is called at once (busy until +10 ms); 1005 waits and is overtaken by 990, which is called
    # when the device is free (+10 ms, done +20 ms); at +30 ms 990 is already locked.
    assert _decisions(tmp_path / "clocks.jsonl") == [
        ("set", 1200, None), ("skip", 1005, "stale"), ("set", 990, None), ("skip", 990, "unchanged")
    ]
    sets = [r for r in _records(tmp_path / "clocks.jsonl") if r["event"] == "set"]
    assert sets[0]["t_done"] == pytest.approx(t + 0.010) and sets[1]["t_issue"] == pytest.approx(t + 0.010)
    assert ctl.counts == {"applied": 2, "stale": 1, "unchanged": 1, "errors": 0}


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
    from kareus_megatron.hardware.power import power_w

    p_max = float(power_w(spec, spec.max_sm_clock_mhz, 0.8, 0.4))
    p_low = float(power_w(spec, 1005, 0.8, 0.4))
    want = p_max * (done - t0) + p_low * (t0 + 0.05 - done) + spec.p_blocked_w * 0.01
    assert gpu.energy_j_at(t0 + 0.06) - base == pytest.approx(want, rel=1e-9)
    assert p_low < p_max


def test_unlogged_block_passes_on_only_its_last_begin(tmp_path):
    """Without a decision log, a block of begins reaches the control loop as (overtaken count, last)."""
    ctl = ClockController(_WallClockSim(gpu_spec("a100-sxm4-40gb"), 0, log_path=None, latency_s=0.0),
                          lambda m: None)
    assert ctl.probe()["op"] == "ready"
    t = time.monotonic()
    mhz = (1200, 1005, 990, 1410, 1095)
    ctl.feed(encode_records([x for k, m in enumerate(mhz) for x in begin_record(t + k * 1e-3, 0, k, m, "forward")]))
    batch = ctl._inbox.get_nowait()
    assert batch == [("stale", 4), (1095, 0, 4, 0)]
    ctl._handle(batch)
    assert ctl.counts == {"applied": 1, "stale": 4, "unchanged": 0, "errors": 0}
    assert ctl.device.sm_clock_mhz() == 1095


def test_thread_mode_applies_in_order_and_resets_on_close(tmp_path):
    client = ClockClient()
    ready = client.start_thread(_sim(tmp_path, latency_s=0.002))
    assert ready["op"] == "ready" and ready["gpu"] == "a100-sxm4-40gb" and 1410 in ready["supported"]
    seq = [1200, 1005, 1005, 1410, 990]
    start = client.mark()
    for k, mhz in enumerate(seq):
        client.instruction_begins(0, k, mhz, "forward")
        # each change is handled before the next instruction begins: nothing goes stale
        assert _wait_for(lambda: len(_decisions(tmp_path / "clocks.jsonl")) == k + 1, 5)
        time.sleep(0.01)
        client.instruction_ends()
    end = client.mark()
    assert start.wait() and end.wait()
    assert end.t - start.t >= 0.05 and end.energy_j > start.energy_j
    client.close()
    assert [(e, m) for e, m, _ in _decisions(tmp_path / "clocks.jsonl")] == [("set", m) if k != 2 else ("skip", m)
                                                                           for k, m in enumerate(seq)]
    events = [r["event"] for r in _records(tmp_path / "clocks.jsonl")]
    assert events[-2:] == ["reset", "close"]
    assert client.counts == {"applied": 4, "stale": 0, "unchanged": 1, "errors": 0}


def test_reset_request_waits_for_queued_changes(tmp_path):
    client = ClockClient()
    client.start_thread(_sim(tmp_path, latency_s=0.001))
    client.instruction_begins(0, 0, 1200, "forward")
    assert client.reset(timeout_s=5.0)
    events = [(r["event"], r.get("reason")) for r in _records(tmp_path / "clocks.jsonl")]
    assert events[-1] == ("reset", None) or events[-1][0] == "reset"
    client.close()


def test_no_permission_reported_at_start(tmp_path):
    client = ClockClient()
    ready = client.start_thread(_sim(tmp_path, deny_clock_control=True))
    assert ready["op"] == "error" and ready["type"] == "ClockControlError"
    assert not client.clock_control
    client.instruction_begins(0, 0, 1200, "forward")  # ignored: training runs at default clocks
    ticket = client.mark()
    assert ticket.wait() and ticket.energy_j >= 0  # energy is still measured
    client.close()
    assert _decisions(tmp_path / "clocks.jsonl") == []


# ---- side process: signals and parent death ----------------------------------------------------

_TRAINER = textwrap.dedent(
    """
    import sys, time
    from kareus_megatron.runtime.clock_controller import ClockClient
    c = ClockClient()
    ready = c.start_process(0)
    c.instruction_begins(0, 0, 1200, "forward")
    print(c.controller_pid, flush=True)
    time.sleep(60)
    """
)


def _env(tmp_path, **extra):
    env = dict(os.environ, KAREUS_GPU_BACKEND="simulated", KAREUS_SIMULATED_LOG=str(tmp_path / "clocks.jsonl"),
               KAREUS_SIMULATED_LATENCY_MS="15", **extra)
    env.pop("KAREUS_GPU", None)
    return env


def _wait_for(pred, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _pid_alive(pid):
    """True while `pid` runs (a zombie waiting for its parent to reap it counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_trainer(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER], stdout=subprocess.PIPE, env=_env(tmp_path), text=True)
    ctl_pid = int(proc.stdout.readline())
    log = tmp_path / "clocks.jsonl"
    assert _wait_for(lambda: any(r["event"] == "set" for r in _records(log)), 10)
    return proc, ctl_pid, log


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_trainer_leaves_reset_within_one_second(tmp_path, sig):
    proc, ctl_pid, log = _start_trainer(tmp_path)
    proc.send_signal(sig)
    t_kill = time.monotonic()
    proc.wait()
    assert _wait_for(lambda: [r for r in _records(log) if r["event"] == "reset" and r["t"] > t_kill], 3)
    reset = next(r for r in _records(log) if r["event"] == "reset" and r["t"] > t_kill)
    assert reset["t"] - t_kill < 1.0
    assert _wait_for(lambda: not _pid_alive(ctl_pid), 3)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_controller_resets_on_signal(tmp_path, sig):
    proc, ctl_pid, log = _start_trainer(tmp_path)
    try:
        t_sig = time.monotonic()
        os.kill(ctl_pid, sig)
        assert _wait_for(lambda: [r for r in _records(log) if r["event"] == "reset" and r["t"] > t_sig], 3)
        assert _wait_for(lambda: not _pid_alive(ctl_pid), 3)
    finally:
        proc.kill()
        proc.wait()


def test_process_start_error_is_typed(tmp_path):
    client = ClockClient()
    env_backup = dict(os.environ)
    os.environ.update(KAREUS_GPU_BACKEND="simulated", KAREUS_SIMULATED_NO_PERMISSION="1")
    try:
        ready = client.start_process(0, gpu="a100-sxm4-40gb")
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    assert ready["op"] == "error" and "no permission" in ready["message"]
    client.close()
    with pytest.raises(Exception, match="unknown GPU 'nope'"):
        ClockClient().start_process(0, backend="simulated", gpu="nope")


def test_session_fail_and_warn_on_no_permission(monkeypatch, tmp_path):
    import plans

    from kareus_megatron.runtime.session import RuntimeSession

    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_NO_PERMISSION", "1")
    with pytest.raises(ClockControlError, match="no permission"):
        RuntimeSession(plans.tiny_plan(), controller="thread").start()
    with pytest.warns(UserWarning, match="training at default clocks"):
        s = RuntimeSession(plans.tiny_plan(), controller="thread", on_error="warn").start()
    assert not s.client.clock_control
    s.close()


def test_training_continues_when_controller_dies(tmp_path, monkeypatch):
    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    client = ClockClient()
    client.start_process(0, gpu="a100-sxm4-40gb")
    first = client.mark()
    assert first.wait(10) and first.energy_j >= 0
    os.kill(client.controller_pid, signal.SIGTERM)
    assert _wait_for(lambda: client.gone, 5)
    client.instruction_begins(0, 0, 1200, "forward")  # no error, no wait
    late = client.mark()
    assert late.wait(0.1) and late.energy_j != late.energy_j  # NaN at once
    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 1.0
    assert [r["event"] for r in _records(tmp_path / "clocks.jsonl")][-2:] == ["reset", "close"]


class _GpuPoint:
    """Stands in for a recorded CUDA event: synchronize() returns once the test says the GPU got there."""

    def __init__(self) -> None:
        import threading

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
    client.start_thread(_sim(tmp_path, latency_s=0.0))
    client.instruction_begins(0, 0, 1200, "forward")  # the CPU runs ahead: both are queued at once
    client.instruction_begins(0, 1, 990, "backward")
    time.sleep(0.1)
    assert _decisions(tmp_path / "clocks.jsonl") == []  # the GPU has reached neither boundary
    points[0].release()
    assert _wait_for(lambda: len(_decisions(tmp_path / "clocks.jsonl")) == 1, 5)
    assert _decisions(tmp_path / "clocks.jsonl") == [("set", 1200, None)]
    time.sleep(0.05)
    points[1].release()
    assert _wait_for(lambda: len(_decisions(tmp_path / "clocks.jsonl")) == 2, 5)
    sets = [r for r in _records(tmp_path / "clocks.jsonl") if r["event"] == "set"]
    assert sets[1]["mhz"] == 990 and sets[1]["t"] >= points[1].released_at
    client.close()


def test_coalescing_window_from_env(monkeypatch):
    from kareus_megatron.errors import ConfigError
    from kareus_megatron.runtime.clock_client import CPU_COALESCE_S, coalesce_from_env

    monkeypatch.delenv("KAREUS_CLOCK_COALESCE_MS", raising=False)
    assert ClockClient()._coalesce_s == CPU_COALESCE_S and ClockClient(event_factory=object)._coalesce_s == 0.0
    monkeypatch.setenv("KAREUS_CLOCK_COALESCE_MS", "20")
    assert ClockClient()._coalesce_s == pytest.approx(0.02)
    for bad in ("x", "-1", "5000"):
        monkeypatch.setenv("KAREUS_CLOCK_COALESCE_MS", bad)
        with pytest.raises(ConfigError, match="KAREUS_CLOCK_COALESCE_MS"):
            coalesce_from_env(0.0)


def test_wire_format_round_trip_in_any_chunks():
    t = time.monotonic()
    items = [[*begin_record(t, 3, 2, 1200, "forward", t - 1e-3), *begin_record(t, 3, 3, 990, "backward")],
             {"op": "reset", "seq": 7}, [CODE_MARK, t, NO_TIME, 5.0, 1.0, 0.0, 0.0], {"op": "answer"}]
    data = b"".join(encode_records(i) if isinstance(i, list) else encode_control(i) for i in items)
    for step in (1, 3, 8, 57, len(data)):  # however the pipe splits the stream
        reader, got = FrameReader(), []
        for k in range(0, len(data), step):
            got += reader.feed(data[k:k + step])
        assert [list(g) if not isinstance(g, dict) else g for g in got] == \
            [[x if x == x else pytest.approx(x, nan_ok=True) for x in i] if isinstance(i, list) else i for i in items]
    with pytest.raises(ValueError, match="unknown clock controller message"):
        FrameReader().feed(b"x 1 2\n")


def test_cpu_client_sends_per_window_and_holds_mark_answers(tmp_path, monkeypatch):
    """CPU: no forwarder; the sender thread writes what gathered per window; lazy mark answers wait
    until asked for."""
    import threading

    from kareus_megatron.runtime import clock_controller

    monkeypatch.delenv("KAREUS_CLOCK_COALESCE_MS", raising=False)
    client = ClockClient(coalesce_s=0.012)
    client.start_thread(_sim(tmp_path, latency_s=0.012))
    names = {t.name for t in threading.enumerate()}
    assert "kareus-clock-sender" in names and "kareus-clock-forwarder" not in names
    tickets = [client.mark() for _ in range(clock_controller.HOLD_MARKS - 1)]
    client.instruction_begins(0, 0, 1200, "forward")
    time.sleep(0.02)
    client.instruction_begins(0, 1, 990, "backward")  # in this window or the next, in order
    assert _wait_for(lambda: len(_decisions(tmp_path / "clocks.jsonl")) == 2, 5)
    assert [m for _, m, _ in _decisions(tmp_path / "clocks.jsonl")] == [1200, 990]
    assert not any(t.done for t in tickets)  # held by the controller: no reply wake-ups yet
    assert tickets[0].wait(5) and all(t.wait(0) for t in tickets)  # waiting asks for them
    assert all(t.energy_j >= 0 for t in tickets)
    client.instruction_begins(0, 2, 1005, "forward")  # left behind by a quiet training thread
    assert _wait_for(lambda: len(_decisions(tmp_path / "clocks.jsonl")) == 3, 5)  # the sender sends it
    client.close()


_record = st.tuples(st.sampled_from([1.0, 2.0, 3.0]), st.floats(0, 1e6), st.one_of(st.just(NO_TIME), st.floats(0, 1e6)),
                    st.integers(0, 10_000), st.integers(0, 500), st.integers(0, 2000), st.integers(0, 1))
_control = st.fixed_dictionaries({"op": st.sampled_from(["answer", "reset", "close"]), "seq": st.integers(0, 10**9)})


@settings(max_examples=60, deadline=None)
@given(items=st.lists(st.one_of(st.lists(_record, min_size=1, max_size=5), _control), max_size=8),
       cuts=st.lists(st.integers(1, 400), max_size=12))
def test_frame_reader_reassembles_any_split(items, cuts):
    """Whatever chunks the pipe delivers, the reader returns the same blocks and control messages."""
    data = b"".join(encode_records([x for r in i for x in r]) if isinstance(i, list) else encode_control(i)
                    for i in items)
    reader, got, pos = FrameReader(), [], 0
    for n in cuts + [len(data)]:
        got += reader.feed(data[pos:pos + n])
        pos += n
    assert pos >= len(data) and reader.feed(b"") == []
    want = [[x for r in i for x in r] if isinstance(i, list) else i for i in items]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, dict):
            assert g == w
        else:
            assert [x for x in g if x == x] == [x for x in w if x == x]  # NaN != NaN: compare the rest
            assert [x != x for x in g] == [x != x for x in w]


@pytest.mark.parametrize("bad", [b"x 1 2\n", b"R 1\n" + bytes(56) + b"garbage\n", b"R -3\n", b"R two\n"])
def test_frame_reader_rejects_unknown_lines(bad):
    with pytest.raises(ValueError, match="clock controller message"):
        FrameReader().feed(bad)


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


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_cpu_helpers_take_only_idle_time(tmp_path, monkeypatch):
    """On a CPU host the sender thread and the simulated GPU's controller process run SCHED_IDLE."""
    import threading

    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    client = ClockClient()
    client.start_process(0, gpu="a100-sxm4-40gb")
    try:
        sender = next(t for t in threading.enumerate() if t.name == "kareus-clock-sender")
        assert _wait_for(lambda: os.sched_getscheduler(sender.native_id) == os.SCHED_IDLE, 5)
        assert _wait_for(lambda: os.sched_getscheduler(client.controller_pid) == os.SCHED_IDLE, 5)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the training thread is left alone
    finally:
        client.close()
