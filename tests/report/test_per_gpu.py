"""Per-GPU energy (report/per_gpu.py, runlog.merge_rank_dir's per-rank lines, `kareus report`'s per-GPU
section): each rank's median J per iteration and share of the job's energy, from hand-written rank files
of a 2-stage x 2-GPU job, against hand-computed figures; logs from before the GPU keys still read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from report_fixtures import tiny_plan, write_log

from kareus_megatron.cli import main as cli_main
from kareus_megatron.plan.io import save_plan
from kareus_megatron.report.against_plan import compare
from kareus_megatron.report.per_gpu import per_gpu
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.report.summary import summarize

# rank -> per-iteration energy (J); iterations 0, 1 are warm-up. Time: rank r takes 0.5 + 0.1 r s.
ENERGY = {
    0: [900, 900, 100, 120, 110],
    1: [900, 900, 200, 240, 220],
    2: [900, 900, 300, 360, 330],
    3: [900, 900, 400, 480, 440],
}
UUID = "GPU-5a8b3c1d-0000-1111-2222-3333444455{:02d}"


@pytest.fixture(autouse=True)
def only_report(monkeypatch):
    monkeypatch.setattr(cli_main, "COMMANDS", {"report": "report"})


def write_rank_dir(d: Path, energy=ENERGY, *, gpu_keys: bool = True, world: int | None = None) -> Path:
    """Rank files of a PP=2 x TP=2 job (ranks 0, 1 on stage 0); with the header's GPU keys or without."""
    world = world or len(energy)
    d.mkdir(parents=True)
    for r, es in energy.items():
        head = {
            "kind": "header",
            "format": "kareus-rank-log/1",
            "rank": r,
            "world": world,
            "pp": 2,
            "pp_rank": r * 2 // world,
            "tp": world // 2,
            "gpu": "a100-sxm4-40gb",
            "backend": "simulated",
        }
        if gpu_keys:
            head.update(local_rank=r % 8, gpu_index=r % 8, gpu_uuid=UUID.format(r), gpu_name="NVIDIA A100")
        lines = [head] + [
            {
                "kind": "iteration",
                "iteration": i,
                "t_start": 0.0,
                "t_end": 0.5 + 0.1 * r,
                "time_s": 0.5 + 0.1 * r,
                "energy_j": float(e),
            }
            for i, e in enumerate(es)
        ]
        (d / f"rank-{r:05d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def test_merged_records_keep_every_ranks_figures_and_which_gpu(tmp_path):
    log = read_run_log(write_rank_dir(tmp_path / "run"))
    rec = log.iterations[2]
    assert rec["energy_j"] == 1000.0  # the sum is still there
    assert [(x["rank"], x["pp_rank"], x["energy_j"], x["time_s"]) for x in rec["ranks"]] == [
        (0, 0, 100.0, 0.5),
        (1, 0, 200.0, 0.6),
        (2, 1, 300.0, 0.7),
        (3, 1, 400.0, 0.8),
    ]
    assert log.gpus[2] == {
        "rank": 2,
        "pp_rank": 1,
        "local_rank": 2,
        "gpu_index": 2,
        "gpu_uuid": UUID.format(2),
        "gpu_name": "NVIDIA A100",
    }
    assert "gpu_uuid" not in log.header  # rank 0's GPU is not the job's


def test_per_gpu_medians_and_shares(tmp_path):
    summary = summarize(read_run_log(write_rank_dir(tmp_path / "run")))
    gpus = per_gpu(summary, {0: 600.0, 1: 1000.0}, gpus_per_stage=2)
    assert [g.rank for g in gpus] == [0, 1, 2, 3]
    assert [g.energy_j for g in gpus] == [110.0, 220.0, 330.0, 440.0]  # medians after 2 warm-up
    assert [g.share for g in gpus] == pytest.approx([0.1, 0.2, 0.3, 0.4])  # 330 / 3300 J, ...
    assert sum(g.share for g in gpus) == pytest.approx(1.0)
    assert [g.predicted_energy_j for g in gpus] == [300.0, 300.0, 500.0, 500.0]  # the stage's over its 2 GPUs
    assert gpus[3].time_s == pytest.approx(0.8) and gpus[3].iterations == 3
    assert gpus[1].label == "1 GPU-5a8b3c1d" and gpus[1].error == pytest.approx(220 / 300 - 1)


def test_report_lists_every_gpu_in_text_and_json(tmp_path, capsys):
    run = write_rank_dir(tmp_path / "run")
    save_plan(tiny_plan(p_blocked_w=80.0), tmp_path / "plan.json")
    assert cli_main.main(["report", str(run), "--plan", str(tmp_path / "plan.json"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "per GPU (mean energy, median time per iteration; share of the job's energy):" in out
    assert re.search(r"^ +2 +1 2 GPU-5a8b3c1d +330\.0 J .* 700\.00 ms +30\.0%$", out, re.M), out
    assert cli_main.main(["report", str(run), "--plan", str(tmp_path / "plan.json"), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(g["rank"], g["gpu_index"], g["measured_energy_j"]) for g in doc["gpus"]] == [
        (0, 0, 110.0),
        (1, 1, 220.0),
        (2, 2, 330.0),
        (3, 3, 440.0),
    ]
    assert doc["gpus"][3]["gpu_uuid"] == UUID.format(3) and doc["gpus"][3]["share"] == pytest.approx(0.4)


def test_a_large_job_gets_one_line_unless_asked(tmp_path, capsys):
    energy = {r: [900, 900, 100 + r, 100 + r, 100 + r] for r in range(20)}
    run = write_rank_dir(tmp_path / "run", energy)
    save_plan(tiny_plan(tp=10, p_blocked_w=80.0), tmp_path / "plan.json")
    argv = ["report", str(run), "--plan", str(tmp_path / "plan.json"), "--no-plot"]
    assert cli_main.main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "per GPU energy (mean per iteration): least 100.0 J (rank 0, GPU 0 GPU-5a8b3c1d), most 119.0 J "
        "(rank 19, GPU 3 GPU-5a8b3c1d) of 20 GPUs; --per-gpu lists them all"
    ) in out
    assert cli_main.main([*argv, "--per-gpu"]) == 0
    assert len(re.findall(r"^ +\d+ +[01] ", capsys.readouterr().out, re.M)) == 20


def test_logs_without_gpu_keys_or_per_rank_lines_still_report(tmp_path, capsys):
    old = read_run_log(write_rank_dir(tmp_path / "old", gpu_keys=False))  # rank logs from before the GPU keys
    gpus = per_gpu(summarize(old))
    assert [g.energy_j for g in gpus] == [110.0, 220.0, 330.0, 440.0]
    assert gpus[0].label == "?" and gpus[0].gpu_uuid is None and gpus[0].pp_rank == 0
    merged = write_log(tmp_path / "m.jsonl", [(1.0, 10.0)] * 4)  # the single merged file: no per-rank lines
    text = merged.read_text().replace('"stages"', '"ranks": [{"rank": "x"}], "stages"')
    merged.write_text(text)  # a hand-edited merged file's "ranks" is not trusted
    assert per_gpu(summarize(read_run_log(merged))) == []
    save_plan(tiny_plan(p_blocked_w=80.0), tmp_path / "plan.json")
    assert cli_main.main(["report", str(merged), "--plan", str(tmp_path / "plan.json"), "--no-plot"]) == 0
    assert "per GPU" not in capsys.readouterr().out


def test_bad_gpu_keys_are_left_out_not_fatal(tmp_path):
    d = write_rank_dir(tmp_path / "run")
    f = d / "rank-00001.jsonl"
    lines = f.read_text().splitlines()
    head = json.loads(lines[0])
    head.update(gpu_index=-1, gpu_uuid=7, gpu_name="x" * 500)
    f.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    gpus = read_run_log(d).gpus[1]
    assert "gpu_index" not in gpus and "gpu_uuid" not in gpus and len(gpus["gpu_name"]) == 200


def test_compare_carries_the_per_gpu_figures(tmp_path):
    summary = summarize(read_run_log(write_rank_dir(tmp_path / "run")))
    cmp = compare(summary, tiny_plan(p_blocked_w=80.0))
    assert [g.energy_j for g in cmp.gpus] == [110.0, 220.0, 330.0, 440.0]
    stage0_pred = cmp.stage_energy_j[0][1]
    assert cmp.gpus[0].predicted_energy_j == pytest.approx(stage0_pred / 2)  # tp=2 GPUs per stage
