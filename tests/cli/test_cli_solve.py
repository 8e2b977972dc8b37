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


JOB = {"--gpu": "a100-sxm4-80gb", "--mbs": 1, "--seq": 2048}  # what the GPT-3 profile was measured with


def _kareus(monkeypatch, *argv):
    """`kareus solve ARGV`, with the required job flags added where ARGV leaves them out."""
    monkeypatch.setattr(cli_main, "COMMANDS", {"solve": "solve"})
    argv = [str(a) for a in argv]
    extra = [x for flag, v in JOB.items() if flag not in argv for x in (flag, str(v))]
    if "--layers-per-stage" not in argv and "--pp" in argv:
        extra += ["--layers-per-stage", ",".join(["12"] * int(argv[argv.index("--pp") + 1]))]
    return cli_main.main(["solve", *argv, *extra])


@pytest.fixture
def profile(tmp_path):
    return _write_csv(tmp_path / "prof.csv", _rows())


def test_solve_writes_frontier_plans_and_zeus_files(tmp_path, profile, monkeypatch, capsys):
    out = tmp_path / "out"
    rc = _kareus(
        monkeypatch,
        "--profile",
        profile,
        "--pp",
        2,
        "--microbatches",
        4,
        "--points",
        5,
        "--out",
        out,
        "--zeus-format",
        "--tp",
        4,
        "--clock-latency-ms",  # changes at once: the solver's own frontier (the lag: the test below)
        0,
    )
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
        assert plan.gpu == "a100-sxm4-80gb" and plan.parallel.layers_per_stage == (12, 12)
        assert (plan.parallel.micro_batch_size, plan.parallel.seq_length) == (1, 2048)
        assert plan.predicted.iteration_time_s == pytest.approx(p["time_s"])
        zeus = eval((out / "zeus" / f"freqs_pipeline_{nn:02d}.py").read_text())  # a Python literal, as Zeus reads it
        assert zeus == [[(i.kind, i.sm_clock_mhz) for i in st.instructions] for st in plan.stages]
        assert all(f in freqs for rank in zeus for _, f in rank)
    assert "solve-00" in capsys.readouterr().out
    # A second run replaces the previous output whole.
    assert _kareus(monkeypatch, "--profile", profile, "--pp", 2, "--microbatches", 4, "--points", 2, "--out", out) == 0
    assert not (out / "zeus").exists() and len(list((out / "plans").iterdir())) == 2


def test_solve_plans_what_the_clock_controller_can_apply(tmp_path, profile, monkeypatch):
    """By default at the GPU preset's clock latency (a100-sxm4-80gb: 15 ms), as kareus plan: every plan records it,
    each instruction's predicted time carries the lag of a change at its begin, and with the raises requested ahead
    the fastest plan is no slower than max clocks. (Here, 50-90 ms instructions, it is the max-clock plan: a clock
    lowered off the critical path saves less than raising it ahead costs; changing at once, the solver's fastest plan
    saves 4% that a real controller would not deliver.)"""
    rows = {(int(r["stage"]), r["instruction"], int(r["frequency"])): float(r["time"]) for r in _rows()}
    found = {}
    for ms in (None, 0):
        out = tmp_path / f"out-{ms}"
        extra = () if ms is None else ("--clock-latency-ms", ms)
        assert _kareus(monkeypatch, "--profile", profile, "--pp", 2, "--microbatches", 4, "--out", out, *extra) == 0
        doc = json.loads((out / "frontier.json").read_text())
        pts = doc["methods"]["solve"]["points"]
        plans = [load_plan(out / p["plan"]) for p in pts]
        found[ms] = (doc, pts, plans)
        lagged = [
            i.predicted_time_s != pytest.approx(rows[(st.pp_rank, i.kind, i.sm_clock_mhz)], rel=1e-9)
            for plan in plans
            for st in plan.stages
            for i in st.instructions
        ]
        assert any(lagged) if ms is None else not any(lagged)
    doc, pts, plans = found[None]
    assert doc["config"]["clock_latency_s"] == 0.015 and found[0][0]["config"]["clock_latency_s"] == 0.0
    assert all(p.clock_latency_s == 0.015 and p.min_clock_segment_s == 0.030 for p in plans)
    assert all(p.clock_latency_s is None for p in found[0][2])
    top = doc["config"]["max_clock"]
    assert pts[0]["time_s"] <= top["time_s"] * (1 + 1e-9) and pts[0]["energy_j"] <= top["energy_j"]
    assert all(a["time_s"] < b["time_s"] and a["energy_j"] > b["energy_j"] for a, b in zip(pts, pts[1:]))
    assert found[0][1][0]["energy_j"] < top["energy_j"] * 0.97  # at once: the 4% the lag takes away
    assert len(pts) <= 10
    budget = top["time_s"] * 1.07  # --max-time: every written plan within it, lag included
    out = tmp_path / "budget"
    assert (
        _kareus(monkeypatch, "--profile", profile, "--pp", 2, "--microbatches", 4, "--max-time", budget, "--out", out)
        == 0
    )
    within = json.loads((out / "frontier.json").read_text())["methods"]["solve"]["points"]
    assert len(within) >= 2 and all(p["time_s"] <= budget for p in within)


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
        ("--layers-per-stage", "4"),  # one per stage
        ("--gpu", "a100-pcie"),  # not a preset
        ("--nodes", 3),  # does not divide 8 GPUs
        ("--clock-latency-ms", -1),
        ("--clock-latency-ms", math.inf),
    ]
    for flag, value in cases:
        args = {"--pp": 2, "--microbatches": 4, "--out": out, "--profile": profile, "--tp": 4}
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
    assert (
        main(
            [
                "solve",
                "--profile",
                str(path),
                "--pp",
                "8",
                "--microbatches",
                "4",
                "--out",
                ".",
                "--gpu",
                "a100-sxm4-80gb",
                "--mbs",
                "1",
                "--seq",
                "2048",
                "--layers-per-stage",
                "12,12,12,12,12,12,12,12",
            ]
        )
        == 2
    )
    assert "current directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.csv"]


