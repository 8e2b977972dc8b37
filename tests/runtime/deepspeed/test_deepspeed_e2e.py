"""The whole CPU workflow for DeepSpeed: `kareus plan --framework deepspeed` -> launch/run_comparison.sh
(`kareus launch comparison`: torchrun, 1 node x 2 CPU ranks, simulated GPUs) -> `kareus compare` of the
measured logs.
Two runs only (megatron, perseus: what the reductions need) to keep the CPU budget."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _dist import free_port

from kareus_megatron.report.runlog import MEASUREMENT_FILE, read_run_log

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


def test_plan_launch_compare(tmp_path, monkeypatch):
    from kareus_megatron.cli import main as cli_main

    plans, logs = tmp_path / "plans", tmp_path / "logs"
    assert (
        cli_main.main(
            [
                "plan",
                "--framework",
                "deepspeed",
                "--model",
                "qwen3-1.7b",
                "--tp",
                "1",
                "--pp",
                "2",
                "--dp",
                "1",
                "--mbs",
                "2",
                "--seq",
                "512",
                "--microbatches",
                "4",
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--points",
                "2",
                "--out",
                str(plans),
            ]
        )
        == 0
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "KAREUS_"))}
    env = {
        **base,
        "KAREUS_GPU_BACKEND": "simulated",
        "KAREUS_SIMULATED_LATENCY_MS": "1",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    r = subprocess.run(
        [
            "bash",
            str(ROOT / "launch" / "run_comparison.sh"),
            "--plan-dir",
            str(plans),
            "--log-dir",
            str(logs),
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "--point",
            "fastest",
            "--methods",
            "megatron,perseus,nanobatch_perseus",  # kareus runs in test_deepspeed_patch (CPU budget)
            "--script",
            str(HERE / "ds_train.py"),
            "--skip-iterations",
            "1",
            "--",
            "--steps",
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "# nanobatch_perseus skipped" in r.stdout
    doc = json.loads((logs / "compare" / "frontier.json").read_text())
    assert list(doc["methods"]) == ["megatron", "perseus"]
    for name in ("megatron-00", "perseus-00"):
        manifest = json.loads((logs / name / "run.json").read_text())
        assert manifest["format"] == "kareus-run/1" and manifest["command"][0] == "torchrun"
        assert ("KAREUS_PLAN" in manifest["env"]) == (name != "megatron-00")
        its = read_run_log(logs / name / MEASUREMENT_FILE).iterations
        assert [x["iteration"] for x in its] == [0, 1, 2]
        (pt,) = doc["methods"][name.split("-")[0]]["points"]
        assert pt["energy_j"] == statistics.median(x["energy_j"] for x in its[1:])  # report/summary.py's statistic
    assert "reductions (measured" in r.stdout and (logs / "compare" / "frontier.png").is_file()
