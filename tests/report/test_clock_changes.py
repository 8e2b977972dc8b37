"""report/clock_changes.py through `kareus report`: clock changes made late or skipped, counted by the
controller, written per iteration by the meter (runtime/measure/measurement.py), flagged above 5%."""

from __future__ import annotations

import json

import pytest
from report_fixtures import tiny_plan

from kareus_megatron.cli import main as cli_main
from kareus_megatron.plan.io import save_plan
from kareus_megatron.report.clock_changes import LATE_SHARE_LIMIT, clock_changes
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.runtime.measure.measurement import IterationMeter
from kareus_megatron.runtime.measure.rank_files import open_rank_log


@pytest.fixture(autouse=True)
def only_report(monkeypatch):
    monkeypatch.setattr(cli_main, "COMMANDS", {"report": "report"})


def write_rank(d, rank, ranks, per_iteration, iterations):
    """One rank file through the meter; each iteration's controller makes the (applied, late, stale) changes of
    `per_iteration` (the mark answers carry the running counts, as decisions.py's)."""
    counts = {"applied": 0, "late": 0, "stale": 0, "errors": 0}
    clock = iter(range(1000))

    class Ticket:  # a clock-client mark: time (s), energy (J) and the controller's answer
        done = True

        def __init__(self) -> None:
            self.t = 0.5 * next(clock)
            self.energy_j = 100.0 * self.t
            self.info = dict(counts)

        def wait(self, timeout_s: float) -> bool:
            return True

    meter = IterationMeter(
        open_rank_log(d, rank),
        mark=Ticket,
        flush_interval_s=None,
        header={"backend": "simulated", "rank": rank, "world": ranks, "pp": ranks, "pp_rank": rank},
    )
    for it in range(iterations):
        meter.begin(it)
        a, late, s = per_iteration
        counts.update(applied=counts["applied"] + a, late=counts["late"] + late, stale=counts["stale"] + s)
        meter.end(it)
    meter.close()


def write_run(d, per_iteration, iterations=6, ranks=2):
    """A run of `ranks` rank files (see write_rank)."""
    for rank in range(ranks):
        write_rank(d, rank, ranks, per_iteration, iterations)
    return d


def report(capsys, tmp_path, log, fmt="text"):
    save_plan(tiny_plan(tp=1), tmp_path / "plan.json")
    assert cli_main.main(["report", str(log), "--plan", str(tmp_path / "plan.json"), "--no-plot", "--format", fmt]) == 0
    return capsys.readouterr().out


def test_a_run_with_few_late_changes_is_not_flagged(tmp_path, capsys):
    log = write_run(tmp_path / "ok", (39, 1, 0))  # 1 of 39 late: 2.6%
    changes = clock_changes(read_run_log(log), 2)
    assert (changes.requested, changes.late, changes.stale, changes.iterations) == (2 * 4 * 39, 8, 0, 4)
    assert changes.share_late_or_skipped == pytest.approx(1 / 39) and not changes.flagged
    out = report(capsys, tmp_path, log)
    assert "clock changes: 312 requested, 8 applied late, 0 skipped (2.6%)" in out and "WARNING" not in out


def test_a_run_with_many_late_or_skipped_changes_is_flagged_in_text_and_json(tmp_path, capsys):
    log = write_run(tmp_path / "bad", (16, 1, 2))  # 1 late + 2 stale of 18 requested: 16.7%
    out = report(capsys, tmp_path, log)
    (line,) = [x for x in out.splitlines() if "clock changes" in x]
    assert line.startswith("WARNING clock changes: 144 requested, 8 applied late, 16 skipped (16.7%)")
    assert f"more than {LATE_SHARE_LIMIT * 100:g}%" in line
    doc = json.loads(report(capsys, tmp_path, log, "json"))
    assert doc["clock_changes"] == {
        "requested": 144,
        "applied": 128,
        "late": 8,
        "skipped": 16,
        "share_late_or_skipped": pytest.approx(24 / 144),
        "limit": 0.05,
        "flagged": True,
        "iterations": 4,
    }


def test_a_log_without_the_counts_has_no_section(tmp_path, capsys):
    log = write_run(tmp_path / "old", (3, 0, 0))
    for f in log.iterdir():  # an older log: no clock_applied / clock_late
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        f.write_text(
            "".join(
                json.dumps({k: v for k, v in x.items() if k not in ("clock_applied", "clock_late")}) + "\n"
                for x in lines
            )
        )
    assert clock_changes(read_run_log(log), 2) is None
    assert "clock changes" not in report(capsys, tmp_path, log)
    assert json.loads(report(capsys, tmp_path, log, "json"))["clock_changes"] is None
