"""Session fixtures of the Megatron-LM end-to-end tests: vendored trees (extracted and built once), plans.

A *tree* is an unmodified Megatron-LM snapshot from ../shared/vendor/ (see its README.md), extracted
once per session with its dataset helper built; the *patched* tree is a copy with
patches/megatron-lm/<tag>/0001-kareus-plan-flag.patch applied by strict ``git apply``, as a user would.
A missing snapshot fails the test (CI must have them), it does not skip.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from mlm_runs import CONFIGS, MICROBATCHES, ROOT, VENDOR, child_env, plan_command


def _require_vendor(tag: str) -> Path:
    tarball = VENDOR / f"Megatron-LM-{tag}.tar.gz"
    if not tarball.is_file():
        pytest.fail(
            f"{tarball} is missing: these tests need the vendored Megatron-LM snapshots in "
            f"../shared/vendor/ beside the repository (see that directory's README.md)",
            pytrace=False,
        )
    return tarball


def _build_dataset_helper(tree: Path) -> None:
    """Build megatron/core/datasets' C++ helper once (Megatron-LM's rank 0 runs the same `make` later)."""
    datasets = tree / "megatron" / "core" / "datasets"
    r = subprocess.run(["make", "-C", str(datasets)], env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"building {datasets}/helpers.cpp failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    probe = subprocess.run(
        [sys.executable, "-c", "import helpers_cpp"], cwd=datasets, capture_output=True, text=True, timeout=60
    )
    assert probe.returncode == 0, f"the built dataset helper does not import:\n{probe.stderr[-2000:]}"


@pytest.fixture(scope="session")
def megatron_lm_tree(tmp_path_factory):
    """tree(tag, patched=False) -> Path of the extracted (and, if asked, patched) Megatron-LM tree."""
    cache: dict[tuple[str, bool], Path] = {}

    def tree(tag: str, patched: bool = False) -> Path:
        if (tag, patched) in cache:
            return cache[tag, patched]
        if patched:
            src = tree(tag)
            dst = tmp_path_factory.mktemp(f"{tag}-patched") / src.name
            shutil.copytree(src, dst, symlinks=True)
            patch = ROOT / "patches" / "megatron-lm" / tag / "0001-kareus-plan-flag.patch"
            assert patch.is_file(), f"no native patch for Megatron-LM {tag}: {patch} is missing"
            r = subprocess.run(["git", "apply", str(patch)], cwd=dst, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, f"strict `git apply {patch.name}` failed on {tag}:\n{r.stderr}"
        else:
            tarball = _require_vendor(tag)
            base = tmp_path_factory.mktemp(tag)
            with tarfile.open(tarball) as tf:
                tf.extractall(base, filter="data")
            (dst,) = base.iterdir()
            _build_dataset_helper(dst)
        cache[tag, patched] = dst
        return dst

    return tree


@pytest.fixture(scope="session")
def plan_dir(tmp_path_factory):
    """plan_dir(config_name, microbatches=4) -> a `kareus plan` output directory for that layout."""
    from kareus_megatron.cli.main import main

    cache: dict[tuple[str, int], Path] = {}

    def make(name: str, microbatches: int = MICROBATCHES) -> Path:
        if (name, microbatches) not in cache:
            out = tmp_path_factory.mktemp(f"plan-{name}-m{microbatches}") / "plan"
            assert main(plan_command(CONFIGS[name], out, microbatches)) == 0
            cache[name, microbatches] = out
        return cache[name, microbatches]

    return make
