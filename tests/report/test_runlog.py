"""report/runlog.py, the one reader of run logs, and report/summary.py, its one summary: `kareus report` and
`kareus compare` give the same figures for the same log (median after 2 warm-up iterations by default), leave out a
last line cut by a killed job the same way, and both refuse a log holding two runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from report_fixtures import log_lines, tiny_plan, write_log

from kareus_megatron.cli import main as cli_main
from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.io import save_plan
from kareus_megatron.report.against_plan import compare
from kareus_megatron.report.measured import collect_runs
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.report.summary import summarize

# Two warm-up iterations, then 0.5, 0.75, 0.5 and a slow 4.0 s: median time 0.625 s (mean 1.4375 s); energy is
# total over total, 12800 J / 4 = 3200 J (the median would be 1400 J).
ROWS = [(9.0, 900.0), (8.0, 800.0), (0.5, 1000.0), (0.75, 1600.0), (0.5, 1200.0), (4.0, 9000.0)]
CUT = '{"kind": "iteration", "iteration": 6, "time_s": 0.1'  # what a job killed mid-write leaves


@pytest.fixture(autouse=True)
def only_these(monkeypatch):
    """The real `kareus` dispatcher with just these subcommands."""
    monkeypatch.setattr(cli_main, "COMMANDS", {"report": "report", "compare": "compare"})


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path, Path]:
    """(log directory with megatron, perseus and kareus runs; kareus-00's log; its plan file)."""
    root = tmp_path / "runs"
    for name in ("megatron-00", "perseus-00"):
        write_log(root / name / "measurement.jsonl", [(1.0, 1.0)] * 4)
    log = write_log(root / "kareus-00" / "measurement.jsonl", ROWS)
    save_plan(tiny_plan(p_blocked_w=80.0), tmp_path / "kareus-00.json")
    return root, log, tmp_path / "kareus-00.json"


def _both(capsys, root: Path, log: Path, plan: Path) -> tuple[int, str, int, str]:
    rc_report = cli_main.main(["report", str(log), "--plan", str(plan), "--no-plot"])
    report = capsys.readouterr()
    rc_compare = cli_main.main(["compare", str(root), "--no-plot"])
    compared = capsys.readouterr()
    return rc_report, report.out + report.err, rc_compare, compared.out + compared.err


def _kareus_point(root: Path) -> tuple[float, float]:
    (pt,) = json.loads((root / "compare" / "frontier.json").read_text())["methods"]["kareus"]["points"]
    return pt["time_s"], pt["energy_j"]


def test_report_and_compare_give_the_same_figures(runs, capsys):
    root, log, plan = runs
    rc_r, report, rc_c, compared = _both(capsys, root, log, plan)
    assert rc_r == rc_c == 0, report + compared
    assert re.search(r"iteration time +625.00 ms", report) and re.search(r"iteration energy +3200.0 J", report)
    assert _kareus_point(root) == (0.625, 3200.0)
    assert "2 warm-up left out; median time, mean energy of 4" in report
    assert "median time, mean energy after 2 warm-up" in " ".join(compared.split())  # the table title wraps
    summary = summarize(read_run_log(log))
    cmp = compare(summary, tiny_plan(p_blocked_w=80.0))
    (measured,) = [r for r in collect_runs(root) if r.name == "kareus-00"]
    assert (cmp.rows[0].measured, cmp.rows[1].measured) == (measured.time_s, measured.energy_j) == (0.625, 3200.0)
    assert cmp.rows[2].measured == 1600.0  # stage 0: total over total of its energies (half of each iteration's)


def test_a_cut_last_line_is_left_out_by_both(runs, capsys):
    root, log, plan = runs
    log.write_text(log.read_text() + CUT)
    rc_r, report, rc_c, compared = _both(capsys, root, log, plan)
    assert rc_r == rc_c == 0, report + compared
    assert "625.00 ms" in report and _kareus_point(root) == (0.625, 3200.0)
    for out in (report, compared):
        assert f"note: the last line of {log} was cut (job killed mid-write) and is left out" in out
    assert read_run_log(log).truncated and len(read_run_log(log).iterations) == len(ROWS)


def test_a_cut_line_in_the_middle_is_an_error_in_both(runs, capsys):
    root, log, plan = runs
    log.write_text(log.read_text() + CUT + "\n" + log_lines([(1.0, 1.0)], header=False)[0] + "\n")
    rc_r, report, rc_c, compared = _both(capsys, root, log, plan)
    assert rc_r == rc_c == 2
    for out in (report, compared):
        assert len(out.strip().splitlines()) == 1 and f"{log}:8 is not valid JSON" in out, out


def test_two_runs_in_one_log_are_refused_by_both(runs, capsys):
    root, log, plan = runs
    log.write_text(log.read_text() * 2)
    rc_r, report, rc_c, compared = _both(capsys, root, log, plan)
    assert rc_r == rc_c == 2
    for out in (report, compared):
        assert len(out.strip().splitlines()) == 1 and "Traceback" not in out
        assert f"{log} holds 2 runs (headers at lines 1, 8); keep one run per log file" in out, out


def test_both_commands_skip_2_warm_up_iterations_by_default():
    parser = cli_main.build_parser()
    defaults = {
        name: parser.parse_args([name, "x", *(["--plan", "p"] if name == "report" else [])]).skip_iterations
        for name in ("report", "compare")
    }
    assert defaults == {"report": 2, "compare": 2}


def test_iterations_are_ordered_and_not_repeated(tmp_path):
    lines = log_lines([(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)])
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join([lines[0], lines[3], lines[1], lines[2]]) + "\n")
    assert [r["iteration"] for r in read_run_log(p).iterations] == [0, 1, 2]
    p.write_text("\n".join([*lines, lines[2]]) + "\n")
    with pytest.raises(ConfigError, match=r"m.jsonl:5: iteration 1 is logged twice"):
        read_run_log(p)


def test_too_short_a_log_names_the_flag(tmp_path):
    p = write_log(tmp_path / "m.jsonl", [(1.0, 1.0), (None, 2.0), (3.0, 3.0)])
    assert summarize(read_run_log(p)).used == 1  # iteration 1 has no time: not used
    with pytest.raises(ConfigError, match="none with both time and energy after skipping 3 warm-up.*--skip-iterations"):
        summarize(read_run_log(p), 3)
    with pytest.raises(ConfigError, match="--skip-iterations -1 must be a non-negative integer"):
        summarize(read_run_log(p), -1)
