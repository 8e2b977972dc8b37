"""report/against_plan.py through `kareus report LOG --plan PLAN`: the table and plot, the predicted stage
energy (cost/energy.py's formula with the plan's blocked power), plans of `kareus solve` and `kareus plan`,
and one-line errors for bad logs and plans."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
from report_fixtures import GPU, tiny_plan, write_log

from kareus_megatron.cli import main as cli_main
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.io import load_plan, plan_sha256, save_plan
from kareus_megatron.report.against_plan import blocked_power_w, compare, predicted_stage_energy_j
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.report.summary import summarize
from kareus_megatron.runtime.measure.measurement import IterationMeter
from kareus_megatron.runtime.measure.rank_files import open_rank_log

ROOT = Path(__file__).resolve().parents[2]
GPT3 = ROOT / "benchmarks/data/perseus_sosp24/gpt3-175b+a100_sxm_bf16.csv"
ROWS = [(0.9, 90.0), (0.8, 80.0), (0.5, 50.0), (0.75, 75.0), (0.5, 50.0), (4.0, 400.0)]


@pytest.fixture(autouse=True)
def only_these(monkeypatch):
    """The real `kareus` dispatcher with just these subcommands."""
    monkeypatch.setattr(cli_main, "COMMANDS", {"report": "report", "solve": "solve", "plan": "plan"})


def _one_line(capsys, code: int, needle: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err and needle in err, err


def test_predicted_stage_energy_is_the_simulators_formula():
    plan = tiny_plan(p_blocked_w=80.0)  # every instruction 0.05 s, 10 J on one GPU; T = 0.5 s; tp = 2 GPUs a stage
    busy = sum(i.predicted_time_s for i in plan.stages[0].instructions)
    want = 2 * (sum(i.predicted_energy_j for i in plan.stages[0].instructions) + 80.0 * (0.5 - busy))
    assert predicted_stage_energy_j(plan, 80.0) == {0: pytest.approx(want), 1: pytest.approx(want)}
    assert blocked_power_w(plan) == 80.0
    assert blocked_power_w(tiny_plan()) == gpu_spec(GPU).p_blocked_w  # a plan without it: the preset's


def test_report_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    save_plan(tiny_plan(p_blocked_w=80.0), tmp_path / "plan.json")
    log = write_log(tmp_path / "run.jsonl", ROWS)
    assert cli_main.main(["report", str(log), "--plan", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "iteration time" in out and "stage 0 energy" in out and "stage 1 time" in out
    assert "6 complete iterations (0 partial; 2 warm-up left out; median time, mean energy of 4)" in out
    assert "blocked power 80 W" in out
    assert (tmp_path / "run.png").stat().st_size > 1000
    cmp = compare(summarize(read_run_log(log)), tiny_plan(p_blocked_w=80.0))
    assert cmp.used == 4 and cmp.skipped == 2 and cmp.notes == [] and cmp.p_blocked_w == 80.0
    assert (cmp.rows[0].measured, cmp.rows[1].measured) == (0.625, 143.75)  # median time; energy 575 J / 4
    assert cmp.rows[0].predicted == 0.5 and cmp.rows[0].error == pytest.approx(0.25)


def test_what_the_meter_writes_is_what_the_report_reads(tmp_path):
    """runtime/measure/measurement.py writes, report/runlog.py reads: medians of the meter's own records."""
    durations = [d for d, _ in ROWS]
    clock = iter([x for k, d in enumerate(durations) for x in (10.0 * k, 10.0 * k + d)])

    class Ticket:  # a clock-client mark: time (s) and the energy counter (J) at 100 W
        done = True

        def __init__(self) -> None:
            self.t = next(clock)
            self.energy_j = 100.0 * self.t

        def wait(self, timeout_s: float) -> bool:
            return True

    meter = IterationMeter(
        open_rank_log(tmp_path / "m", 0),
        mark=Ticket,
        header={"backend": "simulated", "rank": 0, "world": 1},
        flush_interval_s=None,
    )
    for it in range(len(durations)):
        meter.begin(it)
        meter.end(it)
    meter.close()
    s = summarize(read_run_log(tmp_path / "m"))
    written = list(meter.records)[2:]
    assert s.time_s == pytest.approx(statistics.median(r["time_s"] for r in written)) == pytest.approx(0.625)
    energies = [r["energy_j"] for r in written]
    assert s.energy_j == pytest.approx(sum(energies) / len(energies)) == pytest.approx(143.75)
    assert s.stage_energy_j == {0: pytest.approx(143.75)}


