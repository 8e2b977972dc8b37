"""Every fenced bash/sh/python block of the docs site and the README runs here, or says why not.

The markers (an HTML comment on the line above the fence) and what each must show are docs/contributing.md's
"Runnable blocks" table; a block without one runs in a fresh directory that links the repository's
``benchmarks/``, ``examples/``, ``launch/`` and ``patches/``, with this interpreter's environment first on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
RUNNABLE = ("bash", "sh", "shell", "python")
LINKED = ("benchmarks", "examples", "launch", "patches")  # repository folders the blocks name by relative path
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(gpu-only|cluster-only|not-shell|covered-by:(.*?))\s*-->\s*$")
# What a block must name for its marker to be honest (docs/contributing.md).
GPU_ONLY = ("torchrun", "calibrate --run", "kareus validate", "gpu_check.py", "nvidia-smi", "overlap_gpu.py")
CLUSTER_ONLY = ("srun", "sbatch", "--launcher slurm", "docker", "--master-addr", "launch/")
BLOCK_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its code and the marker above it ('' for none)."""

    page: Path
    line: int
    lang: str
    code: str
    marker: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
        above = lines[i - 1].strip() if i > 0 else ""
        marker = above if above.startswith("<!--") else ""
        out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n", marker))
        i = end + 1
    return out


BLOCKS = [b for page in PAGES for b in _blocks(page)]
TO_RUN = [b for b in BLOCKS if b.lang in RUNNABLE and not b.marker]


def _covered_by(block: Block, items: str) -> list[str]:
    """Problems with a `covered-by:` list: each PATH[::NAME] exists and defines NAME; every `make TARGET` of the
    block is named by one of them."""
    problems, texts = [], []
    for item in [s.strip() for s in items.split(",") if s.strip()]:
        path, _, name = item.partition("::")
        file = ROOT / path
        if not file.is_file():
            problems.append(f"{item}: no file {path}")
            continue
        text = file.read_text()
        texts.append(text)
        if name and not re.search(rf"^def {re.escape(name)}\(", text, re.M):
            problems.append(f"{item}: {path} defines no test {name}")
    for target in re.findall(r"^make (\S+)", block.code, re.M):
        if not any(f"make {target}" in t for t in texts):
            problems.append(f"`make {target}` is run by none of {items.strip()}")
    return problems


def test_every_block_runs_or_its_marker_is_honest():
    """Markers are known, sit above runnable blocks, and name what makes them true."""
    assert len(BLOCKS) > 20 and len(TO_RUN) >= 5, (len(BLOCKS), len(TO_RUN))
    problems = []
    for b in BLOCKS:
        if not b.marker:
            continue
        m = MARKER.match(b.marker)
        if not m:
            problems.append(f"{b.where}: unknown marker {b.marker!r}")
        elif b.lang not in RUNNABLE:
            problems.append(f"{b.where}: marker {b.marker!r} above a {b.lang or 'plain'} block, which never runs")
        elif m.group(1) == "gpu-only" and not any(
            w in line and "--dry-run" not in line for line in b.code.splitlines() for w in GPU_ONLY
        ):
            problems.append(f"{b.where}: gpu-only, but names none of {GPU_ONLY} (without --dry-run)")
        elif m.group(1) == "cluster-only" and not any(w in b.code for w in CLUSTER_ONLY):
            problems.append(f"{b.where}: cluster-only, but names none of {CLUSTER_ONLY}")
        elif m.group(1) == "not-shell" and not (b.lang == "python" and re.search(r"^\s*\.\.\.", b.code, re.M)):
            problems.append(f"{b.where}: not-shell is for Python fragments with elided lines (`...`)")
        elif m.group(1).startswith("covered-by"):
            problems += [f"{b.where}: {p}" for p in _covered_by(b, m.group(2))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", TO_RUN, ids=[b.where for b in TO_RUN])
def test_block_runs(block: Block, tmp_path: Path):
    """The block exits 0 in a fresh directory, as a user would paste it from the repository root."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
        "MPLBACKEND": "Agg",
        "COLUMNS": "120",
    }
    if block.lang == "python":
        cmd = [sys.executable, "-c", block.code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert r.returncode == 0, f"{block.where} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