def test_the_job_shape_is_required(tmp_path, profile, capsys):
    from kareus_megatron.cli.main import main

    base = ["solve", "--profile", str(profile), "--pp", "2", "--microbatches", "4", "--out", str(tmp_path / "o")]
    job = ["--gpu", "a100-sxm4-80gb", "--mbs", "1", "--seq", "2048", "--layers-per-stage", "12,12"]
    for k in range(0, len(job), 2):
        with pytest.raises(SystemExit) as e:
            main([*base, *job[:k], *job[k + 2 :]])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and job[k] in err, err
    assert not (tmp_path / "o").exists()


def test_frequencies_the_gpu_cannot_lock_are_refused(tmp_path, monkeypatch, capsys):
    rows = _rows()
    for r in rows:
        if r["frequency"] == "1410":
            r["frequency"] = "1412"  # not on the A100's 15 MHz grid
    prof = _write_csv(tmp_path / "p.csv", rows)
    assert _kareus(monkeypatch, "--profile", prof, "--pp", 2, "--microbatches", 4, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1412" in err and "cannot lock" in err
    assert not (tmp_path / "o").exists()


def test_the_readme_example_records_a_node_shape_kareus_launch_runs(tmp_path, capsys):
    """README's `kareus solve ... --tp 8 --pp 8`: 64 GPUs recorded as 8 nodes x 8 (not 1 x 64), and `kareus launch`
    runs its plans with --nodes 8 --gpus-per-node 8 or, left out, with the plan's shape."""
    out = tmp_path / "solved"
    prof = _write_csv(tmp_path / "gpt3.csv", _rows(stages=8, every=4))
    assert (
        cli_main.main(
            [
                "solve",
                "--profile",
                str(prof),
                "--pp",
                "8",
                "--microbatches",
                "16",
                "--tp",
                "8",
                "--points",
                "2",
                "--out",
                str(out),
                "--gpu",
                "a100-sxm4-80gb",
                "--mbs",
                "1",
                "--seq",
                "2048",
                "--layers-per-stage",
                "12,12,12,12,12,12,12,12",
            ]
        )
        == 0
    )
    par = load_plan(out / "plans" / "solve-00.json").parallel
    assert (par.nodes, par.gpus_per_node) == (8, 8)
    capsys.readouterr()
    for shape in (["--nodes", "8", "--gpus-per-node", "8"], []):
        assert (
            cli_main.main(["launch", "run", "--plan-dir", str(out), *shape, "--script", "train.py", "--dry-run"]) == 0
        )
        first = capsys.readouterr().out.splitlines()[0]
        assert "torchrun --nnodes 8 --nproc-per-node 8 " in first, first
    assert (
        cli_main.main(
            [
                "solve",
                "--profile",
                str(prof),
                "--pp",
                "8",
                "--microbatches",
                "4",
                "--tp",
                "2",
                "--points",
                "2",
                "--out",
                str(tmp_path / "small"),
                "--gpu",
                "a100-sxm4-80gb",
                "--mbs",
                "1",
                "--seq",
                "2048",
                "--layers-per-stage",
                "12,12,12,12,12,12,12,12",
                "--nodes",
                "4",
            ]
        )
        == 0
    )
    par = load_plan(tmp_path / "small" / "plans" / "solve-00.json").parallel
    assert (par.nodes, par.gpus_per_node) == (4, 4)  # --nodes alone: the GPUs split evenly, as before
