"""The run log header names the overlap engine's SM-limited communicators and what each cost (comm_groups),
written at validation after the engine is set up; a run without them has no such key."""

from __future__ import annotations

import json

import plans

from kareus_megatron.runtime.overlap.comm_groups import CommGroupInfo
from kareus_megatron.runtime.session import RuntimeSession

INFOS = (
    CommGroupInfo(comm_sms=None, kind="tp", init_s=0.017, memory_bytes=205520896, shared=True),
    CommGroupInfo(comm_sms=8, kind="tp", init_s=0.011, memory_bytes=37748736, shared=True),
)


def _header(tmp_path, monkeypatch, nanobatches: int) -> dict:
    from kareus_megatron.runtime import overlap
    from kareus_megatron.runtime.frameworks.megatron_patch import LiveRun
    from kareus_megatron.runtime.overlap import comm, engine

    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "0")
    plan = plans.tiny_plan(pp=1, m=2, gpus_per_node=1)
    first = plan.stages[0].instructions[0].model_copy(update={"nanobatches": nanobatches})
    plan = plan.model_copy(
        update={
            "stages": (plan.stages[0].model_copy(update={"instructions": (first, *plan.stages[0].instructions[1:])}),)
        }
    )

    def setup(plan, **kw):  # the engine NCCL would have built (gloo builds none); the model check is the layer's
        e = engine.OverlapEngine(comm=comm.Communicator(group_infos=INFOS))
        engine.set_engine(e)
        e.install_listener()
        return e

    monkeypatch.setattr(overlap, "setup_overlap", setup, raising=False)
    monkeypatch.setattr(overlap, "check_model_for_plan", lambda modules, plan: 0, raising=False)
    s = RuntimeSession(plan, controller="thread", log_path=str(tmp_path / "log")).start()
    try:
        s.validate(plan, LiveRun(pp=1, pp_rank=0, vp=1, num_microbatches=2), "the plan")
    finally:
        s.close()
    return json.loads((tmp_path / "log" / "rank-00000.jsonl").read_text().splitlines()[0])


def test_the_header_lists_each_communicator_and_its_cost(tmp_path, monkeypatch):
    header = _header(tmp_path, monkeypatch, nanobatches=2)
    assert header["comm_groups"] == [i.to_dict() for i in INFOS]
    assert header["comm_groups"][1] == {
        "comm_sms": 8,
        "kind": "tp",
        "init_s": 0.011,
        "memory_bytes": 37748736,
        "shared": True,
    }


def test_no_communicators_no_key(tmp_path, monkeypatch):
    assert "comm_groups" not in _header(tmp_path, monkeypatch, nanobatches=1)
