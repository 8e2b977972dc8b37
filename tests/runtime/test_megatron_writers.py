"""runtime/frameworks/megatron_writers.py: a real session (simulated GPU, CPU) copies each iteration to Megatron-LM's
TensorBoard and W&B writers, found lazily in megatron.training.global_vars (here a stand-in module holding
fake writers that record their calls), at Megatron's iteration number (resumed at 100 here)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import types

import plans
import pytest

from kareus_megatron.plan.io import save_plan
from kareus_megatron.runtime.frameworks import megatron_writers
from kareus_megatron.runtime.frameworks.megatron_patch import LiveRun
from kareus_megatron.runtime.frameworks.megatron_writers import STEP_METRIC, TAGS, TEXT_TAG
from kareus_megatron.runtime.session import RuntimeSession

RESUMED_AT = 100  # the checkpoint's iteration (args.iteration): Megatron's steps go on from 101
ITERATIONS = 5


class FakeTensorBoard:
    """Records SummaryWriter calls: (method, args, thread name)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, tuple, str]] = []
        self.fail = fail

    def _note(self, method: str, *args: object) -> None:
        if self.fail:
            raise RuntimeError("disk full")
        self.calls.append((method, args, threading.current_thread().name))

    def add_scalar(self, tag, value, global_step=None):
        self._note("add_scalar", tag, value, global_step)

    def add_text(self, tag, text, global_step=None):
        self._note("add_text", tag, text, global_step)

    def flush(self):
        self._note("flush")

    def scalars(self) -> dict[tuple[str, int], float]:
        return {(a[0], a[2]): a[1] for m, a, _ in self.calls if m == "add_scalar"}


class FakeWandb:
    """Records the calls Megatron's wandb writer (the wandb module) gets; ``run`` is None after finish()."""

    def __init__(self) -> None:
        self.logs: list[tuple[dict, int, str]] = []
        self.metrics: list[tuple[str, dict]] = []
        values: dict = {}
        self.config = types.SimpleNamespace(values=values, update=lambda d, allow_val_change=False: values.update(d))
        self.run: object | None = object()
        self.late: list[dict] = []  # logged after finish() (wandb ignores them with a warning)

    def log(self, data, step=None):
        if self.run is None:
            self.late.append(dict(data))
        self.logs.append((dict(data), step, threading.current_thread().name))

    def define_metric(self, name, **kw):
        self.metrics.append((name, kw))

    def finish(self):
        self.run = None


def _global_vars(monkeypatch, tb, wb, args) -> None:
    mod = types.ModuleType(megatron_writers.GLOBAL_VARS)
    mod.get_tensorboard_writer = lambda: tb
    mod.get_wandb_writer = lambda: wb
    mod.get_args = lambda: args
    monkeypatch.setitem(sys.modules, megatron_writers.GLOBAL_VARS, mod)


def _train(tmp_path, monkeypatch, tb, wb, *, finish_before_close: bool = False, busy_s: float = 0.03):
    """Run ITERATIONS iterations through a real session's patch state; return (session, rank-log lines)."""
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "0")
    plan = plans.tiny_plan(pp=1, m=2, gpus_per_node=1)
    plan_file = tmp_path / "plans" / "kareus-03.json"
    save_plan(plan, plan_file)
    args = types.SimpleNamespace(iteration=RESUMED_AT, rank=0, world_size=1)
    _global_vars(monkeypatch, tb, wb, args)
    session = RuntimeSession(plan, source=str(plan_file), controller="thread", log_path=str(tmp_path / "log")).start()
    live = LiveRun(pp=1, pp_rank=0, vp=1, num_microbatches=2)
    try:
        for i in range(ITERATIONS):
            args.curr_iteration = RESUMED_AT + i  # what Megatron's train() sets before train_step
            session.patch.run_iteration(lambda: live, lambda: time.sleep(busy_s))
        deadline = time.monotonic() + 20.0  # the log writer thread writes what has resolved (period 0.25 s)
        while len(session.meter.records) < ITERATIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        if finish_before_close and wb is not None:
            wb.finish()  # Megatron's pretrain finishes its wandb run before the session closes
    finally:
        session.close()
    lines = [json.loads(x) for x in (tmp_path / "log" / "rank-00000.jsonl").read_text().splitlines()]
    return session, [r for r in lines if r["kind"] == "iteration"]


def test_tensorboard_gets_every_iteration_at_megatrons_step_from_the_writer_thread(tmp_path, monkeypatch):
    tb = FakeTensorBoard()
    _, recs = _train(tmp_path, monkeypatch, tb, None)
    assert [r["iteration"] for r in recs] == list(range(ITERATIONS))
    got = tb.scalars()
    for r in recs:
        step = RESUMED_AT + r["iteration"] + 1  # where training_log writes this step's metrics
        assert got[(TAGS["gpu_energy_j"], step)] == r["energy_j"] > 0
        assert got[(TAGS["iteration_time_s"], step)] == r["time_s"] > 0
        assert got[(TAGS["gpu_power_w"], step)] == pytest.approx(r["energy_j"] / r["time_s"])
        assert got[(TAGS["planned_iteration_time_s"], step)] == 0.05
        assert got[(TAGS["planned_job_energy_j"], step)] == 40.0
        assert got[(TAGS["plan_point"], step)] == 3.0
    assert len(got) == ITERATIONS * len(TAGS)
    scalar_threads = {th for m, _, th in tb.calls if m == "add_scalar"}
    assert scalar_threads == {"kareus-log-writer"}  # resolved off the training thread, never on it
    (text,) = [a for m, a, _ in tb.calls if m == "add_text"]
    assert text[0] == TEXT_TAG and text[2] == RESUMED_AT + 1
    assert "kareus-03 (method kareus, point 3;" in text[1] and "plan_sha256" in text[1]
    assert tb.calls[-1][0] == "flush"  # closing flushes Megatron's writer


