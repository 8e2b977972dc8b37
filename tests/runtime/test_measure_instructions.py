"""Per-instruction columns, temperature/clock fields, tags and events in the run log (runtime/measure/measurement.py,
runtime/measure/instruction_times.py): a real megatron-core run (2 gloo ranks, PP=2, 1F1B and interleaved, simulated
GPUs, clock controller in a side process), and the meter alone (CPU and a stand-in for CUDA events)."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import plans
import pytest
from _dist import MEGATRON_CORE, spawn

from kareus_megatron.errors import ConfigError
from kareus_megatron.report.measurements import ITERATION_KEYS, energy_windows, instruction_samples, run_events
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.runtime.measure.instruction_times import InstructionTimes, TimingEvents
from kareus_megatron.runtime.measure.measurement import RECORD_KEYS, IterationMeter
from kareus_megatron.runtime.measure.rank_files import open_rank_log

M = 4
PROFILE, PLANNED = 3, 2  # iterations before and after the tag switch


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import tiny_gpt
    import torch

    import kareus_megatron.megatron as kareus

    tiny_gpt.setup(rank, world, port)
    for vp in (1, 2):
        tiny_gpt.init_parallel(2, vp if vp > 1 else None)
        session = kareus.install(plans.tiny_plan(pp=2, vp=vp, m=M, seed=vp), log_path=os.path.join(out_dir, f"vp{vp}"))
        try:
            chunks = tiny_gpt.build_chunks(2, vp if vp > 1 else None)
            session.meter.set_tags(phase="profile")
            tiny_gpt.train(chunks, M, PROFILE, forward_only_every=1)  # evaluation passes are not instructions
            session.meter.event("switch", to="plan", plan_version=2)
            session.meter.set_tags(phase="plan", plan_version=2)
            tiny_gpt.train(chunks, M, PLANNED)
        finally:
            kareus.uninstall()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("measure")
    spawn(
        _worker,
        2,
        str(out),
        env={
            "KAREUS_GPU_BACKEND": "simulated",
            "KAREUS_SIMULATED_LATENCY_MS": "1",
            "KAREUS_GPU": None,
            "KAREUS_LOG_INSTRUCTIONS": None,
        },
        preload=MEGATRON_CORE,
    )
    return {vp: read_run_log(out / f"vp{vp}") for vp in (1, 2)}


@pytest.mark.parametrize("vp", [1, 2])
def test_every_planned_instruction_of_every_iteration_is_logged(logs, vp):
    log = logs[vp]
    plan = plans.tiny_plan(pp=2, vp=vp, m=M, seed=vp)
    assert [r["iteration"] for r in log.iterations] == list(range(PROFILE + PLANNED)) and not log.partial
    for rec in log.iterations:
        assert [line["rank"] for line in rec["ranks"]] == [0, 1]
        for line in rec["ranks"]:
            cols = line["instructions"]
            planned = plan.stages[line["pp_rank"]].instructions
            assert cols["index"] == list(range(len(planned)))  # the plan's order is the order they ran
            assert cols["kind"] == "".join("F" if i.kind == "forward" else "B" for i in planned)
            assert cols["chunk"] == [i.chunk for i in planned] and cols["microbatch"] == [i.microbatch for i in planned]
            assert cols["sm_clock_mhz"] == [i.sm_clock_mhz for i in planned]
            times, starts = cols["time_s"], cols["t_start_s"]
            assert all(t is not None and t > 0 for t in times)
            assert sum(times) <= line["time_s"]
            assert all(a + t <= b + 1e-6 for a, t, b in zip(starts, times, starts[1:]))  # one after another
            assert 0 <= starts[0] and starts[-1] + times[-1] <= line["time_s"] + 1e-6
    samples = instruction_samples(log)
    assert len(samples) == (PROFILE + PLANNED) * sum(len(s.instructions) for s in plan.stages)
    assert {s.kind for s in samples} == {"forward", "backward"} and {s.chunk for s in samples} == set(range(vp))


def test_temperature_and_clock_fields_on_the_simulated_gpu(logs):
    plan = plans.tiny_plan(pp=2, vp=1, m=M, seed=1)
    for rec in logs[1].iterations:
        for line in rec["ranks"]:
            assert isinstance(line["temperature_c"], float) and 20.0 < line["temperature_c"] < 100.0
            clocks = set(plan.clock_sequence(line["pp_rank"]))
            assert line["sm_clock_mhz"] is None or line["sm_clock_mhz"] in clocks
            assert isinstance(line["clock_stale"], int) and line["clock_stale"] >= 0
            assert line["clock_errors"] == 0
    assert any(line["sm_clock_mhz"] is not None for rec in logs[1].iterations for line in rec["ranks"])


def test_tags_and_events_round_trip(logs):
    log = logs[1]
    for rec in log.iterations:
        for line in rec["ranks"]:
            want = {"phase": "profile"} if line["iteration"] < PROFILE else {"phase": "plan", "plan_version": 2}
            assert {k: v for k, v in line.items() if k not in ITERATION_KEYS} == want
    events = run_events(log)
    assert sorted(e["rank"] for e in events) == [0, 1]
    for e in events:
        assert e["event"] == "switch" and e["to"] == "plan" and e["plan_version"] == 2
        assert e["iteration"] == PROFILE and e["t"] >= log.iterations[PROFILE - 1]["ranks"][e["rank"]]["t_end"]
    windows = energy_windows(log, min_window_s=1e-9, skip_iterations=1)  # one iteration per window
    # 3: the tag switch lands in it; an iteration whose clock call was skipped as stale (a loaded CI machine, 1 ms
    # simulated latency) is left out too, so the expectation is read from the lines' own counters
    lines = {line["iteration"]: line for rec in log.iterations for line in rec["ranks"] if line["rank"] == 0}
    clean = {(it,) for it in (1, 2, 4) if not lines[it]["clock_stale"] and not lines[it]["clock_errors"]}
    assert {w.iterations for w in windows if w.rank == 0} == clean and clean & {(1,), (2,)}
    first = next(w for w in windows if w.rank == 0 and w.iterations[0] < PROFILE)
    assert first.tags == {"phase": "profile"} and first.temperature_c is not None
    it = first.iterations[0]
    assert sum(first.busy_s.values()) == pytest.approx(sum(log.iterations[it]["ranks"][0]["instructions"]["time_s"]))


def test_the_meter_and_the_reader_agree_on_the_line_keys():
    assert RECORD_KEYS == ITERATION_KEYS


# -- the meter alone ----------------------------------------------------------------------------


def _instrs(n):
    return plans.tiny_plan(pp=1, m=n, gpus_per_node=1).stages[0].instructions


def _meter_run(tmp_path, monkeypatch, env=None, iterations=2):
    if env is not None:
        monkeypatch.setenv("KAREUS_LOG_INSTRUCTIONS", env)
    meter = IterationMeter(open_rank_log(tmp_path / "log", 0), header={"rank": 0, "world": 1}, flush_interval_s=None)
    calls = []
    begins, ends = meter.instruction_callables(lambda *a: calls.append(a), lambda: calls.append("end"))
    planned = _instrs(2)
    meter.set_plan(planned)
    for it in range(iterations):
        meter.begin(it)
        for k, ins in enumerate(planned):
            begins(it, k, ins.sm_clock_mhz, ins.kind)
            time.sleep(0.002)
            ends()
        meter.end(it)
    meter.close()
    return read_run_log(tmp_path / "log"), calls


def test_instruction_columns_turn_off_and_a_bad_value_is_one_line(tmp_path, monkeypatch):
    log, calls = _meter_run(tmp_path / "on", monkeypatch)
    assert len(calls) == 2 * 4 * 2  # 2 iterations of 4 instructions: the wrapped callables still run
    assert all(len(line["instructions"]["time_s"]) == 4 for r in log.iterations for line in r["ranks"])
    log, _ = _meter_run(tmp_path / "off", monkeypatch, env="0")
    assert all("instructions" not in line for r in log.iterations for line in r["ranks"])
    for line in (line for r in log.iterations for line in r["ranks"]):  # no clock controller: unknown
        assert line["temperature_c"] is None and line["sm_clock_mhz"] is None and line["clock_stale"] is None
    monkeypatch.setenv("KAREUS_LOG_INSTRUCTIONS", "yes please")
    with pytest.raises(ConfigError, match=r"^KAREUS_LOG_INSTRUCTIONS='yes please' must be 1 .* or 0"):
        IterationMeter(None)


def test_bad_tags_and_events_are_refused(tmp_path):
    meter = IterationMeter(None, instructions=False)
    with pytest.raises(ConfigError, match="'time_s' is a key of the iteration line"):
        meter.set_tags(time_s=1.0)
    with pytest.raises(ConfigError, match="must be a string, number or bool"):
        meter.set_tags(phase=["a"])
    with pytest.raises(ConfigError, match="field.*iteration are the event line's own keys"):
        meter.event("switch", iteration=3)
    meter.set_tags(phase="a", plan_version=1)
    meter.set_tags(phase=None)  # None removes a tag
    assert meter.tags == {"plan_version": 1}


class _FakeEvent:
    """A stand-in for torch.cuda.Event(enable_timing=True): the 'GPU' reaches it when `reached` says."""

    clock_ms = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t_ms = None
        self.reached = True

    def record(self):
        _FakeEvent.clock_ms[0] += 1.5
        self.t_ms = _FakeEvent.clock_ms[0]

    def query(self):
        return self.reached

    def elapsed_time(self, other):
        return other.t_ms - self.t_ms


class _FakeTorch:
    class cuda:  # noqa: N801 - the attribute path torch.cuda.Event
        Event = _FakeEvent

        @staticmethod
        def current_device():
            return 0

        device = staticmethod(lambda index: contextlib.nullcontext())


class _ThreadDevices:
    """A stand-in for torch.cuda's current device, as the CUDA runtime keeps it: per thread, 0 in a thread that
    never set one; every CUDA call (an event's query, elapsed_time) is made on the calling thread's device
    (where the runtime would make a context, ~0.5 GB, if there was none)."""

    def __init__(self):
        self._local = threading.local()
        self.calls: list[tuple[str, int, str]] = []  # (call, device current then, thread name)
        devices = self

        class Event(_FakeEvent):
            def query(self):
                devices.note("query")
                return super().query()

            def elapsed_time(self, other):
                devices.note("elapsed_time")
                return super().elapsed_time(other)

        self.Event = Event

    def note(self, call):
        self.calls.append((call, self.current_device(), threading.current_thread().name))

    def current_device(self):
        return getattr(self._local, "device", 0)

    def set_device(self, index):
        self._local.device = index

    @contextlib.contextmanager
    def device(self, index):
        prev = self.current_device()
        self.set_device(index)
        try:
            yield
        finally:
            self.set_device(prev)


def test_gpu_stamps_are_timing_events_read_after_the_iteration_and_reused():
    events = TimingEvents(_FakeTorch)
    times = InstructionTimes(events)
    times.set_plan(_instrs(1))  # F, B
    begins, ends = times.wrap(lambda *a: None, lambda: None)
    times.start()  # base event at 1.5 ms
    begins(0, 0, 1410, "forward")  # 3.0 ms
    ends()  # 4.5 ms
    begins(0, 1, 1410, "backward")  # 6.0
    ends()  # 7.5
    taken = times.take()
    cols = times.columns(taken)
    assert cols["kind"] == "FB" and cols["index"] == [0, 1]
    assert cols["t_start_s"] == [0.0015, 0.0045] and cols["time_s"] == [0.0015, 0.0015]
    assert len(events._free) == 5  # every event back in the pool, used again next iteration
    times.start()
    begins(1, 0, 1410, "forward")
    ends()
    taken = times.take()
    assert len(events._free) == 2
    taken[1][-1].reached = False  # the GPU has not passed the last end: unknown, never waited for
    cols = times.columns(taken)
    assert cols["time_s"] == [None] and cols["t_start_s"][0] is not None


def test_a_measurement_only_session_logs_the_temperature(tmp_path):
    from kareus_megatron.hardware.device.sim import SimulatedGPU
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.runtime.frameworks import deepspeed_patch
    from kareus_megatron.runtime.session import RuntimeSession

    session = RuntimeSession(None, framework_patch=deepspeed_patch)  # not started: only its reading is used
    session.device = SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0, log_path=None, latency_s=0.0)
    meter = IterationMeter(
        open_rank_log(tmp_path / "log", 0),
        mark=session._read_now,
        header={"rank": 0, "world": 1},
        flush_interval_s=None,
    )
    meter.begin(0)
    meter.end(0)
    meter.close()
    session.device.close()
    line = read_run_log(tmp_path / "log").iterations[0]["ranks"][0]
    assert isinstance(line["temperature_c"], float) and line["sm_clock_mhz"] is None and line["clock_stale"] is None


def test_the_writer_thread_reads_the_events_on_the_training_threads_device(tmp_path, monkeypatch):
    """Rank 3 of a node trains on CUDA device 3; the meter's writer thread (a thread that never set a device)
    must query and time its events there, not on device 0."""
    cuda = _ThreadDevices()
    fake_torch = type("torch", (), {"cuda": cuda})
    monkeypatch.setattr(TimingEvents, "available", classmethod(lambda cls: cls(fake_torch)))
    cuda.set_device(3)  # the training thread's device (torch.cuda.set_device(local_rank))
    meter = IterationMeter(
        open_rank_log(tmp_path / "log", 3), header={"rank": 3, "world": 4}, flush_interval_s=0.01, instructions=True
    )
    begins, ends = meter.instruction_callables(lambda *a: None, lambda: None)
    meter.set_plan(_instrs(1))
    meter.set_stage(0)
    for it in range(2):
        meter.begin(it)
        begins(it, 0, 1410, "forward")
        ends()
        begins(it, 1, 1410, "backward")
        ends()
        meter.end(it)
    deadline = time.monotonic() + 10.0
    while len(meter.records) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    meter.close()
    assert [r["instructions"]["kind"] for r in meter.records] == ["FB", "FB"]
    assert meter.records[0]["instructions"]["time_s"] == [0.0015, 0.0015]
    by_writer = [c for c in cuda.calls if c[2] == "kareus-log-writer"]
    assert by_writer and {c[1] for c in by_writer} == {3}, cuda.calls  # never device 0
    assert cuda.current_device() == 3