def test_report_notes_a_log_of_another_plan(tmp_path, capsys):
    plan = tiny_plan(p_blocked_w=80.0)
    other = tiny_plan(p_blocked_w=80.0, time_s=0.6)
    save_plan(other, tmp_path / "other.json")
    log = write_log(tmp_path / "run.jsonl", ROWS)
    lines = log.read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "plan_sha256": plan_sha256(plan)})
    log.write_text("\n".join(lines) + "\n")
    assert cli_main.main(["report", str(log), "--plan", str(tmp_path / "other.json"), "--no-plot"]) == 0
    assert "note: the log was recorded with a different plan" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content,needle",
    [
        ("", "has 0 iteration(s) and none with both time and energy"),
        ("{oops\n", "run.jsonl:1 is not valid JSON"),
        ('{"kind": "something"}\n', "unknown record kind"),
        (
            '{"kind": "iteration", "iteration": 0, "time_s": -1, "energy_j": 1}\n',
            "time_s = -1 must be a finite non-negative",
        ),
    ],
)
def test_report_bad_log(tmp_path, capsys, content, needle):
    save_plan(tiny_plan(), tmp_path / "plan.json")
    (tmp_path / "run.jsonl").write_text(content)
    _one_line(
        capsys, cli_main.main(["report", str(tmp_path / "run.jsonl"), "--plan", str(tmp_path / "plan.json")]), needle
    )


def _gpt3_profile(path: Path) -> Path:
    """Measured GPT-3 rows of stages 0 and 1, every 4th clock (as tests/cli/test_cli_solve.py does)."""
    with open(GPT3, newline="") as f:
        rows = [r for r in csv.DictReader(f) if int(r["stage"]) < 2]
    keep = sorted({int(r["frequency"]) for r in rows}, reverse=True)[::4]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["stage", "instruction", "frequency", "time", "energy"])
        w.writeheader()
        w.writerows(r for r in rows if int(r["frequency"]) in keep)
    return path