def test_wandb_gets_one_iteration_per_step_on_the_training_thread(tmp_path, monkeypatch):
    wb = FakeWandb()
    _, recs = _train(tmp_path, monkeypatch, None, wb, busy_s=0.3)
    assert wb.metrics == [(STEP_METRIC, {}), ("kareus/*", {"step_metric": STEP_METRIC})]
    assert "kareus-03" in wb.config.values[TEXT_TAG]
    assert {th for _, _, th in wb.logs} == {threading.main_thread().name}
    steps = [step for _, step, _ in wb.logs]
    assert steps == sorted(set(steps)) and steps[0] > RESUMED_AT  # strictly increasing: W&B keeps each row
    by_step = {RESUMED_AT + r["iteration"] + 1: r for r in recs}
    for data, step, _ in wb.logs:
        own = data[STEP_METRIC]
        assert own <= step  # logged at the step now ending, or later, never earlier (W&B would drop it)
        assert data[TAGS["gpu_energy_j"]] == by_step[own]["energy_j"]
        assert data[TAGS["iteration_time_s"]] == by_step[own]["time_s"]
    owns = [d[STEP_METRIC] for d, _, _ in wb.logs]
    assert owns == list(range(RESUMED_AT + 1, RESUMED_AT + 1 + len(owns)))  # in order, none skipped
    assert len(owns) >= 1


def _record(i: int) -> dict:
    return {"kind": "iteration", "iteration": i, "time_s": 0.5, "energy_j": 100.0 + i}


def test_wandb_rows_trail_megatrons_steps_and_never_go_back():
    """The sink alone, thread-free: which record goes to which W&B step."""
    wb = FakeWandb()
    args = types.SimpleNamespace(iteration=7)  # no curr_iteration: counts on from the checkpoint's
    sink = megatron_writers.MegatronWriters(None, wb, args, plans.tiny_plan(pp=1, m=2), "p/kareus-00.json")
    sink.iteration_ended(0)  # step 8; nothing resolved yet
    sink.record(_record(0))
    sink.record(_record(0))  # a repeated line is not a second row
    sink.iteration_ended(1)  # step 9: iteration 0's figures
    sink.iteration_ended(2)  # step 10: iteration 1 not resolved yet
    sink.record(_record(1))
    sink.record(_record(2))
    sink.iteration_ended(3)  # step 11: iteration 1's
    sink.record(_record(3))
    sink.close()  # step 11 again at close: already has a row, so 2 and 3 stay out of W&B
    assert [(d[STEP_METRIC], step, d[TAGS["gpu_energy_j"]]) for d, step, _ in wb.logs] == [
        (8, 9, 100.0),
        (9, 11, 101.0),
    ]
    assert sink.scalars({"time_s": None, "energy_j": None}) == {
        "planned_iteration_time_s": 0.05,
        "planned_job_energy_j": 40.0,
        "plan_point": 0.0,
    }


def test_a_finished_wandb_run_gets_nothing_more(tmp_path, monkeypatch):
    wb = FakeWandb()
    _train(tmp_path, monkeypatch, None, wb, finish_before_close=True, busy_s=0.1)
    assert wb.late == []
    wb2 = FakeWandb()
    wb2.run = None  # finished before the first iteration: not even the axis is defined
    _train(tmp_path / "b", monkeypatch, None, wb2)
    assert wb2.logs == [] and wb2.metrics == []


def test_a_failing_writer_is_dropped_and_training_goes_on(tmp_path, monkeypatch, caplog):
    tb = FakeTensorBoard(fail=True)
    with caplog.at_level("WARNING", logger="kareus_megatron.runtime.frameworks.megatron_writers"):
        _, recs = _train(tmp_path, monkeypatch, tb, None)
    assert [r["iteration"] for r in recs] == list(range(ITERATIONS))  # the run log is whole
    warned = [r for r in caplog.records if "tensorboard writer failed" in r.getMessage()]
    assert len(warned) == 1 and "disk full" in warned[0].getMessage()


def test_no_writer_on_this_rank_means_no_sink(tmp_path, monkeypatch):
    session, recs = _train(tmp_path, monkeypatch, None, None)  # not the last rank: Megatron made none here
    assert session.meter.sink is None and len(recs) == ITERATIONS
    header = json.loads((tmp_path / "log" / "rank-00000.jsonl").read_text().splitlines()[0])
    assert (header["gpu_index"], header["local_rank"], header["backend"]) == (0, 0, "simulated")  # which GPU
    monkeypatch.delitem(sys.modules, megatron_writers.GLOBAL_VARS)
    assert megatron_writers.attach(plans.tiny_plan(pp=1, m=2, gpus_per_node=1)) is None


def test_the_runtime_never_imports_megatron_training():
    code = (
        "import sys, kareus_megatron.runtime.session, kareus_megatron.runtime.frameworks.megatron_writers as w; "
        "assert w.attach(None) is None; print(sorted(m for m in sys.modules if m.startswith('megatron')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_plan_point_names():
    assert megatron_writers.plan_point("out/plans/perseus-07.json") == ("perseus-07", 7)
    assert megatron_writers.plan_point("my-plan.json") == ("my-plan", None)
