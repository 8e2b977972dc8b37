"""Session fixtures of the Megatron-LM end-to-end tests: vendored trees (extracted and built once), plans.

A *tree* is an unmodified Megatron-LM snapshot from ../shared/vendor/ (see its README.md), extracted
once per session with its dataset helper in place and its megatron/ package byte-compiled; the *patched* tree
is a copy with patches/megatron-lm/<tag>/0001-kareus-plan-flag.patch applied by strict ``git apply``, as a
user would. A missing snapshot fails the test (CI must have them), it does not skip.

Once per session means once across pytest-xdist workers: the first worker to need a tree, a plan or the dataset
helper makes it in a directory the workers share, under a file lock, and the others wait for it and reuse it
(_made_once). The helper (about 8 s of CPU in g++) is built once for both releases, whose sources of it are the same.
The byte-compiling dates from when PYTHONDONTWRITEBYTECODE=1 (set on this machine and in CI) reached the ranks, and
every rank of every run compiled the megatron modules it imports again (0.4-0.8 s of CPU per rank; compiling all of
megatron/ once takes 0.6-1.0 s per tree). tests/conftest.py now unsets it for what the suite starts, so the first rank
would write them too; compiled here, the two ranks of a tree's first run do not both compile them.
"""

from __future__ import annotations

import compileall
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mlm_runs import CONFIGS, MICROBATCHES, ROOT, VENDOR, child_env, plan_command


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock` (released on exit, or by the kernel if the holder dies)."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _made_once(shared: Path, name: str, make: Callable[[Path], None]) -> Path:
    """shared/name, made by make(shared/name) by the first worker to get here; the others wait, then reuse it.

    shared/name.done marks a finished one: a worker that failed half-way leaves none, and the next one starts over."""
    out, done = shared / name, shared / f"{name}.done"
    with _exclusive(shared / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
            done.touch()
    return out


def _require_vendor(tag: str) -> Path:
    tarball = VENDOR / f"Megatron-LM-{tag}.tar.gz"
    if not tarball.is_file():
        pytest.fail(
            f"{tarball} is missing: these tests need the vendored Megatron-LM snapshots in "
            f"../shared/vendor/ beside the repository (see that directory's README.md)",
            pytrace=False,
        )
    return tarball


def _build_dataset_helper(shared: Path, tree: Path) -> None:
    """Put megatron/core/datasets' C++ helper in place, built once per source (Megatron-LM's rank 0 runs the same
    `make` later, which must then find it up to date). The releases' helpers.cpp and Makefile are the same bytes
    (core_v0.16.1 and core_v0.19.0), so the helper is built once, in shared/dataset-helper-SHA, and copied."""
    datasets = tree / "megatron" / "core" / "datasets"
    sources = ("helpers.cpp", "Makefile")
    key = hashlib.sha256(b"".join((datasets / f).read_bytes() for f in sources)).hexdigest()[:16]

    def build(out: Path) -> None:
        out.mkdir()
        for f in sources:
            shutil.copy2(datasets / f, out / f)
        r = subprocess.run(["make", "-C", str(out)], env=child_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"building {datasets}/helpers.cpp failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        probe = subprocess.run(
            [sys.executable, "-c", "import helpers_cpp"], cwd=out, capture_output=True, text=True, timeout=60
        )
        assert probe.returncode == 0, f"the built dataset helper does not import:\n{probe.stderr[-2000:]}"

    built = _made_once(shared, f"dataset-helper-{key}", build)
    for lib in built.glob("helpers_cpp*"):
        shutil.copy2(lib, datasets / lib.name)  # keeps the build's mtime: newer than the extracted helpers.cpp
    r = subprocess.run(["make", "-q", "-C", str(datasets)], env=child_env(), capture_output=True, timeout=60)
    assert r.returncode == 0, f"make finds the dataset helper in {datasets} out of date: rank 0 would rebuild it"


def _byte_compile(tree: Path) -> None:
    """Write the .pyc of every module of tree/megatron (those already up to date are skipped)."""
    with warnings.catch_warnings():  # upstream's own SyntaxWarnings (e.g. `is` with a literal)
        warnings.simplefilter("ignore")
        assert compileall.compile_dir(tree / "megatron", quiet=2), f"byte-compiling {tree}/megatron failed"


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this session sees (without xdist: the session's own)."""
    base = tmp_path_factory.getbasetemp()  # under xdist: <session>/popen-gwN, one per worker
    shared = base.parent / "shared" if os.environ.get("PYTEST_XDIST_WORKER") else base / "shared"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def megatron_lm_tree(shared_dir):
    """tree(tag, patched=False) -> Path of the extracted (and, if asked, patched) Megatron-LM tree."""
    cache: dict[tuple[str, bool], Path] = {}

    def extract(tag: str, base: Path) -> None:
        tarball = _require_vendor(tag)
        base.mkdir()
        with tarfile.open(tarball) as tf:
            tf.extractall(base, filter="data")
        (dst,) = base.iterdir()
        _build_dataset_helper(shared_dir, dst)
        _byte_compile(dst)

    def patch(tag: str, src: Path, base: Path) -> None:
        dst = base / src.name
        shutil.copytree(src, dst, symlinks=True)  # the .pyc too: those of the files the patch changes go stale
        patch = ROOT / "patches" / "megatron-lm" / tag / "0001-kareus-plan-flag.patch"
        assert patch.is_file(), f"no native patch for Megatron-LM {tag}: {patch} is missing"
        r = subprocess.run(["git", "apply", str(patch)], cwd=dst, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"strict `git apply {patch.name}` failed on {tag}:\n{r.stderr}"
        _byte_compile(dst)

    def tree(tag: str, patched: bool = False) -> Path:
        if (tag, patched) not in cache:
            if patched:
                src = tree(tag)
                base = _made_once(shared_dir, f"{tag}-patched", lambda out: patch(tag, src, out))
            else:
                base = _made_once(shared_dir, tag, lambda out: extract(tag, out))
            (cache[tag, patched],) = base.iterdir()
        return cache[tag, patched]

    return tree


@pytest.fixture(scope="session")
def plan_dir(shared_dir):
    """plan_dir(config_name, microbatches=4) -> a `kareus plan` output directory for that layout (read-only:
    every worker of the session shares it; copy it to change it)."""
    from kareus_megatron.cli.main import main

    cache: dict[tuple[str, int], Path] = {}

    def make(out: Path, name: str, microbatches: int) -> None:
        out.mkdir()
        assert main(plan_command(CONFIGS[name], out / "plan", microbatches)) == 0

    def plan(name: str, microbatches: int = MICROBATCHES) -> Path:
        if (name, microbatches) not in cache:
            made = _made_once(shared_dir, f"plan-{name}-m{microbatches}", lambda out: make(out, name, microbatches))
            cache[name, microbatches] = made / "plan"
        return cache[name, microbatches]

    return plan