def test_a_kareus_solve_plan_can_be_reported(tmp_path, capsys):
    out = tmp_path / "solved"
    assert (
        cli_main.main(
            [
                "solve",
                "--profile",
                str(_gpt3_profile(tmp_path / "p.csv")),
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--points",
                "2",
                "--tp",
                "2",
                "--p-blocked",
                "75",
                "--gpu",
                "a100-sxm4-80gb",
                "--mbs",
                "1",
                "--seq",
                "2048",
                "--layers-per-stage",
                "12,12",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    plan_file = out / "plans" / "solve-00.json"
    plan = load_plan(plan_file)
    assert plan.gpu == "a100-sxm4-80gb" and plan.p_blocked_w == 75.0  # --p-blocked, not the preset's: carried
    assert (plan.parallel.nodes * plan.parallel.gpus_per_node, plan.parallel.tp) == (4, 2)
    log = write_log(tmp_path / "run.jsonl", ROWS, world=4, gpu="a100-sxm4-80gb")
    capsys.readouterr()
    assert cli_main.main(["report", str(log), "--plan", str(plan_file), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "(solve, a100-sxm4-80gb, blocked power 75 W" in text and "; --plan)" in text and "stage 1 energy" in text
    pred = compare(summarize(read_run_log(log)), plan).stage_energy_j
    for st in plan.stages:
        busy = sum(i.predicted_time_s for i in st.instructions)
        want = 2 * (
            sum(i.predicted_energy_j for i in st.instructions) + 75.0 * max(0.0, plan.predicted.iteration_time_s - busy)
        )
        assert pred[st.pp_rank][1] == pytest.approx(want)
    older = tmp_path / "older.json"  # the same plan as kareus solve wrote it before plans recorded p_blocked_w
    save_plan(plan.model_copy(update={"p_blocked_w": None, "gpu": "measured"}), older)
    _one_line(
        capsys,
        cli_main.main(["report", str(log), "--plan", str(older), "--no-plot"]),
        f"plan {older} records no blocked power (p_blocked_w) and its GPU 'measured' is not a preset",
    )


def test_kareus_plan_records_the_blocked_power_it_predicted_with(tmp_path):
    assert cli_main.main(["plan", "--points", "2", "--band-samples", "0", "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "frontier.json").read_text())
    files = sorted((tmp_path / "out" / "plans").glob("*.json"))
    assert files and {load_plan(f).p_blocked_w for f in files} == {doc["config"]["p_blocked_w"]}


@pytest.mark.parametrize("where", ["plot", "beside"])
def test_an_unwritable_plot_location_is_one_line_before_any_table(tmp_path, capsys, where):
    """`--plot /proc/x.png` (or a log whose directory refuses the default plot) names the flag and prints no table."""
    save_plan(tiny_plan(p_blocked_w=80.0), tmp_path / "plan.json")
    log = write_log(tmp_path / "run.jsonl", ROWS)
    argv = ["report", str(log), "--plan", str(tmp_path / "plan.json")]
    if where == "plot":
        code = cli_main.main([*argv, "--plot", "/proc/kareus-x.png"])
    else:
        (tmp_path / "run.png").mkdir()  # the default plot path is taken by a directory
        code = cli_main.main(argv)
    captured = capsys.readouterr()
    assert "iteration time" not in captured.out, captured.out
    assert code == 2 and len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err
    needle = "--plot '/proc/kareus-x.png'" if where == "plot" else "--plot (default: beside LOG; or --no-plot)"
    assert needle in captured.err


def test_a_simulated_truths_time_scale_scales_the_prediction(tmp_path):
    """Issue 25: a run under a truth of time_scale S (recorded in the header) is compared with S × the prediction."""
    from kareus_megatron.report.against_plan import truth_time_scale

    plan = tiny_plan(p_blocked_w=80.0)
    log = write_log(tmp_path / "run.jsonl", ROWS)
    head, *rest = log.read_text().splitlines()
    header = {**json.loads(head), "truth": {"path": "t.json", "sha256": "0" * 64, "time_scale": 10}}
    log.write_text("\n".join([json.dumps(header), *rest]) + "\n")
    cmp = compare(summarize(read_run_log(log)), plan)
    plain = compare(summarize(read_run_log(write_log(tmp_path / "plain.jsonl", ROWS))), plan)
    assert cmp.time_scale == 10 and plain.time_scale == 1.0
    for scaled, base in zip(cmp.rows, plain.rows):
        assert scaled.measured == base.measured and scaled.predicted == pytest.approx(10 * base.predicted)
    assert any("time_scale 10" in n for n in cmp.notes)
    assert [
        truth_time_scale(h)
        for h in (
            {},
            {"truth": {"time_scale": 0}},
            {"truth": {"time_scale": True}},
            {"truth": "x"},
            {"truth": {"time_scale": 2.5}},
        )
    ] == [1.0, 1.0, 1.0, 1.0, 2.5]


def test_report_shows_a_robust_choice(tmp_path, capsys):
    """A run log header's "robust": true (--kareus-robust) is named next to the plan, and is "robust" in JSON."""
    save_plan(tiny_plan(p_blocked_w=80.0), tmp_path / "plan.json")
    for robust in (True, False):
        log = write_log(tmp_path / f"run-{robust}.jsonl", ROWS)
        lines = log.read_text().splitlines(keepends=True)
        if robust:
            lines[0] = json.dumps({**json.loads(lines[0]), "robust": True}) + "\n"
        log.write_text("".join(lines))
        argv = ["report", str(log), "--plan", str(tmp_path / "plan.json"), "--no-plot"]
        assert cli_main.main(argv) == 0
        assert ("chosen across the prediction bands (--kareus-robust)" in capsys.readouterr().out) is robust
        assert cli_main.main([*argv, "--format", "json"]) == 0
        assert json.loads(capsys.readouterr().out)["robust"] is robust
