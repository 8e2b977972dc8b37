"""The controller's side process: clocks reset on signals and parent death, typed start errors, its
scheduling on a CPU host (SCHED_IDLE) and that of the trainer's helper threads (the trainer's own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from clock_util import records, sim_env, wait_for

from kareus_megatron.runtime.clock.client import ClockClient
from kareus_megatron.runtime.measure.measurement import IterationMeter
from kareus_megatron.runtime.measure.rank_files import open_rank_log

_TRAINER = textwrap.dedent(
    """
    import sys, time
    from kareus_megatron.runtime.clock.client import ClockClient
    c = ClockClient()
    ready = c.start_process(0)
    c.instruction_begins(0, 0, 1200, "forward")
    print(c.controller_pid, flush=True)
    time.sleep(60)
    """
)


def _pid_alive(pid):
    """True while `pid` runs (a zombie waiting for its parent to reap it counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_trainer(tmp_path, ignoring_sigint=False):
    """A trainer whose controller has set a clock; `ignoring_sigint`: started ignoring SIGINT (a script's `cmd &`)."""
    code = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n" if ignoring_sigint else "") + _TRAINER
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=sim_env(tmp_path), text=True)
    ctl_pid = int(proc.stdout.readline())
    log = tmp_path / "clocks.jsonl"
    assert wait_for(lambda: any(r["event"] == "set" for r in records(log)), 10)
    return proc, ctl_pid, log


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_trainer_leaves_reset_within_one_second(tmp_path, sig):
    proc, ctl_pid, log = _start_trainer(tmp_path)
    proc.send_signal(sig)
    t_kill = time.monotonic()
    proc.wait()
    assert wait_for(lambda: [r for r in records(log) if r["event"] == "reset" and r["t"] > t_kill], 3)
    reset = next(r for r in records(log) if r["event"] == "reset" and r["t"] > t_kill)
    assert reset["t"] - t_kill < 1.0
    assert wait_for(lambda: not _pid_alive(ctl_pid), 3)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_controller_resets_on_signal(tmp_path, sig):
    proc, ctl_pid, log = _start_trainer(tmp_path)
    try:
        with open(f"/proc/{ctl_pid}/cmdline", "rb") as f:  # started as its own module
            assert b"kareus_megatron.runtime.clock.process" in f.read().split(b"\0")
        t_sig = time.monotonic()
        os.kill(ctl_pid, sig)
        assert wait_for(lambda: [r for r in records(log) if r["event"] == "reset" and r["t"] > t_sig], 3)
        assert wait_for(lambda: not _pid_alive(ctl_pid), 3)
    finally:
        proc.kill()
        proc.wait()


def test_controller_of_a_trainer_ignoring_sigint_ignores_it_too(tmp_path):
    """The side process inherits the trainer's ignored SIGINT and keeps it: no reset, no exit (handled: above)."""
    proc, ctl_pid, log = _start_trainer(tmp_path, ignoring_sigint=True)
    try:
        t_sig = time.monotonic()
        os.kill(ctl_pid, signal.SIGINT)
        time.sleep(1.0)  # handled, the reset comes well within this (test_controller_resets_on_signal)
        assert _pid_alive(ctl_pid)
        assert not [r for r in records(log) if r["event"] == "reset" and r["t"] > t_sig]
    finally:
        proc.kill()
        proc.wait()


def test_process_start_error_is_typed(monkeypatch):
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_NO_PERMISSION", "1")
    client = ClockClient()
    ready = client.start_process(0, gpu="a100-sxm4-40gb")
    assert ready["op"] == "error" and "no permission" in ready["message"]
    client.close()
    with pytest.raises(Exception, match="unknown GPU 'nope'"):
        ClockClient().start_process(0, backend="simulated", gpu="nope")


def test_training_continues_when_controller_dies(tmp_path, monkeypatch):
    for k, v in sim_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    client = ClockClient()
    client.start_process(0, gpu="a100-sxm4-40gb")
    first = client.mark()
    assert first.wait(10) and first.energy_j >= 0
    client.instruction_begins(0, 0, 1005, "forward")  # a lock of its own, which SIGTERM must undo
    assert wait_for(lambda: "set" in [r["event"] for r in records(tmp_path / "clocks.jsonl")], 5)
    os.kill(client.controller_pid, signal.SIGTERM)
    assert wait_for(lambda: client.gone, 5)
    client.instruction_begins(0, 0, 1200, "forward")  # no error, no wait
    late = client.mark()
    assert late.wait(0.1) and late.energy_j != late.energy_j  # NaN at once
    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 1.0
    assert [r["event"] for r in records(tmp_path / "clocks.jsonl")][-2:] == ["reset", "close"]


def _deprioritised(tid: int) -> bool:
    """Whether thread `tid` runs with another scheduling class or nice value than the calling thread."""
    return os.sched_getscheduler(tid) != os.sched_getscheduler(0) or os.getpriority(
        os.PRIO_PROCESS, tid
    ) != os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_trainer_threads_keep_its_scheduling_and_the_simulated_controller_takes_idle_time(tmp_path, monkeypatch):
    """The trainer's helper threads (sender, reply reader, run-log writer) share its GIL, so none is deprioritised
    (sched.py: priority inversion); the simulated GPU's controller process, which shares nothing, runs SCHED_IDLE."""
    for k, v in sim_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    earlier = set(threading.enumerate())  # the worker's earlier tests may leave helpers of their own running
    client = ClockClient()
    client.start_process(0, gpu="a100-sxm4-40gb")
    meter = IterationMeter(open_rank_log(tmp_path / "log", 0), mark=client.mark, flush_interval_s=0.02)
    try:
        client.instruction_begins(0, 0, 1200, "forward")
        assert client.mark().wait(10)  # sent by the sender thread, answered through the reader thread
        names = ("kareus-clock-sender", "kareus-clock-reader", "kareus-log-writer")
        helpers = [t for t in threading.enumerate() if t.name in names and t not in earlier]
        assert sorted(t.name for t in helpers) == sorted(names)
        # each helper sets its scheduling, if at all, when it starts: none does within a second of running
        assert not wait_for(lambda: any(_deprioritised(t.native_id) for t in helpers), 1.0)
        assert wait_for(lambda: os.sched_getscheduler(client.controller_pid) == os.SCHED_IDLE, 5)
    finally:
        meter.close()
        client.close()
