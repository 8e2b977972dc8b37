"""runtime/measure/measurement.py: the iteration meter's log (single process, simulated GPU), `kareus report` on
that log. (Rank files, exit paths and merging: tests/runtime/test_durable_log.py; report/ itself:
tests/report/; `kareus env`: tests/cli/test_cli_env.py.)"""

from __future__ import annotations

import json
import statistics
import time

import plans
import pytest

from kareus_megatron.cli.main import main
from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.io import plan_sha256, save_plan
from kareus_megatron.report.against_plan import compare
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.report.summary import summarize
from kareus_megatron.runtime.clock.client import ClockClient
from kareus_megatron.runtime.measure.measurement import IterationMeter
from kareus_megatron.runtime.measure.rank_files import open_rank_log


def _record_run(tmp_path, plan, iterations=5, busy_s=0.01):
    client = ClockClient()
    gpu = SimulatedGPU(gpu_spec(plan.gpu), 0, log_path=None, latency_s=0.0)
    client.start_thread(gpu, simulation=gpu)
    log = tmp_path / "run"
    meter = IterationMeter(
        open_rank_log(log, 0),
        mark=client.mark,
        header={"plan_sha256": plan_sha256(plan), "backend": "simulated", "rank": 0, "world": 1},
    )
    for it in range(iterations):
        meter.begin(it)
        for k, ins in enumerate(plan.stages[0].instructions[:4]):
            client.instruction_begins(it, k, ins.sm_clock_mhz, ins.kind)
            time.sleep(busy_s / 4)
            client.instruction_ends()
        meter.end(it)
    meter.close()
    client.close()
    return log, meter


def test_meter_writes_every_iteration(tmp_path):
    plan = plans.tiny_plan()
    log, meter = _record_run(tmp_path, plan)
    recs = [json.loads(line) for line in (log / "rank-00000.jsonl").read_text().splitlines()]
    assert recs[0]["kind"] == "header" and recs[0]["world"] == 1
    its = recs[1:]
    assert [r["iteration"] for r in its] == list(range(5))
    for r in its:
        assert 0.01 <= r["time_s"] < 0.5
        # busy at >= blocked power for the whole window
        assert r["energy_j"] >= gpu_spec(plan.gpu).p_blocked_w * r["time_s"] * 0.99
        assert r["t_end"] - r["t_start"] == pytest.approx(r["time_s"])


def test_report_cli_prints_table_and_plot(tmp_path, capsys):
    plan = plans.tiny_plan(pp=1, m=4, gpus_per_node=1)
    save_plan(plan, tmp_path / "plan.json")
    log, meter = _record_run(tmp_path, plan)
    assert main(["report", str(log), "--plan", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "iteration time" in out and "stage 0 energy" in out
    assert "2 warm-up left out; median time, mean energy of 3" in out
    assert (tmp_path / "run.png").stat().st_size > 1000  # LOG.png beside the log directory
    cmp = compare(summarize(read_run_log(log)), plan)  # report/ (tests/report/ has its own tests)
    assert cmp.used == 3 and cmp.notes == [] and cmp.p_blocked_w == gpu_spec(plan.gpu).p_blocked_w
    assert cmp.rows[0].measured == pytest.approx(statistics.median(r["time_s"] for r in list(meter.records)[2:]))
    used = list(meter.records)[2:]  # energy: total over total (report/summary.py ENERGY_STATISTIC)
    assert cmp.rows[1].measured == pytest.approx(sum(r["energy_j"] for r in used) / len(used))
    assert cmp.rows[0].predicted == plan.predicted.iteration_time_s


class _Sink:
    def __init__(self, meter_box: list) -> None:
        self.events: list[tuple] = []
        self.meter_box = meter_box

    def iteration_ended(self, iteration):
        # the writer must not have the iteration yet: its step is noted first
        self.events.append(("ended", iteration, any(q[0] == iteration for q in self.meter_box[0]._queue)))

    def record(self, record):
        self.events.append(("record", record["iteration"], record["energy_j"] is not None))

    def close(self):
        self.events.append(("close",))


def test_the_sink_hears_each_iteration_end_before_its_line_and_the_close_last(tmp_path):
    plan = plans.tiny_plan()
    client = ClockClient()
    gpu = SimulatedGPU(gpu_spec(plan.gpu), 0, log_path=None, latency_s=0.0)
    client.start_thread(gpu, simulation=gpu)
    box: list = []
    meter = IterationMeter(open_rank_log(tmp_path / "run", 0), mark=client.mark, header={"rank": 0, "world": 1})
    box.append(meter)
    sink = _Sink(box)
    meter.attach_sink(sink)
    for it in range(3):
        meter.begin(it)
        time.sleep(0.005)
        meter.end(it)
    meter.close()
    client.close()
    assert sink.events[-1] == ("close",) and meter.sink is None
    ended = [e for e in sink.events if e[0] == "ended"]
    assert ended == [("ended", i, False) for i in range(3)]
    for i in range(3):
        assert sink.events.index(("ended", i, False)) < sink.events.index(("record", i, True))


def test_the_sink_is_fed_outside_the_meter_lock_and_never_from_a_signal_drain(tmp_path):
    """A signal may interrupt the training thread inside the sink's writer (TensorBoard's add_scalar holds
    its own lock): the handler's drain must not call the sink, and no drain calls it under the meter lock."""
    plan = plans.tiny_plan()
    client = ClockClient()
    gpu = SimulatedGPU(gpu_spec(plan.gpu), 0, log_path=None, latency_s=0.0)
    client.start_thread(gpu, simulation=gpu)
    meter = IterationMeter(
        open_rank_log(tmp_path / "run", 0), mark=client.mark, header={"rank": 0, "world": 1}, flush_interval_s=None
    )
    held: list[bool] = []

    class Sink:
        def iteration_ended(self, iteration):
            pass

        def record(self, record):
            held.append(meter._lock._is_owned())

        def close(self):
            pass

    meter.attach_sink(Sink())
    for it in range(2):
        meter.begin(it)
        meter.end(it)
    assert meter.drain(wait_s=2.0, to_sink=False) == 2 and held == []  # the signal handler's drain
    meter.begin(2)
    meter.end(2)
    assert meter.drain(wait_s=2.0) == 1 and held == [False]
    meter.close()
    client.close()


def test_the_header_names_the_cuda_device_once_cuda_is_initialised(tmp_path, monkeypatch):
    import torch

    from kareus_megatron.runtime.process_env import cuda_device_identity

    assert cuda_device_identity() == {}  # CPU: never initialises CUDA
    props = type("Props", (), {"name": "NVIDIA H200", "uuid": "5a8b3c1d-0000-1111-2222-333344445555"})()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props if i == 3 else None)
    meter = IterationMeter(
        open_rank_log(tmp_path / "run", 0), header={"rank": 0, "world": 1, "gpu_index": 3}, flush_interval_s=None
    )
    meter.set_stage(0, pp=1)
    meter.close()
    (header,) = [json.loads(x) for x in (tmp_path / "run" / "rank-00000.jsonl").read_text().splitlines()]
    assert header["gpu_index"] == 3 and header["gpu_name"] == "NVIDIA H200"
    assert header["gpu_uuid"] == "GPU-5a8b3c1d-0000-1111-2222-333344445555"  # as nvidia-smi -L names it
