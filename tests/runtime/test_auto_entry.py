"""`--kareus-plan auto` flags and inputs: each bad one is one line on stderr and exit status 2, before training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import plans
import pytest

from kareus_megatron.plan.io import save_plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("w") / "plan.json"
    save_plan(plans.tiny_plan(), path)
    return path


def _launch(tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "train.py"
    script.write_text("raise SystemExit(0)\n")
    return subprocess.run(
        [sys.executable, "-m", "kareus_megatron.launch", *flags, "--", str(script)],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KAREUS_GPU_BACKEND": "simulated"},
    )


@pytest.mark.parametrize(
    "flags, says",
    [
        ((), "needs --kareus-workload"),
        (("--kareus-workload", "{W}"), "needs --kareus-log"),
        (
            ("--kareus-workload", "{W}", "--kareus-log", "{T}/run", "--kareus-objective", "fastest"),
            "--kareus-objective",
        ),
        (("--kareus-workload", "{W}", "--kareus-log", "{T}/run", "--kareus-objective", "max-time=-2"), "positive"),
        (("--kareus-workload", "{T}/missing", "--kareus-log", "{T}/run"), "--kareus-workload"),
    ],
)
def test_bad_auto_flags(tmp_path: Path, workload: Path, flags: tuple[str, ...], says: str) -> None:
    args = [f.format(W=workload, T=tmp_path) for f in flags]
    r = _launch(tmp_path, "--kareus-plan", "auto", *args)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run" / "auto").exists()  # nothing half-written


def test_workload_flag_only_with_auto(tmp_path: Path, workload: Path) -> None:
    r = _launch(tmp_path, "--kareus-plan", str(workload), "--kareus-workload", str(workload))
    assert r.returncode == 2 and "goes with --kareus-plan auto" in r.stderr
