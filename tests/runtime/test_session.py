"""RuntimeSession around the clock controller: no clock permission fails or warns before training."""

from __future__ import annotations

import plans
import pytest

from kareus_megatron.errors import ClockControlError
from kareus_megatron.runtime.session import RuntimeSession


def test_session_fail_and_warn_on_no_permission(monkeypatch):
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_NO_PERMISSION", "1")
    with pytest.raises(ClockControlError, match="no permission"):
        RuntimeSession(plans.tiny_plan(), controller="thread").start()
    with pytest.warns(UserWarning, match="training at default clocks"):
        s = RuntimeSession(plans.tiny_plan(), controller="thread", on_error="warn").start()
    assert not s.client.clock_control
    assert s.simulation is None  # the thread controller got the hooks; the session reads no device itself
    s.close()


def test_read_only_run_records_planned_clocks_and_changes_nothing(tmp_path, monkeypatch):
    """KAREUS_GPU_READ_ONLY=1: the controller decides every planned clock, the GPU keeps its own."""
    import json
    import time

    from kareus_megatron.runtime.frameworks.megatron_patch import LiveRun

    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "0")
    monkeypatch.setenv("KAREUS_SIMULATED_LOG", str(tmp_path / "sim.jsonl"))
    monkeypatch.setenv("KAREUS_GPU_READ_ONLY", "1")
    plan = plans.tiny_plan(pp=1, m=2, gpus_per_node=1)
    s = RuntimeSession(plan, controller="thread", log_path=str(tmp_path / "log")).start()
    assert s.ready["op"] == "ready" and s.ready["read_only"]
    s.validate(plan, LiveRun(pp=1, pp_rank=0, vp=1, num_microbatches=2), "the plan")
    begins, ends = s.instruction_callables()
    for it in range(3):
        s.iteration_begins(it)
        for k, ins in enumerate(plan.stages[0].instructions):
            begins(it, k, ins.sm_clock_mhz, ins.kind)
            time.sleep(0.005)
            ends()
        s.iteration_ends(it)
    s.close()
    header = json.loads((tmp_path / "log" / "rank-00000.jsonl").read_text().splitlines()[0])
    assert header["clock_control"] is False and header["read_only"] is True
    events = [json.loads(line) for line in (tmp_path / "sim.jsonl").read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert "recorded" in kinds and not kinds & {"set", "reset"}  # decided and recorded, never applied
    planned = {i.sm_clock_mhz for st in plan.stages for i in st.instructions}
    assert {e["mhz"] for e in events if e["event"] == "recorded" and e["call"] == "set"} <= planned
