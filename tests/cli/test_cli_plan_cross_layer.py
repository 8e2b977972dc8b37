"""`kareus plan --cross-layer`: recorded in the plan and frontier files, refused by the overlap engine."""

from __future__ import annotations

import json

import pytest

from kareus_megatron.cli import main as cli_main
from kareus_megatron.errors import PlanError
from kareus_megatron.plan.io import load_plan
from kareus_megatron.runtime.overlap.config import validate_plan_for_layer

FAST = ["--methods", "nanobatch_perseus", "--points", "2", "--freqs", "1410,1110"]


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


def test_plans_record_cross_layer_and_the_engine_refuses_them(runs, capsys):
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
    with pytest.raises(PlanError, match="^the overlap engine does not run cross-layer overlap yet; re-plan without "
                       "--cross-layer$"):
        validate_plan_for_layer(cross)


def test_cross_layer_plans_are_faster(runs):
    fast = {}
    for name in ("plain", "cross"):
        doc = json.loads((runs / name / "frontier.json").read_text())
        fast[name] = doc["methods"]["nanobatch_perseus"]["points"][0]["time_s"]
        assert doc["methods"]["megatron"]["points"][0]["time_s"] > fast[name]
    assert fast["cross"] < fast["plain"]
