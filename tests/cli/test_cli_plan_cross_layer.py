"""`kareus plan --cross-layer`: recorded in the plan and frontier files, run by the overlap engine with and without
sequence parallelism, refused with context parallelism."""

from __future__ import annotations

import json

import pytest

from kareus_megatron.cli import main as cli_main
from kareus_megatron.errors import PlanError
from kareus_megatron.plan.io import load_plan
from kareus_megatron.runtime.overlap.config import validate_plan_for_layer

# --band-samples 0: no test here checks a prediction band, and their 32 draws were 90% of each plan's time
FAST = ["--methods", "nanobatch_perseus", "--points", "2", "--freqs", "1410,1110", "--band-samples", "0"]


@pytest.fixture(autouse=True)
def only_plan(monkeypatch):
    monkeypatch.setattr(cli_main, "COMMANDS", {"plan": "plan"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same quick job planned without and with --cross-layer."""
    root = tmp_path_factory.mktemp("cross")
    mp = pytest.MonkeyPatch()
    mp.setattr(cli_main, "COMMANDS", {"plan": "plan"})
    try:
        for name, extra in (("plain", []), ("cross", ["--cross-layer"])):
            assert cli_main.main(["plan", "--out", str(root / name), *FAST, *extra]) == 0
    finally:
        mp.undo()
    return root


def test_plans_record_cross_layer_and_the_engine_runs_them_for_tp_only(runs, capsys):
    doc = json.loads((runs / "cross" / "frontier.json").read_text())
    assert doc["config"]["cross_layer"] is True
    plain_doc = json.loads((runs / "plain" / "frontier.json").read_text())
    assert "cross_layer" not in plain_doc["config"]
    cross = load_plan(runs / "cross" / "plans" / "nanobatch_perseus-00.json")
    plain = load_plan(runs / "plain" / "plans" / "nanobatch_perseus-00.json")
    assert cross.cross_layer is True and plain.cross_layer is None
    assert "cross_layer" not in (runs / "plain" / "plans" / "nanobatch_perseus-00.json").read_text()
    assert load_plan(runs / "cross" / "plans" / "megatron-00.json").cross_layer is None  # 1 nanobatch: unaffected
    validate_plan_for_layer(plain)
    validate_plan_for_layer(cross)
    assert cross.parallel.cp == 1 and not cross.parallel.sequence_parallel
    with pytest.raises(
        PlanError,
        match="^the overlap engine runs cross-layer overlap without context parallelism "
        "only .*; re-plan without --cross-layer.$",
    ):
        validate_plan_for_layer(cross, cp=2)


def test_cross_layer_plans_are_faster(runs):
    fast = {}
    for name in ("plain", "cross"):
        doc = json.loads((runs / name / "frontier.json").read_text())
        fast[name] = doc["methods"]["nanobatch_perseus"]["points"][0]["time_s"]
        assert doc["methods"]["megatron"]["points"][0]["time_s"] > fast[name]
    assert fast["cross"] < fast["plain"]


def test_cross_layer_with_sp_runs_and_with_cp_is_refused(tmp_path, capsys):
    assert cli_main.main(["plan", "--out", str(tmp_path), *FAST, "--cross-layer", "--sp"]) == 0
    assert "note: --cross-layer" not in capsys.readouterr().err
    plan = load_plan(tmp_path / "plans" / "nanobatch_perseus-00.json")
    assert plan.cross_layer and plan.parallel.sequence_parallel
    validate_plan_for_layer(plan)  # SP: run by the engine
    with pytest.raises(
        PlanError,
        match="^the overlap engine runs cross-layer overlap without context parallelism "
        r"only \(this plan: cp=2\); re-plan without --cross-layer.$",
    ):
        validate_plan_for_layer(plan, cp=2)
