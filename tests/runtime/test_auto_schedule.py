"""closed_loop/auto.py's schedule on one rank, with a stand-in session: phases, profile clocks, switch, re-profile."""

from __future__ import annotations

from typing import Any

import pytest

from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.io import plan_sha256
from kareus_megatron.plan.objective import Objective
from kareus_megatron.runtime.closed_loop.auto import (
    CMD_REPROFILE,
    CMD_SWITCH,
    AutoController,
    AutoSettings,
    profile_clocks_mhz,
    uniform_plan,
)


class _Meter:
    def __init__(self) -> None:
        self.tags: dict[str, Any] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []

    def set_tags(self, **tags: Any) -> None:
        self.tags = tags

    def event(self, name: str, **fields: Any) -> None:
        self.events.append((name, fields))


class _Session:
    def __init__(self) -> None:
        self.meter = _Meter()
        self.plans: list[Any] = []

    def switch_plan(self, plan: Any) -> None:
        self.plans.append(plan)


def _base() -> Any:
    from plans import tiny_plan

    return tiny_plan()


def test_profile_clocks() -> None:
    clocks = tuple(range(1410, 205, -15))
    got = profile_clocks_mhz(clocks, 5)
    assert got[0] == 1410 and len(got) == 5 and got == sorted(got, reverse=True)
    assert min(got) >= 0.5 * 1410 and min(got) - 0.5 * 1410 < 15
    assert profile_clocks_mhz((1410, 1395), 5) == [1410, 1395]
    with pytest.raises(ConfigError):
        profile_clocks_mhz((), 3)


def test_uniform_plan() -> None:
    base = _base()
    p = uniform_plan(base, 1005)
    assert {i.sm_clock_mhz for st in p.stages for i in st.instructions} == {1005}
    assert all(i.nanobatches == 1 and not i.partitions for st in p.stages for i in st.instructions)
    assert [(i.kind, i.microbatch) for i in p.stages[0].instructions] == [
        (i.kind, i.microbatch) for i in base.stages[0].instructions
    ]


def test_phases_switch_and_reprofile() -> None:
    session = _Session()
    settings = AutoSettings(
        objective=Objective("iso-time"), warmup_iterations=2, profile_clocks=3, iterations_per_clock=2
    )
    ctl = AutoController(
        session, _base(), settings, log_dir="unused", supported_mhz=tuple(range(1410, 600, -30)), rank=1
    )  # rank 1: no planning worker (rank 0 plans from the run log)
    ctl.start()
    phases, clocks = [], []
    for it in range(12):
        phases.append(session.meter.tags["phase"])
        clocks.append(session.meter.tags.get("profile_mhz"))
        if it == 9:
            switched = uniform_plan(_base(), 1200)
            ctl.post(CMD_SWITCH, 1, switched.model_dump_json())
        ctl.on_iteration_end(it)
    assert phases[:9] == ["warmup"] * 2 + ["profile"] * 6 + ["planning"]
    assert clocks[:8] == [1410, 1410, 1410, 1410, clocks[4], clocks[4], clocks[6], clocks[6]]
    assert clocks[4] < clocks[6] < 1410  # interleaved: the lowest clock first, then the highest left
    assert phases[10:] == ["plan", "plan"] and session.meter.tags["plan_version"] == 1
    assert plan_sha256(session.plans[-1]) == plan_sha256(switched)
    assert [n for n, _ in session.meter.events].count("switch") == 1
    ctl.post(CMD_REPROFILE)
    ctl.on_iteration_end(12)
    assert session.meter.tags["phase"] == "reprofile" and session.meter.tags["profile_mhz"] == 1410
    for it in range(13, 19):
        ctl.on_iteration_end(it)
    assert session.meter.tags["phase"] == "planning"
    assert plan_sha256(session.plans[-1]) == plan_sha256(switched)  # planning again runs the last plan


@pytest.mark.parametrize(
    "kw", [dict(profile_clocks=1), dict(iterations_per_clock=1), dict(drift_threshold=0.0), dict(drift_window=1)]
)
def test_bad_settings(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        AutoSettings(objective=Objective("min-energy"), **kw)


def test_interleaved_order() -> None:
    from kareus_megatron.runtime.closed_loop.auto import interleaved

    assert interleaved([5, 4, 3, 2, 1]) == [5, 1, 4, 2, 3]
    assert interleaved([5]) == [5]


def test_a_plan_the_job_refuses_keeps_the_current_one() -> None:
    """A switch the session refuses (e.g. a 2-nanobatch plan on a model without partitioned layers) is an
    ``auto-failed`` event; every rank gets the same plan, so every rank stays where it is."""
    from kareus_megatron.errors import PlanMismatchError

    class Refusing(_Session):
        def switch_plan(self, plan: Any) -> None:
            if plan.stages[0].instructions[0].sm_clock_mhz == 1200:
                raise PlanMismatchError("the plan runs 2 nanobatches but the model has no partitioned layers")
            super().switch_plan(plan)

    session = Refusing()
    settings = AutoSettings(
        objective=Objective("iso-time"), warmup_iterations=0, profile_clocks=2, iterations_per_clock=2
    )
    ctl = AutoController(session, _base(), settings, log_dir="unused", supported_mhz=(1410, 1200, 990), rank=1)
    ctl.start()
    for it in range(5):
        ctl.on_iteration_end(it)
    assert session.meter.tags["phase"] == "planning"
    ctl.post(CMD_SWITCH, 1, uniform_plan(_base(), 1200).model_dump_json())
    ctl.on_iteration_end(5)
    assert session.meter.tags["phase"] == "planning" and ctl.version == 0
    failed = [f for n, f in session.meter.events if n == "auto-failed"]
    assert len(failed) == 1 and "partitioned layers" in failed[0]["reason"]
    assert not [n for n, _ in session.meter.events if n == "switch"]
