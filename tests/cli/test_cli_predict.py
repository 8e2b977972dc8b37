"""`kareus predict` and `kareus calibrate` through the real CLI dispatcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kareus_megatron.cli.main import main
from kareus_megatron.cost.profile import COLUMNS, parse_perseus_profile

FIXTURE = Path(__file__).parents[1] / "data" / "perseus_gpt3_stage0_7.csv"
GPT3 = [
    "--gpu",
    "a100-sxm4-80gb",
    "--model",
    "gpt3-175b",
    "--tp",
    "8",
    "--pp",
    "8",
    "--mbs",
    "1",
    "--seq",
    "2048",
    "--recompute",
    "none",
]


def test_predict_json_rows(capsys):
    assert main(["predict", "--freqs", "1410,1200,900", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 2 * 2 * 3  # stages × instructions × clocks
    assert set(rows[0]) == {"stage", "instruction", "frequency_mhz", "time_s", "energy_j", "avg_power_w"}
    fwd0 = [r for r in rows if r["stage"] == 0 and r["instruction"] == "forward"]
    assert [r["frequency_mhz"] for r in fwd0] == [1410, 1200, 900]
    assert fwd0[0]["time_s"] < fwd0[2]["time_s"] and fwd0[0]["avg_power_w"] > fwd0[2]["avg_power_w"]
    for r in rows:
        assert r["avg_power_w"] == pytest.approx(r["energy_j"] / r["time_s"])


def test_predict_csv_is_a_perseus_profile(capsys):
    assert main(["predict", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ",".join(COLUMNS)
    prof = parse_perseus_profile(out)  # feeds any tool that reads the format, including ours
    assert prof.series() == [(0, "backward"), (0, "forward"), (1, "backward"), (1, "forward")]
    assert max(prof.frequency_mhz) == 1410 and min(prof.frequency_mhz) >= 0.6 * 1410


def test_predict_table(capsys):
    assert main(["predict", "--freqs", "1410", "--model", "qwen3-1.7b", "--cp", "2", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-1.7b" in out and "backward" in out and "1410" in out


def test_calibrate_then_predict(tmp_path, capsys):
    cal = tmp_path / "calib.json"
    assert main(["calibrate", "--profile", str(FIXTURE), *GPT3, "-o", str(cal)]) == 0
    out = capsys.readouterr().out
    assert "power E/t MAPE" in out and "wrote" in out
    assert json.loads(cal.read_text())["format"] == "kareus-calibration/1"
    assert main(["predict", *GPT3, "--freqs", "1410,1095", "--format", "json", "--calibration", str(cal)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    measured = parse_perseus_profile(FIXTURE.read_text())
    f, t, e = measured.select(0, "forward")
    pred = {r["frequency_mhz"]: r for r in rows if r["stage"] == 0 and r["instruction"] == "forward"}
    assert pred[1095]["avg_power_w"] == pytest.approx(e[f == 1095][0] / t[f == 1095][0], rel=0.08)


def _bad(tmp_path: Path) -> list[tuple[list[str], str]]:
    missing = tmp_path / "missing_cols.csv"
    missing.write_text("stage,instruction,frequency,time\n0,forward,1410,1\n")
    nonnum = tmp_path / "nonnum.csv"
    nonnum.write_text(",".join(COLUMNS) + "\n0,forward,1410,abc,1\n")
    neg = tmp_path / "neg.csv"
    neg.write_text(",".join(COLUMNS) + "\n0,forward,1410,1,-1\n")
    badcal = tmp_path / "bad.json"
    badcal.write_text("{}")
    return [
        (["predict", "--gpu", "a100-sxm9"], "unknown GPU 'a100-sxm9'"),
        (["predict", "--model", "llama9"], "unknown model 'llama9'"),
        (["predict", "--tp", "5"], "--tp 5 does not divide"),
        (["predict", "--pp", "30"], "fewer than 30 stages"),
        (["predict", "--nodes", "3"], "not a multiple"),
        (["predict", "--freqs", "1411"], "1411 MHz is not lockable"),
        (["predict", "--freqs", "fast"], "--freqs item 'fast'"),
        (["predict", "--freqs", "1410,1410"], "twice"),
        (["predict", "--calibration", str(badcal)], "format"),
        (["calibrate", "--profile", str(missing), *GPT3], "lacks column(s) energy"),
        (["calibrate", "--profile", str(nonnum), *GPT3], "time = 'abc' is not a number"),
        (["calibrate", "--profile", str(neg), *GPT3], "must be positive"),
        (["calibrate", *GPT3], "give --profile"),
        (["calibrate", "--run"], "calibrate --run needs"),
    ]


def test_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "nvml")  # --run on this CPU machine: NVML is missing
    monkeypatch.delenv("KAREUS_DEBUG", raising=False)
    for argv, needle in _bad(tmp_path):
        assert main(argv) == 2, argv
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (argv, cap.err)
        assert "Traceback" not in cap.err and cap.out == ""


def test_bad_input_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "kareus_megatron.cli.main", "predict", "--tp", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "--tp 5" in proc.stderr and "Traceback" not in proc.stderr


def _flags(command: str) -> set[str]:
    from kareus_megatron.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {opt for a in sub._actions for opt in a.option_strings}


WORKLOAD_FLAGS = {
    "--gpu",
    "--model",
    "--tp",
    "--cp",
    "--pp",
    "--vp",
    "--dp",
    "--sp",
    "--sequence-parallel",
    "--mbs",
    "--seq",
    "--microbatches",
    "--recompute",
    "--first-stage-layers",
    "--last-stage-layers",
    "--nodes",
    "--gpus-per-node",
    "--precision",
    "--calibration",
    "-h",
    "--help",
}


def test_cli_flags_are_deliberate():
    assert _flags("predict") == WORKLOAD_FLAGS | {"--freqs", "--format", "--distributed-optimizer", "--debug"}
    assert _flags("calibrate") == WORKLOAD_FLAGS | {
        "--profile",
        "--run",
        "--device",
        "--gpu-index",
        "--seconds",
        "--ratios-only",
        "-o",
        "--out",
        "--output",
        "--debug",
        "--dry-run",
        "--from-log",
        "--plan",
        "--force",
        "--iterations",
    }


def test_predict_and_plan_default_to_the_same_clock_grid(capsys):
    """One clock-grid policy (GPUSpec.clock_grid_mhz): `kareus predict` predicts the clocks `kareus plan` plans."""
    from kareus_megatron.cli.workload_args import DEFAULT_JOB
    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.search.options import build_options
    from kareus_megatron.workload.models import model_spec
    from kareus_megatron.workload.parallel import make_parallel

    assert main(["predict", "--format", "json"]) == 0
    predicted = sorted({r["frequency_mhz"] for r in json.loads(capsys.readouterr().out)["rows"]}, reverse=True)
    gpu, model = gpu_spec(DEFAULT_JOB["gpu"]), model_spec(DEFAULT_JOB["model"])
    par = make_parallel(model, tp=8, pp=2, micro_batch_size=8, seq_length=4096, num_microbatches=8, recompute="full")
    planned = build_options(gpu, model, par, KernelModel(gpu), "perseus")[(0, 0, "forward")].clock_mhz
    assert tuple(predicted) == gpu.clock_grid_mhz() and set(planned.tolist()) <= set(predicted)
    assert len(predicted) == 19
