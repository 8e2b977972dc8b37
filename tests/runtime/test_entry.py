"""Entry helpers: the Megatron-LM native-flag hook and the shipped Megatron-LM patch file."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import plans
import pytest

from kareus_megatron.errors import PlanMismatchError
from kareus_megatron.plan.io import save_plan
from kareus_megatron.runtime.frameworks.megatron_lm_hook import megatron_lm_hook
from kareus_megatron.versions import supported_series


def _args(**kw):
    base = dict(
        kareus_plan=None, kareus_point=None, kareus_log=None, kareus_on_error="fail", kareus_debug=False, local_rank=0
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_hook_does_nothing_without_plan():
    assert megatron_lm_hook(_args()) is None


def test_hook_bad_plan_exits_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        megatron_lm_hook(_args(kareus_plan=str(tmp_path / "nope.json")))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.json" in err[0]


def test_hook_installs_session(tmp_path, monkeypatch):
    import kareus_megatron.megatron as kareus
    from kareus_megatron.runtime.frameworks import megatron_patch

    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "0")
    save_plan(plans.tiny_plan(), tmp_path / "plan.json")
    session = megatron_lm_hook(_args(kareus_plan=str(tmp_path / "plan.json"), kareus_log=str(tmp_path / "run.jsonl")))
    try:
        assert session is kareus.current_session()
        assert megatron_patch.installed_state() is session.patch
        assert session.source.endswith("plan.json") and session.client.clock_control
    finally:
        kareus.uninstall()
    assert megatron_patch.installed_state() is None


ROOT = Path(__file__).resolve().parents[2]
VENDOR = ROOT.parent / "shared" / "vendor"
PATCHED = ("megatron/training/arguments.py", "megatron/training/training.py")


GUIDE = ROOT / "docs" / "guides" / "megatron-lm.md"  # the user guide that gives the `git apply` lines


def _readme_apply_commands() -> dict[str, str]:
    """Megatron-LM tag -> the `git apply` line the Megatron-LM guide gives for it."""
    out = {}
    for line in GUIDE.read_text().splitlines():
        m = re.search(r"git apply (\S+/patches/megatron-lm/(core_v[0-9.]+)/\S+\.patch)", line)
        if m:
            out[m.group(2)] = m.group(1)
    return out


def _snapshot_files(tag: str, dest: Path) -> Path:
    """The files the patch touches, unmodified, from the vendored Megatron-LM snapshot of `tag`."""
    archive = VENDOR / f"Megatron-LM-{tag}.tar.gz"
    assert archive.is_file(), f"{archive} is missing: the upstream snapshots live in ../shared/vendor (see its README)"
    with tarfile.open(archive) as tar:
        for rel in PATCHED:
            member = tar.getmember(f"Megatron-LM-{tag}/{rel}")
            tar.extract(member, dest, filter="data")
    return dest / f"Megatron-LM-{tag}"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize(
    "series", [s for s in supported_series("megatron-core") if s.megatron_lm_tag], ids=lambda s: s.megatron_lm_tag
)
def test_each_shipped_patch_applies_strictly_to_its_release(series, tmp_path):
    """`git apply --check` (no fuzz, full context) on the unmodified release, then the guide's own command."""
    tag = series.megatron_lm_tag
    patch = ROOT / "patches" / "megatron-lm" / tag / "0001-kareus-plan-flag.patch"
    readme = _readme_apply_commands()
    assert tag in readme, f"{GUIDE.relative_to(ROOT)} gives no `git apply` line for {tag}"
    assert readme[tag].replace("/path/to/kareus-megatron", str(ROOT)) == str(patch)
    tree = _snapshot_files(tag, tmp_path)
    subprocess.run(["git", "apply", "--check", str(patch)], cwd=tree, check=True)
    subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True)
    args_py, train_py = ((tree / rel).read_text() for rel in PATCHED)
    assert "parser = _add_kareus_args(parser)" in args_py and "'--kareus-log-mode'" in args_py
    assert "megatron_lm_hook(args" in train_py
    compile(args_py, "arguments.py", "exec")
    compile(train_py, "training.py", "exec")
    others = [s.megatron_lm_tag for s in supported_series("megatron-core") if s.megatron_lm_tag not in (None, tag)]
    for other in others:  # one patch per release: another release's tree is refused, not fuzzed into place
        other_tree = _snapshot_files(other, tmp_path / "other")
        assert (
            subprocess.run(["git", "apply", "--check", str(patch)], cwd=other_tree, capture_output=True).returncode != 0
        )


