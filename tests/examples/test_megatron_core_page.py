"""docs/megatron_core.md, executed exactly as printed: its `kareus plan` command (through the CLI), then its
Python block as train.py under torchrun with 2 gloo ranks (TP=2 + SP, simulated GPUs) in a fresh directory.

Checks: exit 0, three losses near ln(128), the run log directory the page names with one header per rank and
three iterations each, recording the 2-nanobatch plan the page installs, and the simulated clocks = that plan's
clock sequence x 3 on both GPUs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from kareus_megatron.cli.main import main
from kareus_megatron.plan.io import load_plan

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "megatron_core.md"


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), re.S)


def test_the_page_runs_as_printed(tmp_path, monkeypatch, capsys):
    (plan_cmd,) = _blocks("sh")
    (program,) = _blocks("python")
    argv = shlex.split(plan_cmd.replace("\\\n", " "))
    assert argv[:2] == ["kareus", "plan"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "tiny-gpt.yaml").write_text((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    assert main(argv[1:]) == 0
    capsys.readouterr()
    (tmp_path / "train.py").write_text(program)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KAREUS_", "MASTER_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env.update(
        KAREUS_GPU_BACKEND="simulated",
        KAREUS_SIMULATED_LATENCY_MS="1",
        OMP_NUM_THREADS="1",
        TORCHDYNAMO_DISABLE="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=str(ROOT),
        KAREUS_SIMULATED_LOG=str(tmp_path / "clocks.jsonl"),
    )
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"iteration \d: loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 3 and all(4.0 < x < 5.5 for x in losses), r.stdout
    plan = load_plan(tmp_path / "kareus-out" / "plans" / "nanobatch_perseus-00.json")
    assert {i.nanobatches for i in plan.stages[0].instructions} == {2}
    for rank in range(2):
        lines = [
            json.loads(x) for x in (tmp_path / "runs" / "nanobatch" / f"rank-{rank:05d}.jsonl").read_text().splitlines()
        ]
        assert lines[0]["kind"] == "header" and lines[0]["plan"].endswith("nanobatch_perseus-00.json")
        assert [x["iteration"] for x in lines[1:] if x["kind"] == "iteration"] == [0, 1, 2]
    clocks = [json.loads(x) for x in (tmp_path / "clocks.jsonl").read_text().splitlines()]
    for gpu in range(2):
        got = [x["mhz"] for x in clocks if x["gpu"] == gpu and x["event"] in ("set", "skip")]
        assert got == plan.clock_sequence(0) * 3
