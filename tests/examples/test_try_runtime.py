"""`make try-runtime` end to end: plan the tiny GPT of examples/, train it on 2 gloo ranks under the plan
(real megatron-core 1F1B schedule, simulated GPUs) and report measured against predicted."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 3

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """`make try-runtime ARGS` from the repository root with this interpreter's environment; the install
    step (`.venv/.test`) is taken as done: the test runs inside the environment it would install."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.test", "try-runtime", f"BIN={bin_dir}",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_try_runtime_plans_trains_and_reports_every_iteration(tmp_path: Path) -> None:
    out = tmp_path / "try"
    (out / "plan").mkdir(parents=True)
    (out / "plan" / "stale.json").write_text("{}")  # an old try-out is replaced, not mixed in
    r = _make(f"ITERATIONS={ITERATIONS}", f"OUT={out}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = [int(k) for k in re.findall(rf"^iteration (\d+)/{ITERATIONS}\b", r.stdout, re.M)]
    assert done == list(range(1, ITERATIONS + 1))  # printed as each iteration ends, in order
    assert not (out / "plan" / "stale.json").exists()
    assert (out / "plan" / "plans" / "kareus-00.json").is_file()
    assert (out / "run").is_dir()  # the run log: one file per rank
    # the report read the run log of every iteration, against the plan the run used
    assert re.search(rf"run log .*: {ITERATIONS} (complete )?iterations", r.stdout), r.stdout[-3000:]
    assert "kareus-00.json (kareus, a100-sxm4-40gb" in r.stdout
    for row in ("iteration time", "iteration energy", "stage 0 energy", "stage 1 energy"):
        assert re.search(rf"^{row}\s+\S+ m?[sJ]\s", r.stdout, re.M), row


def test_try_runtime_refuses_a_directory_that_is_not_a_try_out(tmp_path: Path) -> None:
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    r = _make(f"OUT={tmp_path}", timeout_s=30)
    assert r.returncode != 0
    assert "holds files other than a try-out's" in r.stderr
    assert keep.read_text() == "mine"


def test_cpu_shim_imports_without_torch() -> None:
    """The shim is a runtime module; importing it must not load torch (only apply() does)."""
    code = "import sys, kareus_megatron.runtime.cpu_shim as s; assert callable(s.apply); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
