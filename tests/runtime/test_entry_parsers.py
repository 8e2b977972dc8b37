"""Property tests for the runtime's parsers: --kareus-point and run logs never fail with anything but a
one-line KareusError."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import plans
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import KareusError
from kareus_megatron.plan.io import save_plan, write_json_atomic
from kareus_megatron.report.against_plan import compare
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.report.summary import summarize
from kareus_megatron.runtime.frameworks.entry import resolve_plan


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan directory with one Kareus point (plans/kareus-00.json) in its frontier; under pytest's temporary
    directories, which pytest prunes (a module-level mkdtemp left one in /tmp per run)."""
    d = tmp_path_factory.mktemp("points")
    save_plan(plans.tiny_plan(), d / "plans" / "kareus-00.json")
    write_json_atomic(
        d / "frontier.json",
        {
            "format": "kareus-frontier/1",
            "config": {},
            "reductions": {},
            "methods": {"kareus": {"points": [{"time_s": 1.0, "energy_j": 2.0, "plan": "plans/kareus-00.json"}]}},
        },
    )
    return d


@settings(max_examples=80, deadline=None)
@given(
    st.one_of(
        st.text(max_size=12),
        st.sampled_from(
            [
                "00",
                "kareus-00",
                "fastest",
                "min-energy",
                "01",
                "x-00",
                "kareus-fastest",
                "kareus-min-energy",
                "all",
                "perseus-00",
            ]
        ),
    )
)
def test_point_choice_resolves_or_fails_cleanly(plan_dir, point):
    try:
        plan, source = resolve_plan(str(plan_dir), point)
    except KareusError as e:
        assert "\n" not in str(e) and "--kareus-point" in str(e)
        return
    assert source.endswith("kareus-00.json") and plan.parallel.pp == 2


_stage = st.fixed_dictionaries(
    {
        "pp_rank": st.integers(0, 1),
        "time_s": st.one_of(st.none(), st.floats(0, 1)),
        "energy_j": st.one_of(st.none(), st.floats(0, 100)),
    }
)
_good = st.builds(
    lambda i, t, e, stages: json.dumps(
        {"kind": "iteration", "iteration": i, "time_s": t, "energy_j": e, "stages": stages}
    ),
    st.integers(0, 9),
    st.one_of(st.none(), st.floats(0, 1)),
    st.one_of(st.none(), st.floats(0, 100)),
    st.lists(_stage, max_size=2),
)
_record = st.one_of(
    _good,
    st.text(max_size=20),
    st.dictionaries(
        st.sampled_from(["kind", "iteration", "time_s", "stages", "energy_j"]),
        st.one_of(
            st.integers(),
            st.text(max_size=5),
            st.sampled_from(["iteration", "header"]),
            st.lists(st.integers(), max_size=2),
        ),
        max_size=5,
    ).map(json.dumps),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_record, max_size=5))
def test_run_log_parses_or_fails_cleanly(lines):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "run.jsonl"
        p.write_text("\n".join(lines))
        try:
            summary = summarize(read_run_log(p), 0)
        except KareusError as e:
            assert "\n" not in str(e)
            return
        assert summary.used and all(r["kind"] == "iteration" for r in summary.log.iterations)
        plan = plans.tiny_plan()
        cmp = compare(summary, plan, 80.0)  # a log that summarises can always be compared
        assert cmp.rows[0].predicted == plan.predicted.iteration_time_s
