"""Entry helpers: the Megatron-LM native-flag hook and the shipped Megatron-LM patch file."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import plans
import pytest

from kareus_megatron.plan.io import save_plan
from kareus_megatron.runtime.entry import megatron_lm_hook

PATCH = Path(__file__).resolve().parents[2] / "patches" / "megatron-lm" / "0001-kareus-plan-flag.patch"


def _args(**kw):
    base = dict(kareus_plan=None, kareus_point=None, kareus_log=None, kareus_on_error="fail", kareus_debug=False,
                local_rank=0)
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
    from kareus_megatron.runtime import megatron_patch

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


_ANCHORS = {
    "megatron/training/arguments.py": (
        "def add_megatron_arguments(parser):\n"
        "    parser = _add_kitchen_quantization_arguments(parser)\n"
        "    parser = _add_sft_args(parser)\n\n"
        "    return parser\n\n"
        "def parse_args(extra_args_provider=None, ignore_unknown_args=False):\n"
        '    """Parse all arguments."""\n'
        "    return None\n"
    ),
    "megatron/training/training.py": (
        "def pretrain():\n"
        "    args = get_args()\n"
        "    timers = get_timers()\n\n"
        "    if args.log_progress:\n"
        '        append_to_progress_log("Starting job")\n'
    ),
}


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_megatron_lm_patch_applies_to_its_anchor_lines(tmp_path):
    """The patch is well formed and applies where its documented anchor lines are (offsets allowed)."""
    for rel, text in _ANCHORS.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("# Megatron-LM stand-in\n" * 40 + text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "apply", "-C2", str(PATCH)], cwd=tmp_path, check=True)
    args_py = (tmp_path / "megatron/training/arguments.py").read_text()
    train_py = (tmp_path / "megatron/training/training.py").read_text()
    assert "parser = _add_kareus_args(parser)" in args_py and "--kareus-on-error" in args_py
    assert "megatron_lm_hook(args)" in train_py
    compile(args_py, "arguments.py", "exec")
    compile(train_py, "training.py", "exec")