def test_the_patch_flags_are_the_launchers_flags():
    """Every --kareus-* flag of the native patch exists on the drop-in with the same choices."""
    from kareus_megatron.runtime.frameworks.entry import kareus_parser
    from kareus_megatron.runtime.measure.rank_files import LOG_MODES

    flags = {a.option_strings[0]: a for a in kareus_parser("x")._actions if a.option_strings}
    for series in supported_series("megatron-core"):
        if not series.megatron_lm_tag:
            continue
        text = (ROOT / "patches" / "megatron-lm" / series.megatron_lm_tag / "0001-kareus-plan-flag.patch").read_text()
        patched = set(re.findall(r"add_argument\('(--kareus-[a-z-]+)'", text))
        assert patched == set(flags) - {"-h"}, series.megatron_lm_tag
        assert f"choices={list(LOG_MODES)}" in text


def _fake_training(monkeypatch, train):
    """A stand-in for megatron.training.training holding `train` (what pretrain() calls by name)."""
    pkg = types.ModuleType("megatron.training")
    mod = types.ModuleType("megatron.training.training")
    mod.train = train
    pkg.training = mod
    monkeypatch.setitem(sys.modules, "megatron.training", pkg)
    monkeypatch.setitem(sys.modules, "megatron.training.training", mod)
    return mod


@pytest.mark.parametrize("how", ["returns", "exit-interval", "raises", "mismatch"])
def test_native_path_closes_the_session_when_train_ends(how, tmp_path, monkeypatch, capsys):
    import kareus_megatron.megatron as kareus

    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "0")

    def train(*a, **kw):
        if how == "exit-interval":
            raise SystemExit(None)  # Megatron-LM's --exit-interval ends train() with sys.exit()
        if how == "raises":
            raise RuntimeError("boom")
        if how == "mismatch":  # what the patch raises at the first step when the plan does not fit
            raise PlanMismatchError("plan.json does not match this run (pipeline rank 0): microbatches: plan 8, run 4")
        return 7, 0.0

    mod = _fake_training(monkeypatch, train)
    save_plan(plans.tiny_plan(), tmp_path / "plan.json")
    session = megatron_lm_hook(_args(kareus_plan=str(tmp_path / "plan.json"), kareus_log=str(tmp_path / "run")))
    calls, real_close = [], session.close
    monkeypatch.setattr(session, "close", lambda: calls.append("close"))
    monkeypatch.setattr(session, "abort", lambda: calls.append("abort"))
    try:
        if how == "returns":
            assert mod.train(1, x=2) == (7, 0.0)
        else:
            with pytest.raises(RuntimeError if how == "raises" else SystemExit) as e:
                mod.train()
        assert calls == (["abort"] if how in ("raises", "mismatch") else ["close"])
        if how == "mismatch":
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(err) == 1 and "microbatches: plan 8, run 4" in err[0]
    finally:
        real_close()  # its controller process and helper threads, which the stand-ins above left running
        kareus.uninstall()


@pytest.mark.parametrize(
    "layout, want", [(dict(tp=2, gpus_per_node=4), "1"), (dict(cp=2, gpus_per_node=4), "1"), (dict(), None)]
)
def test_launchers_set_cuda_device_max_connections_for_tp_or_cp(layout, want, monkeypatch, capsys):
    from kareus_megatron.runtime.frameworks.entry import apply_required_environment

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("RANK", "0")
    apply_required_environment(plans.tiny_plan(**layout))
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == want
    err = capsys.readouterr().err
    assert ("set CUDA_DEVICE_MAX_CONNECTIONS=1" in err) == (want is not None)


def test_a_value_the_user_set_is_kept_and_named(monkeypatch, capsys):
    from kareus_megatron.runtime.frameworks.entry import apply_required_environment

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    monkeypatch.setenv("RANK", "0")
    assert apply_required_environment(plans.tiny_plan(tp=2, gpus_per_node=4)) == {}
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert "keeping CUDA_DEVICE_MAX_CONNECTIONS=8" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "3")  # only rank 0 speaks
    apply_required_environment(plans.tiny_plan(tp=2, gpus_per_node=4))
    assert capsys.readouterr().err == ""
