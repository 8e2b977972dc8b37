"""The runtime against every supported megatron-core series (kareus_megatron/versions.py), not only the
pinned one: the real-schedule patch tests (test_megatron_patch.py, 2 gloo processes) and the SDPA core
attention's numerics (test_sdpa_attention.py) rerun with the other series first on PYTHONPATH. 0.15.x
comes from PyPI (`make install-test` puts it in .venv/alt/); 0.19.x has no PyPI release here, so its
megatron/core comes from the vendored Megatron-LM snapshot."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kareus_megatron.versions import supported_series

ROOT = Path(__file__).resolve().parents[2]
VENDOR = ROOT.parent / "shared" / "vendor"
PINNED = "0.16.1"  # pyproject.toml's megatron-core: the suite itself runs against it
# rerun against every other series: the real-schedule patch, and SDPAttention against that series'
# DotProductAttention (fp32 numerics, TP=2)
SERIES_TESTS = ("test_megatron_patch.py", "test_sdpa_attention.py", "test_cuda_graphs.py")


def _snapshot_core(tag: str, dest: Path) -> Path:
    """megatron/core of the vendored Megatron-LM snapshot `tag`, unmodified, under dest (a PYTHONPATH entry)."""
    archive = VENDOR / f"Megatron-LM-{tag}.tar.gz"
    assert archive.is_file(), f"{archive} is missing: the upstream snapshots live in ../shared/vendor (see its README)"
    prefix = f"Megatron-LM-{tag}/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix + "megatron/core/")]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(dest, members=members, filter="data")
    return dest


def _series_path(series, tmp_path: Path) -> Path:
    alt = Path(sys.prefix) / "alt" / f"megatron-core-{series.tested}"
    if alt.is_dir():
        return alt
    assert series.megatron_lm_tag, f"{alt} is missing: `make install-test` puts megatron-core=={series.tested} there"
    return _snapshot_core(series.megatron_lm_tag, tmp_path)


@pytest.mark.parametrize(
    "series", [s for s in supported_series("megatron-core") if s.tested != PINNED], ids=lambda s: s.series
)
def test_the_patch_runs_on_every_supported_megatron_core(series, tmp_path):
    path = _series_path(series, tmp_path)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]),
        KAREUS_TEST_MEGATRON_CORE=series.tested,
        PYTHONWARNINGS="ignore",
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "--timeout=240",
            *(str(ROOT / "tests" / "runtime" / f) for f in SERIES_TESTS),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"megatron-core {series.tested}:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert " passed" in r.stdout and "skipped" not in r.stdout
