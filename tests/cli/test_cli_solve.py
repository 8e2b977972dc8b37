"""`kareus solve` end to end on measured profile rows; bad profiles exit 2 with nothing written."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus_megatron.cli import main as cli_main
from kareus_megatron.plan.io import load_plan

GPT3 = Path(__file__).resolve().parents[2] / "benchmarks/data/perseus_sosp24/gpt3-175b+a100_sxm_bf16.csv"
HEADER = ["stage", "instruction", "frequency", "time", "energy"]


def _rows(stages=2, every=4):
    """Measured GPT-3 rows of the first `stages` stages, every `every`-th clock (keeps the test small)."""
    with open(GPT3, newline="") as f:
        rows = [r for r in csv.DictReader(f) if int(r["stage"]) < stages]
    freqs = sorted({int(r["frequency"]) for r in rows}, reverse=True)[::every]
    return [r for r in rows if int(r["frequency"]) in freqs]


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HEADER)
        w.writeheader()
        w.writerows(rows)
    return path


def _kareus(monkeypatch, *argv):
    monkeypatch.setattr(cli_main, "COMMANDS", {"solve": "solve"})
    return cli_main.main(["solve", *map(str, argv)])


@pytest.fixture
def profile(tmp_path):
    return _write_csv(tmp_path / "prof.csv", _rows())


def test_solve_writes_frontier_plans_and_zeus_files(tmp_path, profile, monkeypatch, capsys):
    out = tmp_path / "out"
    rc = _kareus(monkeypatch, "--profile", profile, "--pp", 2, "--microbatches", 4, "--points", 5,
                 "--out", out, "--zeus-format", "--tp", 4)
    assert rc == 0
    doc = json.loads((out / "frontier.json").read_text())
    assert doc["format"] == "kareus-frontier/1"
    pts = doc["methods"]["solve"]["points"]
    assert 2 <= len(pts) <= 5
    assert all(a["time_s"] < b["time_s"] and a["energy_j"] > b["energy_j"] for a, b in zip(pts, pts[1:]))
    assert pts[0]["energy_j"] < doc["config"]["max_clock"]["energy_j"]
    assert pts[0]["time_s"] == pytest.approx(doc["config"]["max_clock"]["time_s"])
    freqs = {int(r["frequency"]) for r in _rows()}
    for nn, p in enumerate(pts):
        plan = load_plan(out / p["plan"])
        assert plan.method == "solve" and plan.parallel.pp == 2 and plan.parallel.tp == 4
        assert plan.predicted.iteration_time_s == pytest.approx(p["time_s"])
        zeus = eval((out / "zeus" / f"freqs_pipeline_{nn:02d}.py").read_text())  # a Python literal, as Zeus reads it
        assert zeus == [[(i.kind, i.sm_clock_mhz) for i in st.instructions] for st in plan.stages]
        assert all(f in freqs for rank in zeus for _, f in rank)
    assert "solve-00" in capsys.readouterr().out
    # A second run replaces the previous output whole.
    assert _kareus(monkeypatch, "--profile", profile, "--pp", 2, "--microbatches", 4, "--points", 2, "--out", out) == 0
    assert not (out / "zeus").exists() and len(list((out / "plans").iterdir())) == 2


def _mutations():
    def drop_stage(rows):
        return [r for r in rows if r["stage"] != "1"]

    def drop_backward(rows):
        return [r for r in rows if not (r["stage"] == "0" and r["instruction"] == "backward")]

    def duplicate(rows):
        return rows + [dict(rows[3])]

    def nan_time(rows):
        rows = [dict(r) for r in rows]
        rows[2]["time"] = "nan"
        return rows

    def zero_energy(rows):
        rows = [dict(r) for r in rows]
        rows[5]["energy"] = "0"
        return rows

    def negative_time(rows):
        rows = [dict(r) for r in rows]
        rows[1]["time"] = "-0.05"
        return rows

    return [drop_stage, drop_backward, duplicate, nan_time, zero_energy, negative_time]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_bad_profiles_exit_2_and_write_nothing(tmp_path, monkeypatch, capsys, mutate):
    prof = _write_csv(tmp_path / "bad.csv", mutate(_rows()))
    out = tmp_path / "out"
    assert _kareus(monkeypatch, "--profile", prof, "--pp", 2, "--microbatches", 4, "--out", out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kareus solve: error:")
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_bad_requests_exit_2_and_keep_previous_output(tmp_path, profile, monkeypatch, capsys):
    out = tmp_path / "out"
    assert _kareus(monkeypatch, "--profile", profile, "--pp", 2, "--microbatches", 4, "--out", out) == 0
    before = sorted(p.name for p in (out / "plans").iterdir())
    capsys.readouterr()
    cases = [
        ("--max-time", 0.001),  # below the fastest plan
        ("--pp", 3),  # the profile has 2 stages
        ("--points", 0),
        ("--p-blocked", math.nan),
        ("--layers-per-stage", "4,x"),
    ]
    for flag, value in cases:
        args = {"--pp": 2, "--microbatches": 4, "--out": out, "--profile": profile}
        args[flag] = value
        argv = [x for kv in args.items() for x in kv]
        assert _kareus(monkeypatch, *argv) == 2, flag
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
    assert sorted(p.name for p in (out / "plans").iterdir()) == before


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=st.lists(st.booleans(), min_size=4, max_size=4))
def test_profile_completeness_check(keep, tmp_path_factory):
    from kareus_megatron.cli.solve import stage_options
    from kareus_megatron.cost.profile import parse_perseus_profile
    from kareus_megatron.errors import ProfileError

    series = [(0, "forward"), (0, "backward"), (1, "forward"), (1, "backward")]
    rows = [r for r in _rows() if keep[series.index((int(r["stage"]), r["instruction"]))]]
    if not rows:
        return
    text = ",".join(HEADER) + "\n" + "".join(",".join(r[h] for h in HEADER) + "\n" for r in rows)
    prof = parse_perseus_profile(text, where="p.csv")
    if all(keep):
        opts = stage_options(prof, 2)
        assert set(opts) == set(series)
        assert all((o.time_s[:-1] <= o.time_s[1:]).all() for o in opts.values())
    else:
        with pytest.raises(ProfileError, match="no (forward|backward) rows for stage"):
            stage_options(prof, 2)


def test_out_current_directory_is_refused(tmp_path, monkeypatch, capsys):
    from kareus_megatron.cli.main import main

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "p.csv"
    path.write_text(open(GPT3).read())
    assert main(["solve", "--profile", str(path), "--pp", "8", "--microbatches", "4", "--out", "."]) == 2
    assert "current directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.csv"]
