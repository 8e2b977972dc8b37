"""report/measured.py through `kareus compare LOG_DIR`: numbers against hand-computed medians, kareus plan's
frontier.json layout, and one-line exit-2 errors for bad log directories. (The DeepSpeed CPU runs feed it
in tests/runtime/deepspeed/test_deepspeed_patch.py; tests/report/test_runlog.py checks that `kareus report` gives
the same figures.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus_megatron.cli import main as cli_main
from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.frontier import REDUCTION_KEYS
from kareus_megatron.plan.points import read_frontier
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.report.summary import summarize

# run -> per-iteration (time_s, energy_j); iteration 0 is warm-up (skipped with --skip-iterations 1).
RUNS = {
    "megatron-00": [(9.0, 999.0), (2.0, 1000.0), (2.2, 1100.0)],  # median 2.1 s, 1050 J
    "perseus-00": [(9.0, 999.0), (2.0, 900.0), (2.2, 940.0)],  # 2.1 s, 920 J   (Perseus fastest)
    "perseus-01": [(9.0, 999.0), (2.4, 800.0), (2.6, 820.0)],  # 2.5 s, 810 J   (Perseus min energy)
    "nanobatch_perseus-00": [(9.0, 999.0), (2.05, 880.0)],  # 2.05 s, 880 J
    "kareus-00": [(9.0, 999.0), (1.9, 840.0), (2.1, 860.0)],  # 2.0 s, 850 J
    "kareus-01": [(9.0, 999.0), (2.4, 700.0)],  # 2.4 s, 700 J
}


@pytest.fixture(autouse=True)
def only_compare(monkeypatch):
    """The real `kareus` dispatcher with just this subcommand."""
    monkeypatch.setattr(cli_main, "COMMANDS", {"compare": "compare"})


def main(argv: list[str]) -> int:
    return cli_main.main(argv)


def write_run(root: Path, name: str, rows, *, manifest: bool = True, header: bool = True) -> Path:
    d = root / name
    d.mkdir(parents=True)
    lines = (
        [
            {
                "kind": "header",
                "world": 16,
                "gpu": "a100-sxm4-40gb",
                "predicted": {"iteration_time_s": 2.0, "iteration_energy_j": 900.0},
            }
        ]
        if header
        else []
    )
    lines += [
        {"kind": "iteration", "iteration": i, "time_s": t, "energy_j": e, "stages": []} for i, (t, e) in enumerate(rows)
    ]
    (d / "measurement.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if manifest:
        (d / "run.json").write_text(
            json.dumps(
                {
                    "format": "kareus-run/1",
                    "method": name.rsplit("-", 1)[0],
                    "point": int(name[-2:]),
                    "plan": f"plans/{name}.json",
                }
            )
        )
    return d


@pytest.fixture
def log_dir(tmp_path) -> Path:
    root = tmp_path / "runs"
    for i, (name, rows) in enumerate(RUNS.items()):
        write_run(root, name, rows, manifest=i % 2 == 0)  # half identified by directory name only
    return root


def test_numbers_match_hand_computed_ones(log_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compare", str(log_dir), "--skip-iterations", "1", "--out", str(out)]) == 0
    doc = json.loads((out / "frontier.json").read_text())
    pts = {m: [(p["time_s"], p["energy_j"]) for p in e["points"]] for m, e in doc["methods"].items()}
    assert pts["megatron"] == [pytest.approx((2.1, 1050.0))]
    assert pts["perseus"] == [pytest.approx((2.1, 920.0)), pytest.approx((2.5, 810.0))]
    assert pts["kareus"] == [pytest.approx((2.0, 850.0)), pytest.approx((2.4, 700.0))]
    r = doc["reductions"]
    # kareus: iso-time = (920 - 850) / 920; iso-energy = (2.5 - 2.4) / 2.5; vs Megatron: (2.1-2.0)/2.1, (1050-850)/1050
    assert r["kareus"]["iso_time_energy"] == pytest.approx(70 / 920)
    assert r["kareus"]["iso_energy_time"] == pytest.approx(0.1 / 2.5)
    assert r["kareus"]["max_throughput_time_vs_megatron"] == pytest.approx(0.1 / 2.1)
    assert r["kareus"]["max_throughput_energy_vs_megatron"] == pytest.approx(200 / 1050)
    # nanobatch_perseus: T 2.05 <= 2.1 -> (920 - 880) / 920; no point with E <= 810 -> null
    assert r["nanobatch_perseus"]["iso_time_energy"] == pytest.approx(40 / 920)
    assert r["nanobatch_perseus"]["iso_energy_time"] is None
    assert r["perseus"]["iso_time_energy"] == 0 and r["perseus"]["iso_energy_time"] == 0
    assert r["megatron"]["iso_time_energy"] == pytest.approx(-130 / 920)  # its (2.1 s, 1050 J) vs Perseus's 920 J
    text = capsys.readouterr().out
    assert "7.6%" in text and "4.0%" in text and "n/a" in text  # kareus plan's cells (cli/band_cells.py)
    assert (out / "frontier.png").stat().st_size > 1000


def test_layout_is_kareus_plans(log_dir, tmp_path):
    out = tmp_path / "o"
    assert main(["compare", str(log_dir), "--skip-iterations", "1", "--out", str(out), "--no-plot"]) == 0
    doc = read_frontier(out)  # the reader launch/ uses on `kareus plan` output
    assert list(doc) == ["format", "config", "methods", "reductions", "bands"]  # bands: test_measured_bands.py
    assert list(doc["methods"]) == ["megatron", "perseus", "nanobatch_perseus", "kareus"]
    keys = set(REDUCTION_KEYS)
    assert set(doc["reductions"]["kareus"]) == keys | {f"{k}_band" for k in keys}  # null here: runs under 5 its
    p = doc["methods"]["kareus"]["points"][0]
    assert p["run"] == "kareus-00" and p["plan"] == "plans/kareus-00.json" and p["iterations"] == 2
    assert doc["config"]["source"] == "measured" and doc["config"]["gpu"] == "a100-sxm4-40gb"
    assert not (out / "frontier.png").exists()


def test_default_skip_and_output_dir(log_dir):
    assert main(["compare", str(log_dir)]) == 2  # 2 warm-up iterations leave nanobatch_perseus-00 empty
    write_run(log_dir, "perseus-02", [(1.0, 1.0)] * 3)
    (log_dir / "nanobatch_perseus-00" / "measurement.jsonl").unlink()
    (log_dir / "nanobatch_perseus-00" / "run.json").unlink(missing_ok=True)  # no longer a run directory
    (log_dir / "kareus-01" / "measurement.jsonl").write_text(
        "".join(
            json.dumps({"kind": "iteration", "iteration": i, "time_s": 1.0, "energy_j": 2.0}) + "\n" for i in range(3)
        )
    )
    assert main(["compare", str(log_dir)]) == 0
    doc = json.loads((log_dir / "compare" / "frontier.json").read_text())
    assert doc["config"]["skip_iterations"] == 2
    assert doc["methods"]["megatron"]["points"][0]["energy_j"] == pytest.approx(1100.0)


def _bad(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    root.mkdir()
    write_run(root, "megatron-00", [(1.0, 1.0)] * 3)
    write_run(root, "perseus-00", [(1.0, 1.0)] * 3)
    return root


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("missing", "does not exist"),
        ("empty", "holds no runs"),
        ("no-perseus", "no perseus runs"),
        ("corrupt", "is not valid JSON"),
        ("no-log", "has no measurement log"),
        ("short", "none with both time and energy"),
        ("unknown-method", "method 'zeus' is not one of"),
        ("two-headers", "holds 2 runs"),
        ("negative", "must be a finite non-negative number"),
    ],
)
def test_bad_log_dirs_are_one_line_exit_2(tmp_path, capsys, case, fragment):
    root = _bad(tmp_path, case)
    if case == "missing":
        root = tmp_path / "nope"
    elif case == "empty":
        root = tmp_path / "empty-dir"
        root.mkdir()
    elif case == "no-perseus":
        import shutil

        shutil.rmtree(root / "perseus-00")
    elif case == "corrupt":
        (root / "perseus-00" / "measurement.jsonl").write_text('{"kind": "header"}\n{oops\n{"kind": "x"}\n')
    elif case == "no-log":
        (root / "kareus-00").mkdir()
        (root / "kareus-00" / "run.json").write_text('{"format": "kareus-run/1", "method": "kareus"}')
    elif case == "short":
        write_run(root, "kareus-00", [(1.0, 1.0)])
    elif case == "unknown-method":
        write_run(root, "zeus-00", [(1.0, 1.0)] * 3, manifest=False)
    elif case == "two-headers":
        p = root / "perseus-00" / "measurement.jsonl"
        p.write_text(p.read_text() * 2)
    elif case == "negative":
        write_run(root, "kareus-00", [(1.0, -5.0)] * 3)
    assert main(["compare", str(root), "--skip-iterations", "1"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_time_is_a_median_and_energy_total_over_total(tmp_path):
    root = _bad(tmp_path, "slow")
    write_run(root, "kareus-00", [(9.0, 9.0), (1.0, 10.0), (1.2, 12.0), (30.0, 300.0)])  # a checkpoint at the end
    assert main(["compare", str(root), "--skip-iterations", "1", "--no-plot"]) == 0
    (pt,) = json.loads((root / "compare" / "frontier.json").read_text())["methods"]["kareus"]["points"]
    # time: the median, not moved by the slow iteration (the mean would be 10.7 s); energy: 322 J / 3
    # iterations, what NVML's ~100 ms counter steps cannot bias (the median would be 12 J)
    assert pt["time_s"] == 1.2 and pt["energy_j"] == pytest.approx(322.0 / 3)


_value = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=True), st.text(max_size=3))
_record = st.dictionaries(
    st.sampled_from(["kind", "iteration", "time_s", "energy_j", "x"]),
    st.one_of(_value, st.sampled_from(["header", "iteration"])),
    max_size=5,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(st.one_of(_record, st.just("garbage"), st.integers()), max_size=6), skip=st.integers(0, 3))
def test_log_parser_accepts_or_names_the_problem(tmp_path, records, skip):
    p = tmp_path / "m.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    try:
        s = summarize(read_run_log(p), skip)
    except ConfigError as err:
        assert str(p) in str(err) and "\n" not in str(err)
        return
    assert s.used >= 1 and math.isfinite(s.time_s) and math.isfinite(s.energy_j) and s.time_s >= 0 and s.energy_j >= 0
