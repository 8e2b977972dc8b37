"""--kareus-robust (and install(robust=), the DeepSpeed config's "robust", kareus launch --robust): the runtime picks
the point kareus plan --robust picks (plan/objective.py frontier_choice), records it in the run log header, and
refuses it in one line (exit status 2, before training) where there is no banded frontier to choose from."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import plans
import pytest

import kareus_megatron.deepspeed as kds
from kareus_megatron import launch
from kareus_megatron.cli import main as cli_main
from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.frontier import frontier_document
from kareus_megatron.plan.io import save_plan, write_json_atomic
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.runtime.frameworks.megatron_lm_hook import megatron_lm_hook

# method -> [(time s, energy J, time band high s, energy band high J)]: at the point estimate iso-time is
# kareus-01 (1.0 s, no slower than Megatron's 1.0 s); across the band kareus-00 (1.05 s <= Megatron's 1.10 s,
# kareus-01's 1.15 s is not).
BANDED = {
    "megatron": [(1.0, 40.0, 1.10, 44.0)],
    "perseus": [(1.0, 35.0, 1.10, 38.0)],
    "kareus": [(0.98, 30.0, 1.05, 33.0), (1.0, 20.0, 1.15, 22.0), (1.3, 10.0, 1.40, 40.0)],
}


def make_dir(d: Path, bands: bool = True) -> Path:
    """A plan directory of BANDED (without the bands when not `bands`); each plan a different tiny plan."""
    methods = {}
    for name, pts in BANDED.items():
        methods[name] = []
        for i, (t, e, t_hi, e_hi) in enumerate(pts):
            rel = f"plans/{name}-{i:02d}.json"
            save_plan(plans.tiny_plan(seed=i), d / rel)
            entry = {"time_s": t, "energy_j": e, "plan": rel}
            if bands:
                entry.update(time_s_band=[0.95 * t, t_hi], energy_j_band=[0.95 * e, e_hi])
            methods[name].append(entry)
    write_json_atomic(d / "frontier.json", frontier_document({"model": "tiny"}, methods))
    return d


@pytest.fixture(scope="module")
def banded(tmp_path_factory) -> Path:
    return make_dir(tmp_path_factory.mktemp("banded"))


def _args(**kw):
    base = dict(
        kareus_plan=None,
        kareus_point=None,
        kareus_robust=False,
        kareus_log=None,
        kareus_on_error="fail",
        kareus_debug=False,
        local_rank=0,
    )
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("robust, want", [(True, "kareus-00"), (False, "kareus-01")])
def test_a_robust_run_picks_the_robust_point_and_records_it(banded, tmp_path, monkeypatch, robust, want):
    """Megatron-LM's native flags (the hook): --kareus-robust runs kareus-00, the log header says robust: true."""
    import kareus_megatron.megatron as kareus

    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_LATENCY_MS", "0")
    log = tmp_path / "run"
    session = megatron_lm_hook(_args(kareus_plan=str(banded), kareus_robust=robust, kareus_log=str(log)))
    try:
        assert session.source == str(banded / "plans" / f"{want}.json")
        session.meter.set_stage(0)  # what the first step's validation does: the header is written
    finally:
        kareus.uninstall()
    header = read_run_log(log).header
    assert header.get("robust", False) is robust and header["plan"] == session.source


def test_install_and_the_launcher_pick_the_same_robust_point(banded, capsys, monkeypatch):
    """install(robust=True) (megatron-core, DeepSpeed) and kareus launch run --robust resolve kareus-00 too."""
    want = str(banded / "plans" / "kareus-00.json")
    assert kds._resolve_plan(banded, None, None, robust=True)[1] == want
    monkeypatch.setattr(cli_main, "COMMANDS", {"launch": "launch"})
    args = ["launch", "run", "--plan-dir", str(banded), "--nodes", "1", "--gpus-per-node", "2", "--dry-run"]
    assert cli_main.main([*args, "--robust"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert re.search(r"--kareus-plan (\S+)", line).group(1) == want


def _refused(capsys, argv, script: Path) -> str:
    """Run the generic launcher in process: exit status 2, one line on stderr, the script never started."""
    assert launch.main([*argv, "--", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not (script.parent / "ran").exists(), err
    return err[0]


@pytest.fixture
def script(tmp_path) -> Path:
    s = tmp_path / "train.py"
    s.write_text("from pathlib import Path\nPath(__file__).with_name('ran').write_text('x')\n")
    return s


def test_robust_refusals_are_one_line_before_training(banded, tmp_path, capsys, script):
    plan_file = str(banded / "plans" / "kareus-00.json")
    bare = make_dir(tmp_path / "bare", bands=False)
    cases = [
        (["--kareus-plan", "auto", "--kareus-workload", str(banded)], "--kareus-plan auto re-plans while training"),
        (["--kareus-plan", plan_file], f"--kareus-plan {plan_file} is one plan file"),
        (["--kareus-plan", str(bare)], "--kareus-robust needs prediction bands, but point"),
        (["--kareus-plan", str(banded), "--kareus-point", "02"], "--kareus-point 02 names one point"),
    ]
    for argv, needle in cases:
        line = _refused(capsys, [*argv, "--kareus-robust"], script)
        assert needle in line and "--kareus-robust" in line, line


def test_the_megatron_lm_hook_refuses_robust_auto_in_one_line(banded, capsys):
    with pytest.raises(SystemExit) as e:
        megatron_lm_hook(_args(kareus_plan="auto", kareus_workload=str(banded), kareus_robust=True))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "drop --kareus-robust" in err[0]


def test_api_and_config_refusals(banded, tmp_path, capsys, monkeypatch):
    import kareus_megatron.megatron as kareus

    with pytest.raises(ConfigError, match="install\\('auto'\\) re-plans while training"):
        kareus.install("auto", workload=banded, robust=True)
    with pytest.raises(ConfigError, match="no plan was given"):
        kds.install(None, log_path=tmp_path / "log", robust=True)
    cfg = {"kareus": {"plan": str(banded), "robust": "yes"}}
    with pytest.raises(ConfigError, match='"robust" must be true or false'):
        kds.from_config(cfg)
    monkeypatch.setattr(cli_main, "COMMANDS", {"launch": "launch"})
    assert cli_main.main(["launch", "comparison", "--plan-dir", str(banded), "--robust", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "add --point iso-time" in err[0]
